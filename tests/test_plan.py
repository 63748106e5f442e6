"""`kvfleet plan`: the defaults print the seed's numbers; --from-model derives KV bytes per token
from a config; bad input ends in a one-line error and exit code 2."""

from __future__ import annotations

import json

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
