"""One real fleet (a gateway and two worker processes on the default model) shared by the e2e
tests, on a Redis of its own: the session's Redis is flushed around every test that asks for an
empty database, and a live fleet writes into its Redis all the time (heartbeats, block
announcements, streams made again after a flush), so the two do not share one."""

from __future__ import annotations

import pytest

from shared.redis_server import EmbeddedRedis
from tests.helpers.processes import ProcessFleet


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    with EmbeddedRedis() as server:
        fleet = ProcessFleet(server.url, tmp_path_factory.mktemp("fleet-logs"))
        try:
            fleet.start("w0", "w-second")  # both load while the gateway starts
            yield fleet
        finally:
            fleet.kill()
