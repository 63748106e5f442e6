"""The promised pace (worker/engine/core/pace.py): the step-cost fit on synthetic step times, the
margin, and the scheduler's decisions under a target with a fit made by hand (no clock, no model);
then an engine with a target on a tiny model (same answers, latencies measured, the warm-up)."""

from __future__ import annotations

import random

import pytest
import torch

from kvfleet.shared.engine_config import PaceConfig
from kvfleet.shared.pace import StepCostCurve, StepFeatures
from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.engine.core.pace import (
    MIN_PREFILL_TOKENS, Pace, QuantileTracker, StepCostModel, step_features, warm_up)
from kvfleet.worker.engine.core.scheduler import Scheduler
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.core.stopping import StopChecker

# a step: 10 ms, +1 ms per decode row, +20 us per prompt token, +1 us per KV position read
BASE, ROW, PREFILL, CONTEXT = 0.010, 0.001, 0.00002, 0.000001


def true_seconds(work: StepFeatures) -> float:
    return BASE + ROW * work.decode_rows + PREFILL * work.prefill_tokens + CONTEXT * work.context_tokens


def random_work(rng: random.Random) -> StepFeatures:
    rows = rng.randrange(0, 48)
    prefill = rng.choice([0, 0, rng.randrange(1, 512)])
    return StepFeatures(rows, rows * rng.randrange(16, 600), prefill,
                        StepFeatures.of_prefill(prefill, rng.randrange(0, 300)).prefill_context)


def fitted_model(noise: float = 0.0, steps: int = 400, seed: int = 0) -> StepCostModel:
    rng, model = random.Random(seed), StepCostModel()
    for _ in range(steps):
        work = random_work(rng)
        model.observe(work, true_seconds(work) * (1 + rng.uniform(-noise, noise)))
    return model


# ---- the fit ------------------------------------------------------------------------------

def test_the_fit_recovers_the_step_cost_from_noisy_steps():
    model = fitted_model(noise=0.05)
    rng = random.Random(1)
    errors = []
    for _ in range(200):
        work = random_work(rng)
        errors.append(abs(model.predict(work) / true_seconds(work) - 1))
    assert max(errors) < 0.08, max(errors)
    base, row = model.coefficients()[:2]
    assert base == pytest.approx(BASE, rel=0.15) and row == pytest.approx(ROW, rel=0.15)


def test_coefficients_stay_non_negative_and_zero_before_any_step():
    assert list(StepCostModel().coefficients()) == [0.0] * 6
    model = StepCostModel()
    rng = random.Random(2)
    for _ in range(100):  # more prefill makes the step *faster*: no negative cost is fitted
        work = StepFeatures(rng.randrange(1, 32), 0, rng.randrange(0, 200))
        model.observe(work, 0.01 + 0.001 * work.decode_rows - 1e-6 * work.prefill_tokens)
    assert (model.coefficients() >= 0).all()


def test_the_fit_forgets_an_old_regime():
    model = fitted_model()
    rng = random.Random(3)
    for _ in range(3000):  # the host got twice as slow
        work = random_work(rng)
        model.observe(work, 2 * true_seconds(work))
    work = StepFeatures(16, 16 * 300)
    assert model.predict(work) == pytest.approx(2 * true_seconds(work), rel=0.05)


def test_the_margin_tracks_the_99th_percentile_of_the_ratio():
    rng, tracker = random.Random(4), QuantileTracker(rate=0.02)
    samples = [rng.lognormvariate(0, 0.2) for _ in range(40000)]
    for ratio in samples:
        tracker.observe(ratio)
    exceed = sum(r > tracker.value for r in samples[-10000:]) / 10000
    assert 0.003 < exceed < 0.03, (tracker.value, exceed)


# ---- the curve the heartbeat carries ----------------------------------------------------------

