"""The simulated engine (worker/sim/engine.py, tokens.py, clock.py): the real scheduler and
block manager over a cost model, tokens that depend only on the request, a clock that plays each
step for its modelled time and counts the steps it could not play in time."""

from __future__ import annotations

import pytest

from kvfleet.shared.engine_config import EngineConfig
from kvfleet.shared.pace import StepCostCurve, StepFeatures
from kvfleet.shared.wire import RequestStatus, SamplingParams
from kvfleet.worker.engine.core.handoff import HandoffError, SequenceState
from kvfleet.worker.engine.lora import LoraLoadError, LoraRequest
from kvfleet.worker.sim.clock import INVALID_LAG_SHARE, SimLag, StepClock
from kvfleet.worker.sim.cost import RooflineCost
from kvfleet.worker.sim.engine import SimEngine
from kvfleet.worker.sim.tokens import AnswerLengths, AnswerTokens

VOCAB, EOS = 512, 2


class FakeTime:
    """A clock whose sleeps advance it, and which the test can make late."""

    def __init__(self):
        self.t = 100.0
        self.oversleep = 0.0  # each sleep wakes this much late
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds + self.oversleep


class LinearCost:
    """A measured-curve-like cost: seconds = base + per token."""

    def __init__(self, base_s=0.01, token_s=0.001):
        self.curve = StepCostCurve(base_s=base_s, decode_row_s=token_s, prefill_token_s=token_s,
                                   steps=1)
        self.calls: list[StepFeatures] = []

    def step_seconds(self, work: StepFeatures) -> float:
        self.calls.append(work)
        return self.curve.step_seconds(work)

    def describe(self) -> str:
        return "linear test cost"


def engine(cost=None, time=None, scale=1.0, blocks=256, answers="max", kv_bytes=1000,
           **config) -> SimEngine:
    time = time or FakeTime()
    config.setdefault("block_size", 4)
    return SimEngine(EngineConfig(device="cpu", pace_warmup=False, **config),
                     cost or LinearCost(), vocab_size=VOCAB, eos_token_ids=[EOS],
                     max_model_len=1024, num_blocks=blocks,
                     answer_lengths=AnswerLengths.parse(answers),
                     clock=StepClock(scale, clock=time.now, sleep=time.sleep),
                     kv_bytes_per_token=kv_bytes)


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % (VOCAB - 3) for i in range(n)]


def test_tokens_depend_on_the_request_and_position_only():
    params = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)
    prompts = [prompt(10, 1), prompt(37, 2), prompt(10, 3)]
    alone = [engine().generate([p], params)[0] for p in prompts]
    together = engine(max_batched_tokens=16).generate(prompts, params)
    assert together == alone and all(len(t) == 24 for t in alone)
    assert len({tuple(t) for t in alone}) == 3  # different prompts, different answers
    assert all(EOS not in t and min(t) >= 3 for t in alone)
    # another seed answers otherwise (the negative control of "the same for every worker")
    other = AnswerTokens(VOCAB, [EOS], AnswerLengths(), seed=1)
    key = other.key(prompts[0])
    assert [other.token(key, i, None, True) for i in range(24)] != alone[0]


def test_a_resumed_request_continues_with_the_tokens_the_first_engine_would_have_written():
    params = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    p = prompt(21, 5)
    whole = engine().generate([p], params)[0]
    second = engine()
    second.add_request("r", p, params, output_token_ids=whole[:11])
    rest = []
    while second.has_unfinished():
        for out in second.step():
            rest += out.new_token_ids
    assert whole[:11] + rest == whole


