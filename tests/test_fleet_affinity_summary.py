"""benchmarks/fleet_affinity.py without a fleet: the trace is the same for a seed, a conversation
resends its history with the server's answers, and the summary's maths (cached share, requests
per worker and their skew, the issue's ratios)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from benchmarks.affinity_servers import PEER_FETCH_METRIC, counts_by_label, taken_by_source
from benchmarks.affinity_trace import TraceShape, generate_trace, history, tenant_of
from benchmarks.fleet_affinity import (ChatTarget, ConfigSummary, Turn, answers_differing, chat,
                                       load_skew, ratios, summarise)
from kvfleet.bench.client import RequestRecord

WORDS = [f"w{i}" for i in range(400)]  # a corpus of distinct words, to check slices exactly


def test_a_seed_gives_the_same_trace_and_another_seed_another():
    shape = TraceShape(conversations=6, tenants=3, turns=4, system_words=50)
    assert generate_trace(shape, seed=7, words=WORDS) == generate_trace(shape, seed=7, words=WORDS)
    assert generate_trace(shape, seed=7, words=WORDS) != generate_trace(shape, seed=8, words=WORDS)


def test_the_trace_has_the_shape_asked_for():
    shape = TraceShape(conversations=8, tenants=4, turns=5, system_words=60, start_window_s=3.0,
                       think_s=(0.5, 2.0))
    trace = generate_trace(shape, seed=0, words=WORDS)
    assert sorted(c.index for c in trace) == list(range(8))
    assert [c.start_s for c in trace] == sorted(c.start_s for c in trace)
    assert all(0.0 <= c.start_s <= 3.0 for c in trace)
    assert all(len(c.questions) == 5 and len(c.think_s) == 4 for c in trace)
    assert all(0.5 <= t <= 2.0 for c in trace for t in c.think_s)
    # one system prompt per tenant, shared by its conversations, different from the first word
    systems = {c.tenant: c.system for c in trace}
    assert sorted(systems) == [0, 1, 2, 3]
    assert all(c.system == systems[c.tenant] for c in trace)
    assert len({s.split()[0] for s in systems.values()}) == 4
    assert all(len(s.split("Reference:\n")[1].split()) == 60 for s in systems.values())
    # no two conversations ask the same question
    questions = [q for c in trace for q in c.questions]
    assert len(set(questions)) == len(questions)


@pytest.mark.parametrize("conversations, skew, heavy", [(10, 0.8, 8), (8, 0.8, 6), (5, 0.99, 4),
                                                         (4, 0.01, 1)])
def test_skew_gives_tenant_0_its_share_and_the_others_the_rest(conversations, skew, heavy):
    tenants = tenant_of(TraceShape(conversations=conversations, tenants=3, skew=skew))
    assert tenants.count(0) == heavy
    assert set(tenants) - {0} <= {1, 2} and len(tenants) == conversations


def test_without_skew_tenants_take_turns():
    assert tenant_of(TraceShape(conversations=6, tenants=4)) == [0, 1, 2, 3, 0, 1]


def test_each_turn_resends_the_system_prompt_and_every_earlier_question_and_answer():
    (conversation,) = generate_trace(TraceShape(conversations=1, tenants=1, turns=3,
                                                system_words=10), seed=1, words=WORDS)
    q1, q2, q3 = conversation.questions
    assert history(conversation, []) == ({"role": "system", "content": conversation.system},
                                         {"role": "user", "content": q1})
    assert [m["content"] for m in history(conversation, ["a1", "a2"])] == [
        conversation.system, q1, "a1", q2, "a2", q3]


def sse(response_id: str, text: str, prompt_tokens: int, cached_tokens: int) -> str:
    chunks = [{"id": response_id, "choices": [{"index": 0, "delta": {"content": piece}}]}
              for piece in text.split("|")]
    chunks.append({"id": response_id, "choices": [{"index": 0, "delta": {},
                                                    "finish_reason": "length"}]})
    chunks.append({"id": response_id, "choices": [], "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": prompt_tokens + 2,
        "prompt_tokens_details": {"cached_tokens": cached_tokens}}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_a_chat_sends_the_answers_it_got_and_stops_at_a_failed_turn():
    (conversation,) = generate_trace(TraceShape(conversations=1, tenants=1, turns=4,
                                                system_words=10, start_window_s=0.0,
                                                think_s=(0.0, 0.0)), seed=2, words=WORDS)
    bodies = []

    def reply(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        turn = len(bodies)
        if turn == 3:
            return httpx.Response(503, json={"error": {"message": "no worker"}})
        return httpx.Response(200, text=sse(f"chatcmpl-{turn}", f"Answer| {turn}.", 100 * turn,
                                            90 * turn - 90))

    async def run() -> tuple[list[Turn], int]:
        turns: list[Turn] = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply),
                                     base_url="http://fleet") as client:
            unsent = await chat(client, ChatTarget(model="m", temperature=0.0, max_tokens=7),
                                conversation, time.perf_counter(), turns)
        return turns, unsent

    turns, unsent = asyncio.run(run())
    assert unsent == 1  # turn 4 never sent after turn 3 failed
    assert [t.turn for t in turns] == [1, 2, 3]
    assert [t.record.ok for t in turns] == [True, True, False]
    assert turns[1].record.response_id == "chatcmpl-2"
    assert (turns[1].record.prompt_tokens, turns[1].record.cached_tokens) == (200, 90)
    assert [m["content"] for m in bodies[2]["messages"]] == [
        conversation.system, conversation.questions[0], "Answer 1.", conversation.questions[1],
        "Answer 2.", conversation.questions[2]]
    assert all(b["stream"] and b["temperature"] == 0.0 and b["max_tokens"] == 7 for b in bodies)


def turn(number: int, prompt: int, cached: int, worker: str | None, ok: bool = True,
         output: int = 32, ttft_s: float = 0.5) -> Turn:
    record = RequestRecord(0, 0.0, 32, done=ok, error=None if ok else "HTTP 500: boom",
                           prompt_tokens=prompt, cached_tokens=cached, output_tokens=output,
                           ttft_s=ttft_s)
    return Turn(conversation=0, tenant=0, turn=number, record=record, worker=worker)


def test_cached_share_counts_answered_turns_and_turns_2_on_apart():
    turns = [turn(1, 600, 0, "a"), turn(2, 700, 600, "a"), turn(3, 800, 500, "b"),
             turn(2, 900, 900, "b", ok=False)]  # a failed request's usage is left out
    s = summarise("affinity", "affinity x3", turns, 2, 10.0, ["a", "b", "c"])
    assert s.cached_share == pytest.approx(1100 / 2100)
    assert s.cached_share_later == pytest.approx(1100 / 1500)
    assert s.prompt_tokens == 2100
    assert (s.num_sent, s.num_ok, s.num_unsent, s.num_lost) == (4, 3, 2, 3)
    assert s.output_tokens_per_s == pytest.approx(96 / 10.0)
    assert s.requests_per_s == pytest.approx(0.3)
    # every sent turn, failed ones too, with where it went and what it found cached
    assert [(r["turn"], r["worker"], r["ok"], r["prompt_tokens"], r["cached_tokens"])
            for r in s.turns] == [(1, "a", True, 600, 0), (2, "a", True, 700, 600),
                                  (3, "b", True, 800, 500), (2, "b", False, 900, 900)]


def test_loads_list_idle_workers_and_count_requests_without_a_worker():
    turns = [turn(1, 10, 0, "a"), turn(1, 10, 0, "a"), turn(2, 10, 0, "b"),
             turn(2, 10, 0, None), turn(3, 10, 0, "c", ok=False)]
    s = summarise("shared", "shared x3", turns, 0, 1.0, ["a", "b", "c"])
    assert s.loads == {"a": 2, "b": 1, "c": 0}
    assert s.num_unattributed == 1
    assert s.load_skew == pytest.approx(2 / 1)  # max 2, mean 3 / 3


def test_load_skew_is_max_over_mean():
    assert load_skew({"a": 8, "b": 2, "c": 2}) == pytest.approx(8 / 4)
    assert load_skew({"a": 4, "b": 4}) == 1.0
    assert load_skew({"a": 0, "b": 0}) is None


def summary(config: str, share: float, later: float, p90: float, tokens_per_s: float,
            skew: float) -> ConfigSummary:
    s = summarise(config, config, [turn(1, 100, round(100 * share), "a", ttft_s=p90),
                                   turn(2, 100, round(100 * later), "a", ttft_s=p90)],
                  0, 64 / tokens_per_s, ["a"])
    return dataclasses.replace(s, load_skew=skew)


def test_ratios_against_the_issue_targets():
    by_config = {"single": summary("single", 0.5, 0.9, 4.0, 10.0, 1.0),
                 "shared": summary("shared", 0.3, 0.6, 6.0, 12.0, 1.1),
                 "affinity": summary("affinity", 0.5, 0.88, 1.5, 16.0, 1.6),
                 "sglang": summary("sglang", 0.4, 0.8, 3.0, 14.0, 1.5)}
    got = {r.label: r for r in ratios(by_config)}
    all_turns = got["cached share, affinity / 1 worker (all turns)"]
    assert all_turns.value == pytest.approx((50 + 88) / (50 + 90)) and all_turns.verdict == "met"
    assert got["cached share, affinity / 1 worker (turns 2..)"].value == pytest.approx(0.88 / 0.9)
    ttft = got["TTFT p90, shared / affinity"]
    assert ttft.value == pytest.approx(4.0) and ttft.verdict == "met"
    tps = got["output tok/s, affinity / shared"]
    assert tps.value == pytest.approx(16 / 12) and tps.verdict == "met"
    skew = got["requests per worker, max / mean, affinity (target with --skew)"]
    assert skew.value == 1.6 and skew.verdict == "NOT met"
    peer = got["cached share (turns 2..), affinity / sglang-router"]
    assert peer.value == pytest.approx(0.88 / 0.8) and peer.verdict == ""  # no target
    assert got["TTFT p90, sglang-router / affinity"].value == pytest.approx(2.0)


def test_ratios_of_configurations_not_run_are_none():
    got = ratios({"shared": summary("shared", 0.3, 0.6, 6.0, 12.0, 1.1)})
    assert all(r.value is None and r.verdict == "" for r in got)


def test_requests_taken_are_read_by_source_from_a_workers_metrics():
    registry = CollectorRegistry()  # what a worker's /metrics serves (prometheus_client's text)
    taken = Counter("kvfleet_worker_requests_taken", "by source", ("model", "worker", "source"),
                    registry=registry)
    taken.labels("m", "w0", "own").inc(12)
    taken.labels("m", "w0", "other").inc(3)
    Counter("kvfleet_worker_requests_started", "started", ("model", "worker"),
            registry=registry).labels("m", "w0").inc(15)
    assert taken_by_source(generate_latest(registry).decode()) == {"own": 12, "other": 3}
    assert taken_by_source('kvfleet_worker_running{model="m",worker="w0"} 1.0\n') == {}


def test_prompt_tokens_computed_against_one_worker_and_without_peer_fetch():
    # (prompt, cached) per turn: the single worker computes 100 + 20, the fleet with fetches
    # 100 + 26, without them 100 + 100 (the second turn landed where its prefix was not)
    single = summarise("single", "1", [turn(1, 100, 0, "a"), turn(2, 120, 100, "a")], 0, 1.0,
                       ["a"])
    fetch = summarise("affinity", "x3", [turn(1, 100, 0, "a"), turn(2, 120, 94, "b")], 0, 1.0,
                      ["a", "b"])
    nofetch = summarise("affinity-nofetch", "x3 no fetch",
                        [turn(1, 100, 0, "a"), turn(2, 120, 20, "b")], 0, 1.0, ["a", "b"])
    assert (single.computed_tokens, fetch.computed_tokens, nofetch.computed_tokens) == (
        120, 126, 200)
    assert nofetch.computed_by_turn == {1: 100, 2: 100}  # the excess is the second turn's
    got = {r.label: r for r in ratios({"single": single, "affinity": fetch,
                                       "affinity-nofetch": nofetch})}
    ideal = got["prompt tokens computed, affinity / 1 worker (the ideal)"]
    assert ideal.value == pytest.approx(126 / 120) and ideal.verdict == "met"  # 1.05
    assert got["prompt tokens computed, affinity without / with peer fetch"].value == (
        pytest.approx(200 / 126))
    share = got["cached share, affinity / 1 worker (all turns; issue 52)"]
    assert share.value == pytest.approx(94 / 100) and share.verdict == "NOT met"  # 0.99


def test_peer_fetches_are_read_by_outcome_from_a_workers_metrics():
    registry = CollectorRegistry()
    fetches = Counter("kvfleet_worker_kv_peer_fetches", "by outcome",
                      ("model", "worker", "outcome"), registry=registry)
    fetches.labels("m", "w0", "fetched").inc(3)
    fetches.labels("m", "w0", "joined").inc(5)
    fetches.labels("m", "w0", "late")  # listed, never counted
    got = counts_by_label(generate_latest(registry).decode(), PEER_FETCH_METRIC, "outcome")
    assert got == {"fetched": 3, "joined": 5, "late": 0}
    assert counts_by_label(generate_latest(registry).decode(), "kvfleet_worker_requests_taken",
                           "source") == {}


def test_answers_are_compared_by_conversation_and_turn():
    def answered(conversation: int, number: int, text: str) -> Turn:
        record = RequestRecord(0, 0.0, 32, done=True, prompt_tokens=10, cached_tokens=0)
        record.content.append(text)
        return Turn(conversation, 0, number, record, "w0")

    reference = summarise("single", "1 worker", [answered(0, 1, "a"), answered(0, 2, "b"),
                                                 answered(1, 1, "c")], 0, 1.0, ["w0"])
    other = summarise("affinity", "affinity x3", [answered(0, 1, "a"), answered(0, 2, "B"),
                                                  answered(2, 1, "d")], 0, 1.0, ["w0"])
    assert other.answers == {"0-1": "a", "0-2": "B", "2-1": "d"}
    assert answers_differing(other, reference) == (1, 2)  # conversation 2 was not in the first