def test_streams_at_pace_is_the_largest_group_within_the_target():
    curve = StepCostCurve(base_s=BASE, decode_row_s=ROW, context_token_s=CONTEXT,
                          overhead_s=0.002, margin=1.2, steps=10)
    for target_s, context in [(0.03, 100), (0.05, 1000), (0.2, 50)]:
        n = curve.streams_at_pace(target_s, context)
        assert curve.turn_seconds(StepFeatures.of_decode(n, context)) <= target_s
        assert curve.turn_seconds(StepFeatures.of_decode(n + 1, context)) > target_s
    assert curve.streams_at_pace(0.001, 100) == 0  # not even one stream keeps 1 ms
    assert StepCostCurve(base_s=0.01, steps=1).streams_at_pace(0.05, 100, limit=500) == 500
    assert StepCostCurve.from_json(curve.to_json()) == curve


@pytest.mark.parametrize("text", ["nope", "[1]", '{"base_s": -1}', '{"margin": 0}',
                                  '{"steps": "x"}', '{"decode_row_s": Infinity}'])
def test_a_malformed_curve_is_refused(text):
    with pytest.raises(ValueError):
        StepCostCurve.from_json(text)


# ---- the scheduler under a pace (a fit made by hand) --------------------------------------------

def pace_with_fit(target_itl_ms=40.0, target_ttft_ms=0.0, **config) -> Pace:
    pace = Pace(PaceConfig(target_itl_ms=target_itl_ms, target_ttft_ms=target_ttft_ms, **config),
                max_batched_tokens=512)
    pace.model = fitted_model()
    pace.model.max_decode_rows = 64  # explored
    pace.margin.value, pace.overhead_s = 1.0, 0.0
    return pace


def make_scheduler(pace: Pace | None, max_batched_tokens=512, max_running=64) -> Scheduler:
    bm = BlockManager(4096, 16, False)
    return Scheduler(bm, StopChecker([2], max_model_len=100000), max_batched_tokens, max_running,
                     0.0, pace=pace)


