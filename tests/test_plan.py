"""`kvfleet plan`: the defaults print the seed's numbers; --from-model derives KV bytes per token
from a config; bad input ends in a one-line error and exit code 2."""

from __future__ import annotations

import json
import math

import pytest

from kvfleet.plan import command as plan

SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
}


def run_json(capsys, *argv: str) -> dict:
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def conversations_by_context(document: dict) -> dict[int, int]:
    return {fit["context_tokens"]: fit["conversations_per_gpu"] for fit in document["contexts"]}


def test_defaults_reproduce_the_seed_numbers_in_json(capsys):
    document = run_json(capsys)
    assert document["memory"]["weights_gb"] == 40
    assert document["memory"]["free_kv_gb"] == 40
    assert document["memory"]["kv_bytes_per_token"] == 500_000
    assert {f["context_tokens"]: f["kv_gb_per_conversation"] for f in document["contexts"]} == {
        2000: 1, 8000: 4, 16000: 8}
    assert conversations_by_context(document) == {2000: 40, 8000: 10, 16000: 5}
    assert document["throughput"]["tokens_per_s_per_stream"] == 62.5
    assert document["throughput"]["gpus_needed"] == 1447
    assert document["cost"] is None


def test_default_table_shows_the_seed_numbers(capsys):
    assert plan.main([]) == 0
    table = capsys.readouterr().out
    assert "= 40 GB" in table  # weights
    assert "80 GB - 40 GB = 40 GB" in table  # free for KV
    rows = {line.split()[0]: line.split() for line in table.splitlines()
            if line.strip()[:1].isdigit()}
    assert rows["2,000"][-2:] == ["GB", "40"] and rows["2,000"][1] == "1"
    assert rows["8,000"][1:] == ["4", "GB", "10"]
    assert rows["16,000"][1:] == ["8", "GB", "5"]
    assert "= 62.5 tokens/s" in table
    assert "accelerators needed   1,447" in table
    assert "2,000,000 -> 2,000 prefill token computations" in table
    assert "live KV per conversation is unchanged" in table


def test_smaller_kv_dtype_nearly_doubles_conversations(capsys):
    document = run_json(capsys)
    what_if = document["kv_dtype_what_ifs"][0]
    # 1 byte per value plus a 2-byte scale per 128 values: 2 / 1.015625 = 1.97x
    assert what_if["kv_dtype"] == "fp8/int8"
    assert what_if["capacity_factor"] == pytest.approx(2 / (1 + 2 / 128))
    assert what_if["kv_bytes_per_token"] == 253_906
    assert [f["conversations_per_gpu"] for f in what_if["contexts"]] == [78, 19, 9]
    fp8 = run_json(capsys, "--kv-dtype", "fp8", "--context", "8000")
    assert fp8["memory"]["kv_bytes_per_token"] == 253_906
    assert conversations_by_context(fp8) == {8000: 19}
    assert fp8["kv_dtype_what_ifs"] == []
    # a smaller head carries more scale per value
    small_heads = run_json(capsys, "--kv-dtype", "int8", "--head-dim", "64", "--context", "8000")
    assert small_heads["memory"]["kv_bytes_per_token"] == round(250_000 * (1 + 2 / 64))


def test_cost_and_context_mix(capsys):
    document = run_json(capsys, "--cost-per-hour", "2.5",
                        "--context-mix", "2000:0.5,8000:0.4,16000:0.1")
    cost = document["cost"]
    assert cost["fleet_cost_per_hour"] == pytest.approx(1447 * 2.5)
    assert cost["cost_per_million_tokens_full_gpu"] == pytest.approx(2.5 / (2000 * 3600) * 1e6)
    assert cost["cost_per_million_tokens_fleet"] == pytest.approx(
        1447 * 2.5 / (2893519 * 3600) * 1e6)
    assert document["mix"]["context_tokens"] == pytest.approx(5800)
    assert document["mix"]["conversations_per_gpu"] == 13  # 40 GB / 2.9 GB
    assert [f["mix_weight"] for f in document["contexts"]] == pytest.approx([0.5, 0.4, 0.1])


def test_prefix_caching_what_if_follows_the_seed(capsys):
    prefix = run_json(capsys, "--prefix-share", "0.25")["prefix_what_if"]
    assert prefix["computations_without_cache"] == 2_000_000
    assert prefix["computations_with_cache"] == 2_000
    assert prefix["prefill_fraction_left"] == pytest.approx(0.75)
    assert prefix["live_kv_unchanged"] is True


