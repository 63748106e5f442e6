"""LoRA adapters through the fleet with the official `openai` client, at the default dtype (bf16
on CPUs with native bf16) and `--deterministic`: adapters named at the gateway's start and
registered at run time are listed with their parent and served in mixed batches (more adapters
than the worker keeps, so one waits and one is evicted); a request naming an unknown model
gets OpenAI's 404, a bad adapter a 400 at registration; and when the worker is SIGKILLed
mid-answer another resumes every stream under its own adapter with the same text."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from benchmarks.lora import make_adapters
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import Heartbeat, RequestRecord
from kvfleet.shared.wire.checkpoint import TOKEN_BYTES
from tests.e2e.test_failover import run_all as stream_all
from tests.helpers.metrics import metric_total
from tests.helpers.processes import ProcessFleet

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 40
PROMPT = "Write a short note to a neighbour about a parcel that came for them while they were out."
# B ~ N(0, 0.05²) on rank 8: enough to change a 135M model's greedy answer
ADAPTER_B_STD = 0.05


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("adapters")
    made = make_adapters(resolve_model_path(DEFAULT_MODEL), directory, 4, rank=8,
                         b_std=ADAPTER_B_STD, seed=11)
    return dict(zip(["a0", "a1", "a2", "a3"], made.values()))


def stream(url: str, model: str, record: dict) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    text = []
    for chunk in chunks:
        record.setdefault("id", chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            record["finish_reason"] = chunk.choices[0].finish_reason
    record["text"] = "".join(text)


def run_all(url: str, models: list[str], on_started=None) -> list[dict]:
    """Stream one request per model at once, through the openai client."""
    return stream_all(url, on_started, models, stream=stream)


def test_adapters_served_listed_mixed_and_resumed(redis_url, tmp_path, adapters):
    flags = ["--dtype", "auto", "--kv-memory", "256MiB", "--num-threads", "1",
             "--enable-lora", "--max-loras", "3", "--max-cpu-loras", "3",
             "--max-lora-rank", "8", "--heartbeat-ttl-s", "2", "--heartbeat-interval-s", "0.5"]
    fleet = ProcessFleet(redis_url, tmp_path, worker_flags=flags,
                         gateway_flags=["--lora-modules", f"a0={adapters['a0']}",
                                        "--max-lora-rank", "8"])
    client = connect(redis_url)
    sdk = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", timeout=120)
    try:
        (victim,) = fleet.start("victim")
        for name in ("a1", "a2", "a3"):  # registered at run time, for the whole fleet
            reply = httpx.post(f"{fleet.url}/v1/load_lora_adapter", timeout=30,
                               json={"lora_name": name, "lora_path": adapters[name]})
            assert reply.status_code == 200, reply.text
        listed = {m.id: m for m in sdk.models.list().data}
        assert {DEFAULT_MODEL, "a0", "a1", "a2", "a3"} <= set(listed)
        assert all(getattr(listed[n], "parent", None) == DEFAULT_MODEL for n in ("a0", "a1"))

        bad = httpx.post(f"{fleet.url}/v1/load_lora_adapter", timeout=30,
                         json={"lora_name": "bad", "lora_path": str(tmp_path / "nowhere")})
        assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            sdk.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)

        # one worker, mixed batches; 4 adapters > the 3 it keeps: one waits, one is evicted
        reference = run_all(fleet.url, [DEFAULT_MODEL, "a0", "a1", "a2", "a3"])
        texts = [r["text"] for r in reference]
        assert all(r["finish_reason"] == "length" for r in reference)
        assert len(set(texts)) == len(texts), "an adapter answered as another or as the base"
        beat = Heartbeat.decode(client.hgetall(fleet.keys.worker("victim")))
        assert metric_total(beat.metrics_url, "kvfleet_worker_lora_evictions_total") >= 1
        models, reference = [DEFAULT_MODEL, "a0", "a1", "a2"], reference[:4]

        def kill_when_streaming(records):
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                ids = [r.get("id") for r in records]
                if all(ids):
                    owners = [client.hget(fleet.keys.request(i), RequestRecord.WORKER)
                              for i in ids]
                    progress = [client.strlen(fleet.keys.checkpoint(i)) // TOKEN_BYTES
                                for i in ids]
                    if all(o == b"victim" for o in owners) and min(progress) >= 6:
                        fleet.start_worker("rescuer", wait=False)
                        victim.kill()  # SIGKILL
                        return
                time.sleep(0.02)
            raise AssertionError("the victim never streamed every request")

        records = run_all(fleet.url, models, on_started=kill_when_streaming)
        assert victim.popen.returncode == -9
        for model, got, want in zip(models, records, reference):
            assert got["finish_reason"] == "length"
            assert got["text"] == want["text"], f"{model} resumed with another answer"
        beat = Heartbeat.decode(client.hgetall(fleet.keys.worker("rescuer")))
        served = metric_total(beat.metrics_url, "kvfleet_worker_lora_requests_total")
        assert served == 3
        assert all(client.hget(fleet.keys.request(r["id"]), RequestRecord.ATTEMPT) == b"2"
                   for r in records)
    finally:
        client.close()
        fleet.kill()