def test_answer_lengths_end_with_eos_unless_the_request_ignores_it():
    params = SamplingParams(max_tokens=200, temperature=0.0)
    prompts = [prompt(8, s) for s in range(40)]
    answers = engine(answers="uniform:5-20").generate(prompts, params)
    lengths = [len(a) for a in answers]
    assert all(5 <= n <= 20 for n in lengths) and len(set(lengths)) > 5
    assert all(a[-1] == EOS and EOS not in a[:-1] for a in answers)
    assert engine(answers="uniform:5-20").generate(prompts, params) == answers  # seeded
    fixed = engine(answers="fixed:7").generate(prompts[:3], SamplingParams(max_tokens=50))
    assert [len(a) for a in fixed] == [7, 7, 7]
    ignoring = engine(answers="fixed:7").generate(
        prompts[:3], SamplingParams(max_tokens=50, ignore_eos=True))
    assert [len(a) for a in ignoring] == [50, 50, 50]
    floored = engine(answers="fixed:7").generate(
        prompts[:1], SamplingParams(max_tokens=50, min_tokens=12))
    assert len(floored[0]) == 12
    mean = sum(len(a) for a in engine(answers="exp:30").generate(
        [prompt(6, s) for s in range(300)], SamplingParams(max_tokens=1000))) / 300
    assert 24 < mean < 36  # an exponential of mean 30 over 300 draws


@pytest.mark.parametrize("spec", ["", "fixed:0", "uniform:9-3", "exp:-1", "normal:3", "fixed:x",
                                  "max:4"])
def test_a_bad_answer_spec_says_the_accepted_forms(spec):
    with pytest.raises(ValueError, match="fixed:N, uniform:A-B or exp:MEAN"):
        AnswerLengths.parse(spec)


def test_each_step_is_held_for_its_modelled_time_times_the_scale():
    time, cost = FakeTime(), LinearCost(base_s=0.01, token_s=0.001)
    eng = engine(cost, time, scale=10.0, max_batched_tokens=8)
    started = time.t
    eng.generate([prompt(12, 1)], SamplingParams(max_tokens=3, ignore_eos=True))
    modelled = [cost.curve.step_seconds(w) for w in cost.calls]
    # prefill 8 + 4 tokens (the chunk limit), then 2 decode steps
    assert [(w.prefill_tokens, w.decode_rows) for w in cost.calls] == [(8, 0), (4, 0), (0, 1),
                                                                         (0, 1)]
    assert time.t - started == pytest.approx(10 * sum(modelled))
    assert eng.runner.modelled_s == pytest.approx(sum(modelled))
    lag = eng.lag()
    assert lag == SimLag(4, 0, lag.max_lag_s) and lag.valid
    stats = eng.stats()
    assert stats.sim_steps == 4 and stats.sim_lagged_steps == 0
    assert "linear test cost" in stats.simulated and "time scale 10" in stats.simulated


def test_steps_the_host_plays_late_are_counted_and_make_the_run_invalid():
    time = FakeTime()
    time.oversleep = 0.05  # every wake-up 50 ms late: far beyond 10% of a 10-20 ms step
    eng = engine(time=time)
    eng.generate([prompt(5, 2)], SamplingParams(max_tokens=6, ignore_eos=True))
    lag = eng.lag()
    assert lag.steps == 6 and lag.lagged == 6 and not lag.valid
    assert lag.max_lag_s == pytest.approx(0.05)
    assert SimLag(100, int(100 * INVALID_LAG_SHARE)).valid
    assert not SimLag(100, int(100 * INVALID_LAG_SHARE) + 1).valid
    # a host slower than the step itself: no sleep, the step ends late by the overrun
    clock = StepClock(1.0, clock=time.now, sleep=time.sleep)
    started = time.t
    time.t += 0.5
    clock.play(started, 0.1)
    assert clock.lag().lagged == 1 and clock.lag().max_lag_s == pytest.approx(0.4)


