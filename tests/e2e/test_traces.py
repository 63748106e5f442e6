"""Traces from a real fleet (a gateway and three worker processes, `--otlp-traces-endpoint` at
an OTLP/HTTP receiver in the test): one trace per request, the workers' spans under the
gateway's, across a SIGKILLed worker (its requests' spans come from the worker that resumed
them) and a drain (the source's spans marked left, the taker's continuing the same trace)."""

from __future__ import annotations

import signal
import time

import pytest

from kvfleet.shared.redis_connect import connect
from tests.e2e.test_failover import request_body, run_all
from tests.helpers.otlp import Receiver, span_attributes
from tests.helpers.processes import ProcessFleet
from tests.helpers.streams import when_streaming

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BODIES = [request_body(i) for i in range(4)]  # greedy, 48 tokens, streamed


class TracedFleet(ProcessFleet):
    def __init__(self, *args, traces: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.traces = traces

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, **self.traces}


def test_one_trace_per_request_across_a_kill_and_a_drain(redis_url, tmp_path):
    receiver = Receiver()
    fleet = TracedFleet(redis_url, tmp_path, traces={
        "KVFLEET_OTLP_TRACES_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"},
        worker_flags=["--kv-memory", "256MiB", "--num-threads", "1", "--heartbeat-ttl-s", "2",
                      "--heartbeat-interval-s", "0.5"])
    client = connect(redis_url)
    acted: dict[str, object] = {}

    def act(name: str, sig: int):
        def on(ids, owners):
            worker = owners[0].decode()
            acted[name] = (worker, {i for i, o in zip(ids, owners) if o == owners[0]})
            fleet.workers[worker].popen.send_signal(sig)
        return on

    def streaming(ids, owners, progress):
        return all(owners) and min(progress) >= 10

    try:
        fleet.start("w-a", "w-b", "w-c")
        killed = run_all(fleet.url, bodies=BODIES, on_started=when_streaming(
            client, fleet.keys, streaming, act("kill", signal.SIGKILL), "requests streaming"))
        victim, victims_ids = acted["kill"]
        fleet.workers[victim].wait_exit()
        drained = run_all(fleet.url, bodies=BODIES, on_started=when_streaming(
            client, fleet.keys, streaming, act("drain", signal.SIGTERM), "requests streaming"))
        source, sources_ids = acted["drain"]
        fleet.workers[source].wait_exit(60)  # its drain ends: its last spans exported at exit
        assert fleet.workers[source].popen.returncode == 0
        records = killed + drained
        assert all(r["finish_reason"] == "length" for r in records)

        def gathered():
            spans = [(resource, span, span_attributes(span))
                     for resource, span in receiver.spans()]
            finals = [s for s in spans if s[2].get("gen_ai.response.finish_reasons")]
            return spans if len(finals) >= 2 * len(records) else None  # gateway + worker each
        deadline = time.monotonic() + 20
        while (spans := gathered()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert spans is not None, f"{len(receiver.spans())} spans received"
    finally:
        fleet.kill()
        client.close()
        receiver.close()

    gateway = {a["gen_ai.request.id"]: s for r, s, a in spans
               if r["service.name"] == "kvfleet-gateway"}
    assert sorted(gateway) == sorted(r["id"] for r in records)
    assert len({s.trace_id for s in gateway.values()}) == len(records)  # a trace per request
    by_trace: dict[bytes, list] = {}
    for resource, span, attributes in spans:
        if resource["service.name"] == "kvfleet-worker" and span.name == "worker":
            by_trace.setdefault(span.trace_id, []).append((resource, span, attributes))
    assert set(by_trace) == {s.trace_id for s in gateway.values()}
    for req_id, parent in gateway.items():
        workers = by_trace[parent.trace_id]
        for _resource, span, attributes in workers:
            assert span.parent_span_id == parent.span_id  # under the gateway's span
            assert attributes["gen_ai.request.id"] == req_id
        [final] = [w for w in workers if w[2].get("gen_ai.response.finish_reasons")]
        resource, _span, attributes = final
        assert attributes["gen_ai.response.finish_reasons"] == ("length",)
        if req_id in victims_ids:  # resumed from its checkpoint elsewhere; the victim sent none
            assert resource["service.instance.id"] != victim
            assert attributes["kvfleet.deliveries"] >= 2
            assert attributes["kvfleet.resumed_tokens"] >= 10
            assert len(workers) == 1
        if req_id in sources_ids:  # handed on by the drain: the source's span says it left
            left = [w for w in workers if w[2]["kvfleet.left"]]
            assert [w[0]["service.instance.id"] for w in left] == [source]
            assert resource["service.instance.id"] != source
            assert attributes["kvfleet.resumed_tokens"] >= 10
