"""benchmarks/sim_plan.py's arithmetic: `kvfleet plan --json` read back to modelled time, the
prefill the plan counts (and the benchmark's own count of it), the fleet's figures from
heartbeats, and the verdict; no fleet is started (the plan runs in this process on a curve
file)."""

from __future__ import annotations

import json

import pytest

from benchmarks.sim_fleet import StepCounts
from benchmarks.sim_plan import (
    ITL_TOLERANCE, SNAPSHOT_PREFIX, Fit, PlannedFleet, Served, check, parse_args, plan_command,
    plan_context, planned_fleet, report, summarise, with_prompts)
from kvfleet.plan import command as plan
from kvfleet.shared.pace import StepCostCurve, StepFeatures
from kvfleet.shared.wire import Heartbeat

# a worker's curve at time scale 5: a modelled step of 7 ms + 20 µs a stream, 5 times slower
CURVE = StepCostCurve(base_s=0.035, decode_row_s=100e-6, prefill_token_s=50e-6, steps=900)


def test_the_plans_json_is_read_back_to_modelled_time(tmp_path, capsys):
    path = tmp_path / "curve.json"
    path.write_text(CURVE.to_json())
    # at time scale 5: the target 5 times longer, the demand 5 times smaller; 256-token prompts
    # for 512-token answers, as plan_command passes them
    assert plan.main(["--step-cost", str(path), "--target-itl-ms", "60.05", "--context", "768",
                      "--prompt-tokens", "256", "--output-tokens", "512",
                      "--demand", "3000", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    planned = planned_fleet(document, demand_tokens_per_s=15000, k=5)
    # (60 - 35) ms / (0.1 ms a row + half a prompt token at 0.05 ms) a stream: 200 (decode
    # only: 250), the benchmark's own count of the prompts on the same curve
    assert planned.streams == with_prompts(CURVE, 0.06005, 768, 256, 512)[0] == 200
    assert document["measured_pace"]["streams_decode_only"] == \
        CURVE.streams_at_pace(0.06005, 768) == 250
    assert planned.tokens_per_s == pytest.approx(5 * 200 / 0.060)  # its turn: 60 ms
    assert planned.target_itl_s == pytest.approx(0.01201)
    assert planned.workers == 1 and planned.curve_steps == 900
    assert planned.utilisation == pytest.approx(15000 / (5 * 200 / 0.060))
    assert planned.streams_at_demand == pytest.approx(200 * planned.utilisation)


def test_the_plan_command_scales_the_target_and_the_demand_by_the_fits_time_scale():
    args = parse_args(["--time-scale", "5", "--target-itl-ms", "12", "--prompt-tokens", "256",
                       "--answer-tokens", "512"])
    assert args.fit_time_scale == 5  # the fleet's, unless told
    command = plan_command(args, "redis://127.0.0.1:1/0", "plan-curve", 20000.0)
    flags = dict(zip(command, command[1:]))
    assert flags["--target-itl-ms"] == "60" and flags["--demand"] == "4000"
    assert flags["--context"] == "768" and flags["--worker"] == "plan-curve"
    assert (flags["--prompt-tokens"], flags["--output-tokens"]) == ("256", "512")
    assert json.loads(flags["--from-model"])["num_hidden_layers"] == 32  # the shape, inline
    assert flags["--key-prefix"] == SNAPSHOT_PREFIX  # the heartbeat as it was under load
    assert parse_args(["--fit-time-scale", "1"]).fit_time_scale == 1
    mean = parse_args(["--prompt-tokens", "256", "--answer-tokens", "512", "--plan-context",
                       "mean"])
    assert plan_context(mean) == 512  # the prompt and half the answer


def planned(workers=4, streams=100, tokens_per_s=8000.0, demand=30400.0) -> PlannedFleet:
    return PlannedFleet(workers, streams, tokens_per_s, demand, 0.012, 768, 900)


def test_counting_the_prompts_leaves_a_worker_fewer_streams_on_the_same_curve():
    # 25 ms beside the 35 ms base: 250 rows at 0.1 ms (the plan's); with 256-token prompts
    # replacing 512-token answers, each stream also brings half a prompt token (0.025 ms) a step
    # into it: 200 streams
    streams, tokens_per_s = with_prompts(CURVE, 0.06005, 768, prompt_tokens=256,
                                         answer_tokens=512)
    assert streams == 200
    assert tokens_per_s == pytest.approx(200 / CURVE.turn_seconds(StepFeatures(
        decode_rows=200, context_tokens=200 * 768, prefill_tokens=100,
        prefill_context=100 * 128)))
    assert with_prompts(CURVE, 0.030, 768, 256, 512) == (0, 0.0)  # not one fits


def beat(tokens=0, itl_ms=0.0, running=0, waiting=0, pace=0, steps=0, lagged=0, room=-1,
         own=0) -> Heartbeat:
    return Heartbeat(model="m", ts=0.0, generated_tokens=tokens, itl_p99_ms=itl_ms,
                     running=running, waiting=waiting, pace_streams=pace, simulated="x",
                     sim_steps=steps, sim_lagged_steps=lagged, pace_room=room, own_queue=own)


def test_the_fleets_figures_are_heartbeat_deltas_and_samples_in_modelled_time():
    before = [beat(1000, steps=100), beat(2000, steps=100)]
    after = [beat(31000, 60.0, running=80, waiting=2, steps=1100, lagged=10),
             beat(32000, 65.0, running=70, steps=1100, lagged=20)]
    samples = [{"a": beat(running=80, pace=90, room=4), "b": beat(running=60, pace=90, own=6)},
               {"a": beat(running=90, pace=100, waiting=2), "b": beat(running=70, pace=100)}]
    served = summarise(before, after, samples, seconds=10.0, k=5.0, sent=500, answered=300,
                       failed=0, in_flight=200, offered_tokens=61440)
    assert served.tokens_per_s == pytest.approx(60000 / 10 * 5)
    assert served.offered_tokens_per_s == pytest.approx(61440 / 10 * 5)
    assert served.itl_p99_s == pytest.approx(0.065 / 5)  # the worst worker's
    assert served.streams_mean == pytest.approx(75.0)
    assert served.streams_max == pytest.approx(85.0)  # a's mean
    assert served.pace_streams_mean == pytest.approx(95.0)
    assert served.room_mean == pytest.approx(1.0)  # -1 (no pace) counts as none
    assert served.waiting_mean == pytest.approx(2.0)
    assert served.backlog == 200 - 152  # sent, not on a worker
    assert (served.counts.steps, served.counts.lagged) == (2000, 30)


def served(tokens_per_s=29000.0, itl_s=0.0118, lag=0) -> Served:
    return Served(4, tokens_per_s, itl_s, 30000.0, 90.0, 95.0, 98.0, 2.0, 1.0, 1000, 900, 0, 3,
                  StepCounts(4, 4000, lag))


FIT = Fit(StepCounts(1, 700, 0), CURVE, 90, 120)


def test_the_verdict_serves_the_demand_at_the_pace_and_is_invalid_when_a_run_lagged():
    ok = check(planned(), served(), FIT.counts)
    assert ok.valid and ok.met
    assert ok.throughput_ratio == pytest.approx(29000 / 30400)
    assert ok.itl_ratio == pytest.approx(0.0118 / 0.012)
    assert not check(planned(), served(tokens_per_s=27000), FIT.counts).met  # 0.89 of it
    assert check(planned(), served(itl_s=0.012 * ITL_TOLERANCE), FIT.counts).met
    assert not check(planned(), served(itl_s=0.0127), FIT.counts).met  # 6% over
    lagged = check(planned(), served(lag=201), FIT.counts)  # 5.025% of the fleet's steps
    assert not lagged.valid and "fleet's run lagged 5.0%" in lagged.reasons[0]
    assert not check(planned(), served(), StepCounts(1, 700, 36)).valid  # the curve's run
    assert not check(planned(), served(), StepCounts(1, 0, 0)).valid  # no step: no curve


def test_the_report_shows_plan_against_simulation_with_the_verdict():
    args = parse_args([])
    text = report(planned(), served(), check(planned(), served(), FIT.counts), FIT,
                  (80, 6400.0), args)
    assert "| fleet out tok/s (demand) | 30,400 | 29,000 | **0.95** |" in text
    assert "| streams a worker at pace | 100 | 98.0 (its own, heartbeat) | 0.98 |" in text
    assert "a worker runs 80 streams, 6,400 out tok/s (0.80 of the plan's" in text
    assert text.endswith(": met")
    short = served(tokens_per_s=20000)
    assert report(planned(), short, check(planned(), short, FIT.counts), FIT, (80, 6400.0),
                  args).endswith("NOT met")
    late = served(lag=400)
    assert "INVALID" in report(planned(), late, check(planned(), late, FIT.counts), FIT,
                               (80, 6400.0), args).splitlines()[-1]

