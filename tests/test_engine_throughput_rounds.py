"""benchmarks/engine_throughput.py's `--repeats N`: every system of a dtype (kvfleet, vLLM, HF,
transformers CB) runs N times, alternated round by round; the table gives medians, the ratios of
the medians and each round's ratio to the kvfleet run it alternated with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import engine_throughput as et
from benchmarks.engine_throughput import Request, Result, System, alternate, combine, print_table


def test_alternate_runs_every_system_once_per_round_in_order(capsys):
    calls = []

    def runner(key, tokens_per_s):
        def run(round_index):
            calls.append((key, round_index))
            return Result(key, 100, 100 / tokens_per_s[round_index])
        return run

    systems = [System("kvfleet", runner("kvfleet", [200, 250, 240]), "kvfleet"),
               System("vLLM", runner("vLLM", [160, 200, 150]), "kvfleet")]
    runs = alternate(systems, 3)
    assert calls == [("kvfleet", 0), ("vLLM", 0), ("kvfleet", 1), ("vLLM", 1),
                     ("kvfleet", 2), ("vLLM", 2)]
    ours, peer = combine(systems, runs)
    assert ours.tokens_per_s == 240 and peer.tokens_per_s == 160  # medians
    assert peer.rounds_tokens_per_s == pytest.approx([160, 200, 150])
    assert peer.round_ratios == pytest.approx([200 / 160, 250 / 200, 240 / 150])
    assert ours.round_ratios == pytest.approx([1, 1, 1])
    assert "round 3 of 3" in capsys.readouterr().out


def test_the_table_quotes_medians_their_ratios_and_each_rounds(capsys):
    rows = [Result("kvfleet, bfloat16 = auto", 6970, 25.0, "", [280.0, 300.0, 270.0],
                   [1.0, 1.0, 1.0]),
            Result("vLLM 0.32, bfloat16", 6970, 33.0, "", [200.0, 220.0, 180.0],
                   [1.4, 300 / 220, 1.5])]
    print_table(rows, "bfloat16")
    out = capsys.readouterr().out
    assert "every round's tok/s (3 rounds)" in out
    # 280 / 200: the ratio of the medians; each round's ratio and their median after
    assert ("| vLLM 0.32, bfloat16 | 6970 | 33.0 | 200.0 | 1.40x | 1.40x | 200.0 / 220.0 / "
            "180.0 | 1.40 / 1.36 / 1.50 (1.40x) |") in out


def test_one_round_prints_the_plain_table(capsys):
    print_table([Result("kvfleet, bfloat16 = auto", 100, 1.0),
                 Result("vLLM 0.32, bfloat16", 100, 2.0)], "bfloat16")
    out = capsys.readouterr().out
    assert "every round" not in out and "median" not in out
    assert "| vLLM 0.32, bfloat16 | 100 | 2.0 | 50.0 | 2.00x | 2.00x |" in out


def test_repeats_give_vllm_and_hf_as_many_rounds_alternated_with_kvfleet(monkeypatch, tmp_path,
                                                                        capsys):
    """main() with its systems faked: --repeats 3 runs kvfleet, vLLM, HF and CB three times
    each, in that order every round (it ran kvfleet three times and vLLM once before)."""
    calls = []
    requests = [Request([1, 2, 3], 4), Request([4, 5], 4)]
    monkeypatch.setattr(et, "resolve_model_path", lambda model: str(tmp_path))
    monkeypatch.setattr(et, "load_tokenizer", lambda path: SimpleNamespace(pad_token_id=0))
    monkeypatch.setattr(et, "load_requests", lambda *a: requests)
    monkeypatch.setattr(et, "resolve_name", lambda name: "bfloat16")
    monkeypatch.setattr(et, "vllm_python", lambda venv: tmp_path / "python")
    monkeypatch.setattr(et, "describe_setup", lambda python, setup: "tuned")
    monkeypatch.setattr(et, "load_model", lambda path, dtype: torch.nn.Linear(1, 1))
    monkeypatch.setattr(et, "kvfleet_start", lambda path, reqs, config: (object(), 1.0))

    def run_kvfleet(model, reqs, config):
        calls.append("kvfleet")
        return Result("kvfleet Engine", 8, 0.1), [[7] * 4 for _ in reqs], None

    def run_offline(python, path, prompts, max_tokens, dtype, max_num_seqs, decode_streams=(),
                    setup="tuned", prefill_prompts=None, **_):
        calls.append("vLLM")
        return SimpleNamespace(startup_s=60.0, seconds=0.2, outputs=[[7] * 4 for _ in prompts],
                               version="0.32", decode_tokens_per_s={}, prefill_seconds=None)

    def run_hf_static(model, subset, bs, pad_id):
        calls.append(f"HF {bs}")
        return Result(f"HF generate, static batch {bs}", 8, 1.0)

    def run_cb(model, reqs):
        calls.append("CB")
        return Result("transformers continuous batching", 8, 0.5)

    monkeypatch.setattr(et, "run_kvfleet", run_kvfleet)
    monkeypatch.setattr(et, "run_offline", run_offline)
    monkeypatch.setattr(et, "run_hf_static", run_hf_static)
    monkeypatch.setattr(et, "run_hf_continuous_batching", run_cb)
    assert et.main(["--dtypes", "bfloat16", "--repeats", "3", "--skip-roofline",
                    "--hf-batch-sizes", "16"]) == 0
    assert calls == ["kvfleet", "vLLM", "HF 16", "CB"] * 3
    out = capsys.readouterr().out
    assert "| vLLM 0.32, bfloat16 | 8 | 0.2 | 40.0 | 2.00x | 2.00x | 40.0 / 40.0 / 40.0 | " \
           "2.00 / 2.00 / 2.00 (2.00x) |" in out
    assert "| HF generate, static batch 16, bfloat16 | 8 | 1.0 | 8.0 | 10.00x |" in out


def test_the_roofline_measurements_alternate_a_round_each(monkeypatch, tmp_path):
    """With the roofline section on, kvfleet measures its decode and prefill after each of its
    rounds and vLLM inside each of its runs (it measured in its first run only, kvfleet once
    after all rounds), so both sides' figures are medians of alternated rounds."""
    calls = []
    requests = [Request([1, 2, 3], 4), Request([4, 5], 4)]
    monkeypatch.setattr(et, "run_kvfleet", lambda model, reqs, config: (
        calls.append("kvfleet") or Result("kvfleet Engine", 8, 0.1), [[7] * 4 for _ in reqs],
        None))
    rates = iter([10.0, 30.0, 20.0])

    def extras(args, model, reqs, config):
        calls.append("kvfleet extras")
        return {"decode": {1: next(rates)}, "context": {1: 5.0}, "prefill_seconds": 2.0}

    def run_offline(python, path, prompts, max_tokens, dtype, max_num_seqs, decode_streams=(),
                    setup="tuned", prefill_prompts=None, **_):
        calls.append(f"vLLM decode {list(decode_streams)} prefill {prefill_prompts is not None}")
        return SimpleNamespace(startup_s=60.0, seconds=0.2, outputs=[[7] * 4 for _ in prompts],
                               version="0.32", decode_tokens_per_s={1: 12.0},
                               prefill_seconds=3.0)

    monkeypatch.setattr(et, "run_offline", run_offline)
    args = et.parse_args(["--decode-streams", "1", "--prefill-prompts", "1"])
    kvfleet_runs: list[dict] = []
    vllm_runs: dict[str, list] = {}
    systems = [
        et.System("kvfleet bfloat16", et.kvfleet_runner(
            object(), requests, None, "bfloat16", "kvfleet bfloat16", {},
            lambda: extras(args, None, requests, None), kvfleet_runs), "kvfleet bfloat16"),
        et.System("vLLM bfloat16", et.vllm_runner(
            args, tmp_path / "python", str(tmp_path), requests, "bfloat16", "tuned", "bfloat16",
            measured=True, outputs={}, startups={}, vllm_runs=vllm_runs), "kvfleet bfloat16")]
    et.alternate(systems, 3)
    assert calls == ["kvfleet", "kvfleet extras", "vLLM decode [1] prefill True"] * 3
    assert [r["decode"][1] for r in kvfleet_runs] == [10.0, 30.0, 20.0]
    assert len(vllm_runs["bfloat16"]) == 3
    assert et.rounds_note([10.0, 30.0, 20.0], ".1f") == " (the median of rounds 10.0 / 30.0 / 20.0)"
    assert et.rounds_note([10.0], ".1f") == ""
