"""`kvfleet up --sim-workers 40 --sim-device h100 --model random:qwen3-32b
--tensor-parallel-size 2`: a fleet of 40 simulated H100 workers (two processes of 20) with the
real gateway, Redis and batch worker, no accelerator and no weights: the gateway serves an
OpenAI client from them, every worker heartbeats as simulated, and Ctrl-C stops them all.
Bad simulation flags are refused before anything starts, naming the flag."""

from __future__ import annotations

import signal
import time
import uuid

import httpx
import pytest
import redis

from kvfleet.shared.models import default_cache_dir
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import Heartbeat, Keys
from tests.helpers.processes import Proc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "random:qwen3-32b"
WORKERS = 40


def test_up_runs_a_fleet_of_simulated_h100s_behind_the_real_gateway(redis_server, tmp_path):
    port = free_port()
    prefix = f"sim-{uuid.uuid4().hex[:8]}:"
    env = {"KVFLEET_REDIS_URL": redis_server.url, "KVFLEET_KEY_PREFIX": prefix}
    fleet = Proc(["up", "--sim-workers", str(WORKERS), "--sim-device", "h100", "--model", MODEL,
                  "--tensor-parallel-size", "2", "--sim-answer-tokens", "fixed:9",
                  "--port", str(port)], env, tmp_path, "up")
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(prefix)
    try:
        deadline = time.monotonic() + 240
        while len(client.keys(keys.worker("*"))) < WORKERS:
            assert fleet.popen.poll() is None, fleet.log_text()[-4000:]
            assert time.monotonic() < deadline, fleet.log_text()[-4000:]
            time.sleep(0.5)
        beats = [Heartbeat.decode(client.hgetall(k)) for k in client.keys(keys.worker("*"))]
        assert all("qwen3-32b" in b.simulated and "h100" in b.simulated for b in beats)
        assert len({b.metrics_url for b in beats}) == 2  # one endpoint per process
        urls = {f"http://127.0.0.1:{b.metrics_url.rsplit(':', 1)[1]}" for b in beats}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}],
                "max_tokens": 32}
        answers = []
        for _ in range(3):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                  timeout=60)
            assert response.status_code == 200, response.text
            answers.append(response.json())
        # the drawn answer length (9 tokens, EOS the 9th) and the same text every time: the
        # tokens depend on the request only, whichever worker answered
        assert all(a["usage"]["completion_tokens"] == 9 for a in answers)
        assert all(a["choices"][0]["finish_reason"] == "stop" for a in answers)
        assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1
        steps = 0
        for url in urls:
            text = httpx.get(url, timeout=10).text
            steps += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("kvfleet_worker_sim_steps_total{"))
        assert steps >= 3 * 8  # each answer's prefill and decode steps, played by the workers
        assert not (default_cache_dir() / "random-qwen3-32b").exists()  # no weights made
    finally:
        fleet.popen.send_signal(signal.SIGINT)
        fleet.wait_exit(timeout_s=40)
    assert fleet.popen.returncode == 0, fleet.log_text()[-4000:]
    assert f"+ {WORKERS} simulated in 2 process(es)" in fleet.log_text()


@pytest.mark.parametrize("flags, says", [
    (["--sim-workers", "4"], "exactly one cost model"),
    (["--sim-workers", "4", "--sim-device", "tpu9"], "unknown accelerator"),
    (["--sim-device", "h100"], "give --sim-workers N"),
    (["--sim-workers", "4", "--sim-device", "h100", "--sim-answer-tokens", "normal:5"],
     "fixed:N, uniform:A-B or exp:MEAN"),
    (["--sim-workers", "2", "--sim-step-cost", "/nonexistent/curve.json"], "no such file"),
])
def test_bad_simulation_flags_are_refused_before_anything_starts(tmp_path, flags, says):
    fleet = Proc(["up", *flags, "--port", str(free_port())], {}, tmp_path, "up")
    fleet.wait_exit(timeout_s=60)
    assert fleet.popen.returncode != 0
    log = fleet.log_text()
    assert says in log and "started an embedded Redis" not in log
