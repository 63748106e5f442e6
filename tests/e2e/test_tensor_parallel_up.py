"""`kvfleet up --workers 1 --tensor-parallel-size 2` on the CPU: one worker of two gloo ranks
serves the default model (9 heads in 3 KV groups: 6 + 3 heads per rank) through the gateway with
the greedy text transformers' `generate` gives; Ctrl-C (SIGINT) stops every rank."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid

import httpx
import pytest
import redis

from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import Keys
from tests.helpers.processes import Proc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 24


def test_up_with_two_ranks_serves_the_greedy_text(redis_server, tmp_path, hf_reference):
    port = free_port()
    prefix = f"tp-{uuid.uuid4().hex[:8]}:"
    env = {"KVFLEET_REDIS_URL": redis_server.url, "KVFLEET_KEY_PREFIX": prefix}
    # float32: the text is compared with HF's float32 greedy text, token for token (auto is bf16
    # on CPUs with native bf16)
    fleet = Proc(["up", "--workers", "1", "--tensor-parallel-size", "2", "--port", str(port),
                  "--kv-memory", "128MiB", "--dtype", "float32"], env, tmp_path, "up")
    client = redis.Redis.from_url(redis_server.url)
    try:
        deadline = time.monotonic() + 240
        while not client.keys(Keys(prefix).worker("*")):
            assert fleet.popen.poll() is None, fleet.log_text()[-4000:]
            assert time.monotonic() < deadline, fleet.log_text()[-4000:]
            time.sleep(0.5)
        body = {"model": DEFAULT_MODEL, "messages": MESSAGES, "temperature": 0,
                "max_tokens": MAX_TOKENS}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                              timeout=180)
        assert response.status_code == 200, response.text
        answer = response.json()
        text, num_tokens = hf_reference.greedy(MESSAGES, MAX_TOKENS)
        assert answer["choices"][0]["message"]["content"] == text
        assert answer["usage"]["completion_tokens"] == num_tokens
        log = fleet.log_text()
        assert "tensor parallel over 2 ranks" in log
        rank_pids = [int(p) for p in re.search(r"\(pids ([\d, ]+)\)", log)[1].split(", ")]
    finally:
        # what Ctrl-C sends; waited for longer than `up` waits for its children (15 s) before it
        # kills a stuck one itself, so a slow child shows in the log, not as `up` killed here
        fleet.popen.send_signal(signal.SIGINT)
        fleet.wait_exit(timeout_s=40)
    assert fleet.popen.returncode == 0, fleet.log_text()[-4000:]
    assert "rank 1 stopped" in fleet.log_text()
    for pid in rank_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
