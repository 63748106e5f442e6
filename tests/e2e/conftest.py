"""One real fleet (a gateway and two worker processes on the default model) shared by the e2e
tests."""

from __future__ import annotations

import pytest

from tests.helpers.processes import ProcessFleet


@pytest.fixture(scope="session")
def fleet(redis_server, tmp_path_factory):
    fleet = ProcessFleet(redis_server.url, tmp_path_factory.mktemp("fleet-logs"))
    try:
        fleet.start("w0", "w-second")  # both load while the gateway starts
        yield fleet
    finally:
        fleet.stop()
