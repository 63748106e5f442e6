"""A constrained request whose worker is SIGKILLed mid-answer continues on another worker with
exactly the text an uninterrupted run gives, and that text still fits the schema."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis

from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.wire import Keys, RequestRecord
from kvfleet.shared.wire.checkpoint import TOKEN_BYTES
from tests.e2e.test_failover import stream_text
from tests.helpers.processes import ProcessFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["words"],
          "properties": {"words": {"type": "array", "minItems": 24, "maxItems": 24,
                                   "items": {"type": "string", "maxLength": 6}}}}
BODY = {"model": DEFAULT_MODEL, "stream": True, "max_tokens": 300, "temperature": 0.9,
        "seed": 7, "messages": [{"role": "user", "content": "List some words."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}


def test_constrained_stream_survives_sigkill(redis_server, tmp_path):
    fleet = ProcessFleet(redis_server.url, tmp_path,
                         worker_flags=["--dtype", "auto", "--kv-memory", "256MiB",
                                       "--num-threads", "1", "--heartbeat-ttl-s", "2",
                                       "--heartbeat-interval-s", "0.5"])
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(fleet.prefix)
    try:
        # both workers load at once; whichever takes the request is the victim, the other resumes
        fleet.start("w-a", "w-b")
        reference: dict = {}
        stream_text(fleet.url, BODY, reference)
        assert reference["finish_reason"] == "stop"
        assert len(json.loads(reference["text"])["words"]) == 24
        record: dict = {}
        thread = threading.Thread(target=stream_text, args=(fleet.url, BODY, record))
        thread.start()
        victim = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # kill once the victim has produced some tokens
            req_id = record.get("id")
            if req_id and client.strlen(keys.checkpoint(req_id)) // TOKEN_BYTES >= 10:
                owner = client.hget(keys.request(req_id), RequestRecord.WORKER).decode()
                victim = fleet.workers[owner]
                victim.kill()
                break
            time.sleep(0.02)
        assert victim is not None, "the request never streamed"
        assert victim.popen.returncode is not None or victim.popen.wait(10) == -9
        thread.join(timeout=600)
        assert record["text"] == reference["text"]
        assert record["finish_reason"] == "stop"
        attempt = client.hget(keys.request(record["id"]), RequestRecord.ATTEMPT)
        assert attempt not in (b"1", None), "the rescuer resumed the request"
    finally:
        fleet.kill()
