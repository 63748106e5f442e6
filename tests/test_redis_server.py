from shared.redis_server import EmbeddedRedis, find_redis_server
import redis


def test_embedded_redis_starts_answers_and_is_removed():
    server = EmbeddedRedis().start()
    client = redis.Redis.from_url(server.url)
    assert client.ping()
    client.set("k", "v")
    assert client.get("k") == b"v"
    server.stop()
    try:
        redis.Redis.from_url(server.url, socket_connect_timeout=0.5).ping()
        answered = True
    except redis.ConnectionError:
        answered = False
    assert not answered


def test_redis_fixture_gives_an_empty_database(redis_client):
    assert redis_client.dbsize() == 0
    redis_client.set("left-behind", 1)


def test_redis_fixture_flushes_between_tests(redis_client):
    assert redis_client.get("left-behind") is None


def test_a_redis_server_binary_is_found():
    assert find_redis_server().endswith("redis-server")
