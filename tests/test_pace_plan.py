"""`kvfleet plan --step-cost`: streams and tokens/s per worker from a measured step-cost curve,
read from a JSON file or from the live heartbeats in a real Redis; bad sources exit 2."""

from __future__ import annotations

import json
import math
import time

import pytest

from kvfleet.plan import command as plan
from kvfleet.shared.pace import StepCostCurve
from kvfleet.shared.wire import Heartbeat, Keys

KEYS = Keys("kvpp:")
MODEL = "tiny-model"
# A turn of n streams of 8,000 tokens: (base + overhead + n × (row + 8,000 × context)) × margin
# = (0.010 + 0.002 + n × (0.0005 + 0.0008)) × 1.25 = 0.015 + 0.001625 n seconds.
CURVE = StepCostCurve(base_s=0.010, decode_row_s=0.0005, context_token_s=1e-7,
                      overhead_s=0.002, margin=1.25, steps=500)
# At 50 ms: n <= 0.035 / 0.001625 = 21.5 -> 21 streams, a turn of 49.125 ms.
STREAMS_AT_50_MS = 21
TOKENS_PER_S_AT_50_MS = 21 / 0.049125
# Twice as slow a step: (0.024 + 0.0026 n) x 1.25 = 0.030 + 0.00325 n -> 6 streams at 50 ms.
SLOW_CURVE = StepCostCurve(base_s=0.020, decode_row_s=0.001, context_token_s=2e-7,
                           overhead_s=0.004, margin=1.25, steps=80)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def measured(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--context", "8000", "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def curve_file(tmp_path):
    path = tmp_path / "step_cost.json"
    path.write_text(CURVE.to_json())
    return str(path)


def test_a_file_curve_gives_the_streams_and_tokens_per_s(capsys, curve_file):
    document = measured(capsys, "--step-cost", curve_file, "--target-itl-ms", "50",
                        "--demand", "10000")
    pace = document["measured_pace"]
    assert (pace["source"], pace["target_itl_ms"], pace["context_tokens"]) == \
        (curve_file, 50.0, 8000)
    assert pace["streams"] == STREAMS_AT_50_MS
    assert pace["tokens_per_s"] == pytest.approx(TOKENS_PER_S_AT_50_MS)
    throughput = document["throughput"]
    assert throughput["streams_per_gpu"] == STREAMS_AT_50_MS
    assert throughput["gpu_tokens_per_s"] == pytest.approx(TOKENS_PER_S_AT_50_MS)
    assert throughput["gpus_needed"] == math.ceil(10000 / TOKENS_PER_S_AT_50_MS) == 24


def test_the_text_report_says_the_curve_gave_them(capsys, curve_file):
    code, out, err = run(capsys, "--step-cost", curve_file, "--target-itl-ms", "50",
                         "--context", "8000", "--demand", "10000")
    assert code == 0, err
    assert "Measured pace (the step-cost curve" in out
    assert f"{curve_file} (500 steps fitted)" in out
    assert "50 ms p99, streams of 8,000 tokens" in out
    assert "21 per worker" in out and "427.48 per worker" in out
    assert "accelerators needed   24 " in out


def test_the_longest_context_or_the_mix_average_sets_the_pace(capsys, curve_file):
    # 16,000 tokens: (0.012 + 0.0021 n) x 1.25 <= 0.05 -> n <= 13.3
    code, out, _ = run(capsys, "--step-cost", curve_file, "--target-itl-ms", "50",
                       "--context", "2000,16000", "--json")
    assert json.loads(out)["measured_pace"]["streams"] == 13
    code, out, _ = run(capsys, "--step-cost", curve_file, "--target-itl-ms", "50",
                       "--context-mix", "4000:1,12000:1", "--json")  # 8,000 on average
    assert json.loads(out)["measured_pace"]["streams"] == STREAMS_AT_50_MS


def test_without_a_curve_the_flags_and_defaults_stay(capsys):
    document = json.loads(run(capsys, "--json")[1])
    assert document["measured_pace"] is None
    assert (document["throughput"]["streams_per_gpu"],
            document["throughput"]["gpu_tokens_per_s"]) == (32, 2000)


def write_beat(client, worker_id: str, model: str = MODEL, curve: StepCostCurve | None = None,
               target_itl_ms: float = 0.0) -> None:
    beat = Heartbeat(model=model, ts=time.time(), target_itl_ms=target_itl_ms,
                     step_cost=curve.to_json() if curve else "")
    client.hset(KEYS.worker(worker_id), mapping=beat.encode())
    client.expire(KEYS.worker(worker_id), 60)


def from_redis(redis_url: str, *argv: str) -> tuple[str, ...]:
    return ("--step-cost", redis_url, "--key-prefix", KEYS.prefix, *argv)


def test_a_redis_source_reads_the_models_first_worker_with_a_curve(capsys, redis_url,
                                                                  redis_client):
    write_beat(redis_client, "a-warming", target_itl_ms=50)  # no curve fitted yet
    write_beat(redis_client, "b-other", model="other", curve=SLOW_CURVE, target_itl_ms=50)
    write_beat(redis_client, "c-fitted", curve=CURVE, target_itl_ms=50)
    write_beat(redis_client, "d-fitted", curve=SLOW_CURVE, target_itl_ms=50)
    pace = measured(capsys, *from_redis(redis_url, "--model", MODEL))["measured_pace"]
    # the target is the worker's own (its heartbeat's target_itl_ms)
    assert pace["source"] == f"{redis_url} worker c-fitted"
    assert (pace["target_itl_ms"], pace["streams"]) == (50.0, STREAMS_AT_50_MS)
    pace = measured(capsys, *from_redis(redis_url, "--worker", "b-other"))["measured_pace"]
    assert (pace["source"], pace["streams"]) == (f"{redis_url} worker b-other", 6)
    # a target given wins over the heartbeat's: 100 ms fits 21 slow streams (0.0325 + ...)
    pace = measured(capsys, *from_redis(redis_url, "--worker", "d-fitted", "--target-itl-ms",
                                        "100"))["measured_pace"]
    assert (pace["target_itl_ms"], pace["streams"]) == (100.0, 21)


@pytest.mark.parametrize("argv,message", [
    (("--worker", "a-warming"), "worker a-warming has no step-cost curve yet"),
    (("--worker", "nobody"), "no live worker nobody"),
    (("--model", "unknown-model"), "no live worker of model unknown-model"),
    (("--worker", "c-fitted", "--target-itl-ms", "10"), "fits not one stream"),
    (("--worker", "no-target"), "give --target-itl-ms"),
])
def test_redis_sources_without_a_usable_curve_exit_2(capsys, redis_url, redis_client, argv,
                                                     message):
    write_beat(redis_client, "a-warming", target_itl_ms=50)
    write_beat(redis_client, "c-fitted", curve=CURVE, target_itl_ms=50)
    write_beat(redis_client, "no-target", curve=CURVE)  # promises no pace
    code, out, err = run(capsys, *from_redis(redis_url, *argv))
    assert code == plan.EXIT_USAGE and out == ""
    assert err.startswith("kvfleet plan: error: --step-cost: ") and message in err


def test_an_unreachable_redis_exits_2(capsys):
    code, _, err = run(capsys, "--step-cost", "redis://127.0.0.1:1/0", "--target-itl-ms", "50")
    assert code == plan.EXIT_USAGE and "cannot read the heartbeats" in err


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"),
    ("{not json", "not a step-cost curve"),
    ('{"base_s": -1, "steps": 3}', "base_s must be a number >= 0"),
    ('{"base_s": 0.01}', "seen no step yet"),
])
def test_bad_curve_files_exit_2(capsys, tmp_path, content, message):
    path = tmp_path / "curve.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run(capsys, "--step-cost", str(path), "--target-itl-ms", "50")
    assert code == plan.EXIT_USAGE and out == "" and message in err


@pytest.mark.parametrize("argv,message", [
    (("--target-itl-ms", "15"), "fits not one stream of 16,000 tokens: one stream's turn "
                                "takes 17.6 ms"),  # (0.012 + 0.0021) x 1.25 at the default 16k
    ((), "give --target-itl-ms"),
    (("--target-itl-ms", "50", "--streams", "8"), "leave them out"),
    (("--target-itl-ms", "50", "--worker", "w1"), "--worker names a worker of a Redis source"),
])
def test_file_curves_need_a_target_that_fits_and_no_conflicting_flags(capsys, curve_file, argv,
                                                                      message):
    code, out, err = run(capsys, "--step-cost", curve_file, *argv)
    assert code == plan.EXIT_USAGE and out == "" and message in err


def test_curve_flags_need_step_cost(capsys):
    code, _, err = run(capsys, "--target-itl-ms", "50")
    assert code == plan.EXIT_USAGE and "--target-itl-ms needs --step-cost" in err
