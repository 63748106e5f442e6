import socket

import redis

from kvfleet.shared.redis_server import EmbeddedRedis, find_redis_server


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


def test_a_cluster_that_does_not_form_starts_again_on_fresh_ports(monkeypatch):
    from kvfleet.shared.redis_cluster import EmbeddedCluster, FormationTimeout

    formed = EmbeddedCluster._form
    tries = []

    def first_one_times_out(cluster, timeout_s):
        tries.append((list(cluster.nodes), list(cluster.bus_ports)))
        if len(tries) == 1:
            raise FormationTimeout("embedded Redis Cluster: the nodes did not all meet")
        formed(cluster, timeout_s)

    monkeypatch.setattr(EmbeddedCluster, "_form", first_one_times_out)
    with EmbeddedCluster(num_primaries=1, replicas=0) as cluster:
        (first_nodes, first_bus), (second_nodes, second_bus) = tries
        assert first_bus != second_bus and first_nodes[0] is not second_nodes[0]
        assert gone(first_nodes[0])  # the first try's nodes were stopped
        client = redis.RedisCluster.from_url(cluster.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    tries.clear()
    monkeypatch.setattr(EmbeddedCluster, "_form", lambda cluster, timeout_s: (_ for _ in ()).throw(
        FormationTimeout("embedded Redis Cluster: the nodes did not all meet")))
    failing = EmbeddedCluster(num_primaries=1, replicas=0)
    try:
        failing.start(attempts=2)
    except FormationTimeout:
        pass
    else:
        raise AssertionError("a cluster that never forms must raise")
    assert all(gone(node) for node in failing.nodes)


def gone(node) -> bool:
    """Nothing listens on its port (a plain connect: redis-py would retry a refused one)."""
    try:
        socket.create_connection(("127.0.0.1", node.port), timeout=0.5).close()
    except OSError:
        return True
    return False
