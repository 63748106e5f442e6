"""Test fixtures shared by every layer: a private Redis server (or Redis Cluster) and an empty
database per test.

A test module that sets `pytestmark = pytest.mark.topologies` runs each of its tests that use
`redis_url` twice: on a single Redis and on a local Redis Cluster of 3 primaries + 3 replicas
(`redis_topology` says which). Every other test runs on a single Redis.

The processes tests start (ProcessFleet's gateways and workers, the integration tests' slow
workers) are forked from fork servers (tests/helpers/forkserver.py) that imported each one's
modules once: a worker starts with 5 s less CPU (torch, transformers, the engine), which a
2-core host otherwise spends again on each of the ~30 workers the suite starts."""

from __future__ import annotations

import os

import pytest
from _pytest.mark.expression import Expression

from kvfleet.shared.redis_cluster import EmbeddedCluster
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.redis_server import EmbeddedRedis
from tests.helpers import forkserver


def selects_cuda(markexpr: str) -> bool:
    """Whether a `-m` expression aims the run at the GPU tests: it admits a test marked only
    `cuda` and not an unmarked one (`-m cuda`, `-m "cuda and not slow"`; not `-m "not slow"`)."""
    if not markexpr:
        return False
    expression = Expression.compile(markexpr)
    return (expression.evaluate(lambda name, **kwargs: name == "cuda")
            and not expression.evaluate(lambda name, **kwargs: False))


def interpret_unless_a_gpu_run(markexpr: str) -> None:
    """A run not aimed at the GPU tests runs the Triton kernels under Triton's interpreter, on CPU
    tensors, whether or not the host has a GPU; `-m cuda` runs them compiled. One process runs
    one of the two, so a run mixing both kinds is taken as a CPU run. An explicit
    TRITON_INTERPRET in the environment wins."""
    if not selects_cuda(markexpr):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_plugin_registered(plugin):
    """Triton reads TRITON_INTERPRET when it is imported, and a conftest below this one (loaded
    before `pytest_configure` when a test path is given) may import it: so the variable is set as
    soon as this conftest is registered, from the command line parsed by then."""
    if isinstance(plugin, pytest.Config):
        interpret_unless_a_gpu_run(plugin.known_args_namespace.markexpr)


TOPOLOGIES = ("single", "cluster")

# What each fork server imports before it forks: what its processes import before they serve (a
# worker: also while it loads its model). Not the module a child runs (`kvfleet`'s __main__,
# tests.integration.slow_worker): runpy runs that anew in the child.
FORK_SERVERS = {
    "gateway": ["kvfleet.cli", "kvfleet.gateway.app", "transformers.models.auto.tokenization_auto",
                "transformers.models.llama.configuration_llama", "uvicorn"],
    "worker": ["kvfleet.cli", "kvfleet.worker.process.main", "transformers.models.auto.tokenization_auto",
               "transformers.models.auto.modeling_auto",
               "transformers.models.llama.modeling_llama", "transformers.generation.utils"],
    "slow_worker": ["redis", "kvfleet.shared.settings", "kvfleet.shared.wire", "tests.engine.tiny_models",
                    "kvfleet.worker.engine.engine", "kvfleet.worker.process.tp_rank", "kvfleet.worker.metrics",
                    "kvfleet.worker.protocol", "kvfleet.worker.process.service"],
}


@pytest.fixture(scope="session", autouse=True)
def fork_servers(tmp_path_factory):
    """The session's fork servers, each started by the first process forked from it."""
    servers = forkserver.ForkServers(FORK_SERVERS,
                                     tmp_path_factory.getbasetemp() / "fork-servers")
    forkserver.install(servers)
    try:
        yield servers
    finally:
        forkserver.install(None)
        servers.close()


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server of the test session's own, on a free port: never the one a user runs."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """A Redis Cluster of the test session's own (3 primaries + 3 replicas on free ports)."""
    with EmbeddedCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_topology(request) -> str:
    return getattr(request, "param", "single")


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("topologies") is None:
        return
    if "redis_url" in metafunc.fixturenames or "redis_topology" in metafunc.fixturenames:
        metafunc.parametrize("redis_topology", TOPOLOGIES, indirect=True)


@pytest.fixture
def redis_deployment(request, redis_topology):
    """The running server (EmbeddedRedis) or cluster (EmbeddedCluster) of this test."""
    return request.getfixturevalue("redis_cluster" if redis_topology == "cluster"
                                   else "redis_server")


@pytest.fixture
def redis_url(redis_deployment) -> str:
    """URL of an empty database, flushed before and after the test."""
    redis_deployment.flush()
    yield redis_deployment.url
    redis_deployment.flush()


@pytest.fixture
def redis_client(redis_url):
    """A blocking client: redis-py's cluster client on a cluster."""
    client = connect(redis_url)
    yield client
    client.close()


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: left out unless the run is aimed at them (`-m cuda`, as
    gpu_check.sh runs), so a CPU-only run neither fails nor reports them as skipped."""
    if selects_cuda(config.getoption("markexpr")):
        return
    kept = [item for item in items if item.get_closest_marker("cuda") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("cuda")])
        items[:] = kept