def test_from_model_derives_kv_bytes_and_params(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    fp32 = run_json(capsys, "--from-model", str(tmp_path), "--kv-dtype", "fp32")
    assert fp32["memory"]["kv_bytes_per_token"] == 46_080
    bf16 = run_json(capsys, "--from-model", str(tmp_path / "config.json"))
    assert bf16["memory"]["kv_bytes_per_token"] == 23_040
    assert bf16["inputs"]["num_params"] == pytest.approx(134.5e6, rel=0.01)
    explicit = run_json(capsys, "--from-model", json.dumps(SMOLLM2_CONFIG), "--params", "1B")
    assert explicit["memory"]["weights_bytes"] == 2_000_000_000


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "fp8", "int8"])
def test_plan_and_the_engine_agree_on_kv_bytes_per_token(capsys, kv_dtype):
    import torch
    from transformers import LlamaConfig

    from kvfleet.worker.engine.memory.kv_cache import KVLayout
    from kvfleet.worker.engine.memory.kv_format import resolve_kv_format

    document = run_json(capsys, "--from-model", json.dumps(SMOLLM2_CONFIG), "--kv-dtype", kv_dtype)
    layout = KVLayout.from_model_config(LlamaConfig(**SMOLLM2_CONFIG),
                                        resolve_kv_format(kv_dtype, torch.float32))
    assert document["memory"]["kv_bytes_per_token"] == layout.bytes_per_token


def test_from_model_infers_kv_heads_and_head_dim(capsys):
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    document = run_json(capsys, "--from-model", json.dumps(config), "--params", "1e6")
    assert document["memory"]["kv_bytes_per_token"] == 2 * 2 * 4 * 64 * 2