def test_the_prefix_cache_and_the_kv_room_are_the_real_ones():
    eng = engine(blocks=32)
    shared = prompt(40, 7)  # 10 blocks of 4
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.generate([shared + [5, 6]], params)
    eng.generate([shared + [9, 9]], params)
    stats = eng.stats()
    assert stats.prefix_hit_tokens == 40 and stats.num_blocks_total == 32
    assert eng.admissible_tokens() == (32 - eng.scheduler.watermark_blocks) * 4
    assert eng.num_cached_prefix_blocks(shared) == 10
    # more than the pool: refused as a real engine refuses it
    with pytest.raises(ValueError, match="KV blocks but the pool has only 32"):
        eng.add_request("big", prompt(200, 1), params)
    # streams that outgrow the pool are preempted (recomputed) and still finish
    crowded = engine(blocks=24)
    answers = crowded.generate([prompt(20, s) for s in range(4)],
                               SamplingParams(max_tokens=40, ignore_eos=True))
    assert [len(a) for a in answers] == [40] * 4 and crowded.stats().num_preemptions > 0
    assert answers == engine(blocks=256).generate([prompt(20, s) for s in range(4)],
                                                  SamplingParams(max_tokens=40, ignore_eos=True))


def test_what_is_not_simulated_is_refused_with_the_reason():
    eng = engine()
    with pytest.raises(LoraLoadError, match="serves no LoRA adapters"):
        eng.add_request("l", prompt(5, 1), SamplingParams(max_tokens=2),
                        lora=LoraRequest("a", "/nonexistent", b"root"))
    assert eng.kv_bytes_of("l") == 0 and not eng.has_unfinished()
    with pytest.raises(ValueError, match="speculative decoding"):
        engine(speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_pace_targets_are_scaled_with_the_time():
    eng = engine(scale=10.0, target_itl_ms=50.0, target_ttft_ms=2000.0)
    assert eng.config.target_itl_ms == 500.0 and eng.config.target_ttft_ms == 20000.0
    assert eng.pace.enabled


def test_a_roofline_worker_is_slower_per_step_on_an_a100_than_on_an_h100():
    """The cost model is what the engine plays: the same trace takes longer on the slower
    device (memory-bound decode: about the bandwidth ratio)."""
    times = {}
    for device in ("h100", "a100"):
        time = FakeTime()
        eng = engine(RooflineCost(device, "llama-3.1-8b"), time)
        started = time.t
        eng.generate([prompt(16, 3)], SamplingParams(max_tokens=32, ignore_eos=True))
        times[device] = time.t - started
    assert 1.3 < times["a100"] / times["h100"] < 2.0
    assert eng.stats().num_generated_tokens == 32 and eng.scheduler.running == []
    assert RequestStatus.FINISHED_LENGTH.is_finished


def test_a_handed_over_stream_continues_in_another_engine_with_its_kv_swapped_in():
    """A simulated handoff carries the tokens and the KV's modelled size, no bytes; the taker
    swaps the blocks in (the cost model charges the copy) and computes nothing again."""
    params = SamplingParams(max_tokens=20, temperature=0.5, ignore_eos=True)
    p = prompt(30, 9)
    whole = engine().generate([p], params)[0]
    source = engine()
    source.add_request("h", p, params)
    early = []
    while len(early) < 5:
        for out in source.step():
            early += out.new_token_ids
    assert source.kv_bytes_of("h") == source.block_manager.blocks_for_tokens(34) * 4 * 1000
    state = source.export_sequence("h")
    assert not source.has_unfinished() and state.values.numel() == 1
    assert state.layout["modelled_bytes"] == 9 * 4 * 1000 and state.num_computed_tokens == 34
    header, views = state.encode()  # what the transfer plane sends: a header and one byte
    assert sum(len(v) for v in views) == 1
    payload = b"".join(bytes(v) for v in views)
    cost = LinearCost()
    taker = engine(cost)
    taker.import_sequence(SequenceState.decode(header, payload))
    rest = []
    while taker.has_unfinished():
        for out in taker.step():
            rest += out.new_token_ids
    assert early + rest == whole
    assert cost.calls[0].swap_blocks == 9 and cost.calls[0].prefill_tokens == 0
    assert taker.stats().num_prefill_tokens_computed == 0
    # another block size, another KV size, or a real engine's state: refused, nothing taken
    for other in (engine(block_size=8), engine(kv_bytes=999)):
        with pytest.raises(HandoffError, match="another layout"):
            other.import_sequence(SequenceState.decode(header, payload))
        assert not other.has_unfinished()