def sequence(i: int, prompt: int = 64, max_tokens: int = 1000, **params) -> Sequence:
    return Sequence(f"r{i}", [5 + (i * 7 + k) % 90 for k in range(prompt)],
                    SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def run(sched: Scheduler, steps: int) -> list:
    outs = []
    for _ in range(steps):
        out = sched.schedule()
        sched.update(out, {c.seq.req_id: [(7, None)] for c in out.chunks if c.emits_token})
        outs.append(out)
    return outs


def steady_limit(target_s: float, prompt: int) -> int:
    """The group a steady decode step with a prompt token keeps within target (as Pace.admits
    judges it)."""
    n = 1
    while true_seconds(StepFeatures(n + 1, (n + 1) * (prompt + 1 + 128))
                       .plus(StepFeatures.of_prefill(MIN_PREFILL_TOKENS))) <= target_s:
        n += 1
    return n


def test_admission_stops_at_the_largest_group_that_keeps_the_target():
    pace = pace_with_fit(target_itl_ms=40.0)
    sched = make_scheduler(pace)
    for i in range(60):
        sched.add(sequence(i))
    run(sched, 40)
    limit = steady_limit(0.040, 64)
    assert 5 < limit < 60
    assert len(sched.running) in (limit, limit + 1)  # judged with contexts that have grown
    assert len(sched.waiting) == 60 - len(sched.running) and pace.deferred > 0
    # every decode step of the group keeps the target by the fit
    out = run(sched, 1)[0]
    assert pace.curve().turn_seconds(step_features(out)) <= 0.040 * 1.02


def test_without_a_target_the_group_is_bound_only_by_max_running():
    sched = make_scheduler(None, max_running=48)
    for i in range(60):
        sched.add(sequence(i))
    run(sched, 40)
    assert len(sched.running) == 48


def test_a_prefill_chunk_gets_only_the_time_the_decodes_leave():
    pace = pace_with_fit(target_itl_ms=29.0)
    sched = make_scheduler(pace)
    for i in range(10):
        sched.add(sequence(i, prompt=20))
    run(sched, 3)  # ten decoding streams
    sched.add(sequence(99, prompt=2000))
    out = run(sched, 1)[0]
    chunk = next(c for c in out.chunks if c.seq.req_id == "r99")
    work = step_features(out)
    assert MIN_PREFILL_TOKENS < chunk.num_tokens < 512 - 10  # cut below the token budget
    assert pace.curve().turn_seconds(work) <= 0.029
    bigger = work.plus(StepFeatures.of_prefill(16, chunk.end))
    assert pace.curve().turn_seconds(bigger) > 0.029


def test_a_prompt_advances_even_when_the_decodes_fill_the_step():
    sched = make_scheduler(None, max_batched_tokens=64)
    for i in range(40):
        sched.add(sequence(i, prompt=8))
    sched.add(sequence(99, prompt=2000))
    run(sched, 8)  # forty decoding streams, the long prompt's prefill under way
    long = sched.running[-1]
    assert long.req_id == "r99" and 0 < long.num_computed_tokens < 2000
    pace = pace_with_fit(target_itl_ms=40.0)
    assert pace.curve().turn_seconds(StepFeatures.of_decode(40, 20)) > 0.040  # full already
    sched.pace = pace
    for _ in range(3):
        before = long.num_computed_tokens
        run(sched, 1)
        assert long.num_computed_tokens - before == MIN_PREFILL_TOKENS


def test_a_request_may_loosen_the_pace_but_not_tighten_it_past_the_floor():
    pace = pace_with_fit(target_itl_ms=40.0)
    assert pace.target_of(SamplingParams()) == pytest.approx(0.040)
    assert pace.target_of(SamplingParams(target_itl_ms=200)) == pytest.approx(0.200)
    assert pace.target_of(SamplingParams(target_itl_ms=5)) == pytest.approx(0.040)
    assert pace.target_of(SamplingParams(target_itl_ms=0)) is None
    floor = pace_with_fit(target_itl_ms=40.0, min_target_itl_ms=20.0)
    assert floor.target_of(SamplingParams(target_itl_ms=5)) == pytest.approx(0.020)
    off = Pace(PaceConfig(), max_batched_tokens=512)
    assert not off.enabled and off.target_of(SamplingParams(target_itl_ms=30)) is None


def test_loose_requests_make_a_bigger_group():
    tight, loose = make_scheduler(pace_with_fit()), make_scheduler(pace_with_fit())
    for i in range(60):
        tight.add(sequence(i))
        loose.add(sequence(i, target_itl_ms=80))
    run(tight, 40)
    run(loose, 40)
    assert len(loose.running) > len(tight.running) + 5


def test_a_group_grows_no_faster_than_the_fit_has_seen():
    pace = pace_with_fit(target_itl_ms=500.0)  # the fit says dozens fit
    pace.model.max_decode_rows = 4
    sched = make_scheduler(pace)
    for i in range(60):
        sched.add(sequence(i))
    sched.schedule()
    assert len(sched.running) == pace.explored_rows() == 6


def test_room_counts_the_streams_a_worker_still_takes_at_pace():
    pace = pace_with_fit(target_itl_ms=40.0)
    sched = make_scheduler(pace)
    pace._prompt_tokens = 64.0  # the prompts seen so far
    assert abs(pace.room([], [], 64) - steady_limit(0.040, 64)) <= 1  # an idle worker's room
    for i in range(4):
        sched.add(sequence(i))
    run(sched, 3)
    room = pace.room(sched.running, list(sched.waiting), 64)
    assert abs(room - (steady_limit(0.040, 64) - 4)) <= 1
    report = pace.report(sched.running, list(sched.waiting), 64)
    assert report.room == room and report.streams == 4 + room and report.target_itl_ms == 40.0
    assert Pace(PaceConfig(), max_batched_tokens=512).room([], [], 64) == -1


def test_no_room_while_the_prompts_held_would_delay_a_first_token_past_its_target():
    pace = pace_with_fit(target_itl_ms=40.0, target_ttft_ms=500.0)
    sched = make_scheduler(pace)
    for i in range(4):
        sched.add(sequence(i))
    run(sched, 3)
    assert pace.room(sched.running, list(sched.waiting), 64) > 0
    sched.add(sequence(50, prompt=20000))  # 20k prompt tokens queued here
    run(sched, 1)
    assert pace.room(sched.running, list(sched.waiting), 64) == 0


# ---- an engine with a target (tiny model, float32) --------------------------------------------

def engine_of(tiny, **config) -> Engine:
    config.setdefault("max_running", 16)
    return tiny.engine(**config)


def test_a_paced_engine_gives_the_same_greedy_answers(tiny_llama):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(5, 60))] for _ in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = engine_of(tiny_llama).generate(prompts, params)
    paced = engine_of(tiny_llama, target_itl_ms=5.0, max_batched_tokens=64)
    assert paced.generate(prompts, params) == plain
    assert paced.pace.model.steps > 0
    reference = [tiny_llama.reference(p, 12) for p in prompts[:2]]
    assert plain[:2] == reference