def test_weights_that_do_not_fit_exit_2_with_a_message(capsys):
    assert plan.main(["--params", "60e9"]) == 2
    captured = capsys.readouterr()
    assert "weights do not fit: 120 GB of weights > 80 GB" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize("argv", [
    ["--gpu-memory", "lots"], ["--params", "-3"], ["--streams", "0"],
    ["--context-mix", "2000"], ["--prefix-share", "1.5"], ["--kv-dtype", "fp4"],
    ["--context", "8000", "--context-mix", "8000:1"],
])
def test_bad_flag_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("make_source, message", [
    (lambda tmp: str(tmp / "missing"), "no config.json"),
    (lambda tmp: (tmp / "bad.json").write_text("{not json") and str(tmp / "bad.json"),
     "not valid JSON"),
    (lambda tmp: json.dumps({"vocab_size": 10}), "no layer/attention-head counts"),
])
def test_bad_model_configs_exit_2(tmp_path, capsys, make_source, message):
    assert plan.main(["--from-model", make_source(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_add_arguments_wires_into_a_subcommand(capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="kvfleet")
    plan.add_arguments(parser.add_subparsers(dest="command").add_parser("plan"))
    assert plan.run(parser.parse_args(["plan", "--json", "--context", "2000"])) == 0
    assert conversations_by_context(json.loads(capsys.readouterr().out)) == {2000: 40}


def test_the_redis_side_follows_the_measured_rates(capsys):
    redis = run_json(capsys, "--redis-us-per-event", "25", "--redis-headroom", "0.5",
                     "--gateway-events-per-s", "1000", "--demand", "2000000")["redis"]
    assert redis["events_per_s"] == 2_000_000
    assert redis["events_per_s_per_primary"] == 20_000  # 1e6 / 25 µs x 50%
    assert redis["primaries"] == 100 and redis["replicas"] == 100
    assert redis["gateways"] == 4000 and redis["gateway_pubsub_connections"] == 400_000
    coalesced = run_json(capsys, "--redis-us-per-event", "25", "--demand", "2000000",
                         "--tokens-per-event", "4")["redis"]
    assert coalesced["events_per_s"] == 500_000 and coalesced["primaries"] == 25
    small = run_json(capsys, "--demand", "3000")["redis"]
    assert small["primaries"] == 1 and small["gateway_pubsub_connections"] == small["gateways"]


def test_tensor_parallel_counts_memory_per_rank(capsys):
    one = run_json(capsys, "--from-model", json.dumps(SMOLLM2_CONFIG), "--gpu-memory", "1GB")
    two = run_json(capsys, "--from-model", json.dumps(SMOLLM2_CONFIG), "--gpu-memory", "1GB",
                   "--tensor-parallel-size", "2")
    params, replicated = one["inputs"]["num_params"], 49152 * 576  # tied: one embedding matrix
    assert two["inputs"]["replicated_params"] == replicated
    # layers split over the ranks, the embedding whole on each
    assert two["memory"]["weights_bytes"] == -(-((params - replicated) / 2 + replicated) * 2 // 1)
    assert two["memory"]["free_kv_bytes"] == 10**9 - two["memory"]["weights_bytes"]
    # 3 KV heads over 2 ranks: the larger share holds 2 of them
    assert two["memory"]["kv_bytes_per_token"] == one["memory"]["kv_bytes_per_token"] * 2 // 3
    assert two["memory"]["tokens_that_fit"] == \
        two["memory"]["free_kv_bytes"] // two["memory"]["kv_bytes_per_token"]
    assert two["memory"]["tokens_that_fit"] > one["memory"]["tokens_that_fit"]


def test_tensor_parallel_without_a_model_and_whole_workers(capsys):
    document = run_json(capsys, "--tensor-parallel-size", "2")
    assert document["memory"]["weights_gb"] == 20  # nothing known to be replicated
    assert document["memory"]["kv_bytes_per_token"] == 250_000
    assert conversations_by_context(document) == {2000: 120, 8000: 30, 16000: 15}
    assert (document["throughput"]["gpus_needed"], document["throughput"]["workers_needed"]) == \
        (1448, 724)  # 1,447 accelerators' worth, in whole workers of 2
    assert plan.main(["--tensor-parallel-size", "2"]) == 0
    table = capsys.readouterr().out
    assert "Memory (per rank: a worker is 2 accelerators" in table
    assert "in 724 workers of 2" in table and "Conversations per worker" in table


# --step-cost with the prompts: a worker at pace decodes n streams and, at steady state, prefills
# the prompts of the streams that replace those ending, n x P / O prompt tokens a step on average

# per stream a step: 0.5 ms a row + 1,000 positions x 0.1 µs + 600 / 400 prompt tokens x 0.2 ms
PREFILL_CURVE = {"base_s": 0.010, "decode_row_s": 0.0005, "context_token_s": 1e-7,
                 "prefill_token_s": 2e-4, "overhead_s": 0.002, "margin": 1.25, "steps": 300}


def curve_file(tmp_path, **coefficients) -> str:
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({**PREFILL_CURVE, **coefficients}))
    return str(path)


def pace_of(capsys, path: str, *argv: str) -> dict:
    return run_json(capsys, "--step-cost", path, "--target-itl-ms", "50", *argv)["measured_pace"]


def test_the_streams_at_pace_count_the_prefill_of_the_prompts_that_replace_ending_streams(
        tmp_path, capsys):
    path = curve_file(tmp_path)
    document = run_json(capsys, "--step-cost", path, "--target-itl-ms", "50",
                        "--prompt-tokens", "600", "--output-tokens", "400", "--demand", "10000")
    pace = document["measured_pace"]
    # the largest s: base + s x row + s x C x ctx + s x (P / O) x p <= target / margin - overhead
    per_stream = 0.0005 + 1000 * 1e-7 + 600 / 400 * 2e-4
    streams = math.floor((0.050 / 1.25 - 0.002 - 0.010) / per_stream)
    assert pace["streams"] == streams == 31  # 0.028 / 0.0009 = 31.1
    assert pace["streams_decode_only"] == math.floor(0.028 / 0.0006) == 46  # the old figure
    turn = (0.010 + streams * per_stream + 0.002) * 1.25
    assert pace["tokens_per_s"] == pytest.approx(streams / turn)
    assert document["throughput"]["streams_per_gpu"] == 31
    assert document["throughput"]["gpus_needed"] == math.ceil(10000 / (streams / turn))
    # the context defaults to prompt + answer: the memory section's too
    assert pace["context_tokens"] == 1000 and conversations_by_context(document).keys() == {1000}
    assert (pace["prompt_tokens"], pace["output_tokens"], pace["prefix_share"]) == (600, 400, 0)
    assert pace["prefill_tokens_per_stream_step"] == pytest.approx(1.5)
    assert pace["prefill_tokens_per_step"] == pytest.approx(31 * 1.5)
    assert pace["prefill_share"] == pytest.approx(31 * 1.5 * 2e-4 * 1.25 / turn)
    assert pace["prefill_source"] == "--prompt-tokens, --output-tokens"


def test_without_a_prefill_coefficient_or_prompt_the_decode_only_figures_stay(tmp_path, capsys):
    from kvfleet.shared.pace import StepCostCurve

    no_prefill = curve_file(tmp_path, prefill_token_s=0.0)
    curve = StepCostCurve.from_json(json.dumps({**PREFILL_CURVE, "prefill_token_s": 0.0}))
    for argv in (("--prompt-tokens", "600", "--output-tokens", "400"), ("--context", "1000")):
        pace = pace_of(capsys, no_prefill, *argv)
        assert pace["streams"] == pace["streams_decode_only"] == \
            curve.streams_at_pace(0.050, 1000) == 46
        assert pace["tokens_per_s"] == curve.tokens_per_s_at_pace(0.050, 1000)  # to the bit
        assert pace["prefill_share"] == 0
    # no prompt tokens on a curve with a prefill cost: decode only too
    pace = pace_of(capsys, curve_file(tmp_path), "--prompt-tokens", "0", "--context", "1000")
    assert (pace["streams"], pace["output_tokens"]) == (46, 1000)


def test_the_prefill_context_counts_each_uncached_prompt_token_against_its_positions(
        tmp_path, capsys):
    path = curve_file(tmp_path, context_token_s=0.0, prefill_token_s=0.0, prefill_context_s=1e-7,
                      overhead_s=0.0, margin=1.0)

    def expected(prompt: int, output: int, share: float) -> int:
        uncached = prompt * (1 - share)  # after the cached opening of prompt - uncached tokens
        pairs = uncached * (prompt - uncached) + uncached * (uncached + 1) / 2
        return math.floor((0.030 - 0.010) / (0.0005 + pairs / output * 1e-7))

    def streams(*argv: str) -> int:
        return run_json(capsys, "--step-cost", path, "--target-itl-ms", "30",
                        "--prompt-tokens", "1000", "--output-tokens", "500",
                        *argv)["measured_pace"]["streams"]

    assert streams() == expected(1000, 500, 0.0) == 33  # 1,001 pairs a stream a step
    assert streams("--prefix-share", "0.5") == expected(1000, 500, 0.5) == 34  # 750.5 pairs
    assert streams("--prefix-share", "1") == 40  # every prompt cached: decode only


def test_a_missing_prompt_or_answer_length_is_the_rest_of_the_context(tmp_path, capsys):
    path = curve_file(tmp_path)
    seed = pace_of(capsys, path, "--context", "2000,8000")  # the longest: 8,000
    assert (seed["prompt_tokens"], seed["output_tokens"]) == (7500, 500)  # the seed's answers
    assert "assumed: the seed's 500-token answers" in seed["prefill_source"]
    assert seed["streams"] < seed["streams_decode_only"]
    answer = pace_of(capsys, path, "--context", "8000", "--output-tokens", "2000")
    assert (answer["prompt_tokens"], answer["output_tokens"]) == (6000, 2000)
    prompt = pace_of(capsys, path, "--context", "8000", "--prompt-tokens", "6000")
    assert (prompt["prompt_tokens"], prompt["output_tokens"]) == (6000, 2000)
    assert prompt["streams"] == answer["streams"]
    short = pace_of(capsys, path, "--context", "300")  # the seed's answer, at most the context
    assert (short["prompt_tokens"], short["output_tokens"]) == (0, 300)


@pytest.mark.parametrize("argv, message", [
    (("--context", "8000", "--output-tokens", "9000"), "--output-tokens 9,000 is longer than"),
    (("--context", "8000", "--prompt-tokens", "8000"), "--prompt-tokens 8,000 leaves no answer"),
])
def test_prompt_and_answer_lengths_beyond_the_context_exit_2(tmp_path, capsys, argv, message):
    assert plan.main(["--step-cost", curve_file(tmp_path), "--target-itl-ms", "50", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_the_report_says_the_prefill_share_it_assumed(tmp_path, capsys):
    assert plan.main(["--step-cost", curve_file(tmp_path), "--target-itl-ms", "50",
                      "--prompt-tokens", "600", "--output-tokens", "400"]) == 0
    table = capsys.readouterr().out
    assert "600 prompt tokens and 400 output tokens (--prompt-tokens, --output-tokens)" in table
    # 31 x 1.5 x 0.2 ms of a (10 + 31 x 0.9 + 2) ms step and loop
    assert "1.5 prompt tokens a stream a step, 46.5 a step: 23% of its turn" in table
    assert "31 per worker (46 counting the decode steps only)" in table
