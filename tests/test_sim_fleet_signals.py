"""benchmarks/sim_fleet.py's stop_fleets_on_sigterm: a benchmark killed with SIGTERM (a `timeout`)
runs its `finally` blocks, which stop the fleets it started; without it Python runs none."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, time
from benchmarks.sim_fleet import stop_fleets_on_sigterm
if sys.argv[2] == "handled":
    stop_fleets_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    open(sys.argv[1], "w").write("fleet stopped")
"""


@pytest.mark.parametrize("mode", ["handled", "default"])
def test_a_benchmark_killed_by_sigterm_stops_its_fleets(tmp_path: Path, mode: str):
    marker = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(marker), mode], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    if mode == "handled":
        assert code == 128 + signal.SIGTERM and marker.read_text() == "fleet stopped"
    else:  # the negative control: Python's default leaves the finally block unrun
        assert code == -signal.SIGTERM and not marker.exists()