def test_the_engine_measures_first_tokens_and_times_between_tokens(tiny_llama):
    import time
    engine = engine_of(tiny_llama, target_itl_ms=50.0, target_ttft_ms=1000.0)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0,
                                                     ignore_eos=True), arrival=time.time() - 0.25)
    engine.add_request("b", [5, 6, 8], SamplingParams(max_tokens=5, temperature=0.0,
                                                     ignore_eos=True))  # no arrival: no TTFT
    while engine.has_unfinished():
        engine.step()
    itl, ttft = engine.pace.take_samples()
    assert len(itl) == 8 and all(0 <= s < 5 for s in itl)
    assert len(ttft) == 1 and ttft[0] >= 0.25
    report = engine.pace_report()
    assert report.ttft_p99_ms >= 250 and report.itl_p99_ms > 0 and report.curve.fitted
    assert engine.pace.take_samples() == ([], [])


def test_the_warm_up_fits_the_curve_and_leaves_nothing_behind(tiny_llama):
    engine = engine_of(tiny_llama, target_itl_ms=50.0, pace_warmup=True, max_running=8)
    seconds = warm_up(engine)
    assert seconds > 0 and engine.pace.model.max_decode_rows == 8
    assert engine.pace.model.steps >= 12
    stats = engine.stats()
    assert stats.num_generated_tokens == 0 and stats.num_running == 0
    assert stats.num_blocks_free == stats.num_blocks_total and not engine.has_unfinished()
    assert engine.cached_block_hashes() == []
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert engine.generate([[5, 6, 7]], params) == [tiny_llama.reference([5, 6, 7], 6)]


def test_the_latency_window_p99_is_the_sorted_samples_at_99_percent_within_the_window():
    """p99: the sorted values' element at index 0.99 n of the samples of the last
    LATENCY_WINDOW_S (0 with none), recomputed at most every half second."""
    from kvfleet.worker.engine.core.pace import LATENCY_WINDOW_S, LatencyWindow

    now = [0.0]
    window = LatencyWindow(clock=lambda: now[0])
    assert window.p99() == 0.0
    rng = random.Random(5)
    for n in (1, 3, 100, 1000):
        window = LatencyWindow(clock=lambda: now[0])
        values = [rng.random() for _ in range(n)]
        for value in values:
            window.add(value)
        assert window.p99() == sorted(values)[min(int(0.99 * n), n - 1)]
    window.add(50.0)  # the largest of 1001: the p99 moves only after half a second
    held = window.p99()
    now[0] += 0.6
    assert window.p99() == sorted(values + [50.0])[int(0.99 * 1001)] and held < 1.0
    now[0] += LATENCY_WINDOW_S + 1  # every sample outside the window
    window.add(0.25)
    now[0] += 0.6
    assert window.p99() == 0.25
