"""benchmarks/lora.py and benchmarks/speculation.py: a failed request fails the run (exit 1
after the report), and lora's in-process peer (transformers + peft) runs once per round like
the servers, its ratio taken round by round."""

from __future__ import annotations

from argparse import Namespace

from benchmarks import lora, speculation
from benchmarks.speculation import Measurement, RunKey


def lora_run(system: str, round_index: int, tokens_per_s: float, ok: int = 32) -> lora.Run:
    return lora.Run(system, round_index, 32, ok, 2000, 2000 / tokens_per_s, tokens_per_s,
                    None if ok == 32 else "HTTP 500: boom")


def test_lora_peft_runs_every_round_and_its_ratio_is_per_round(capsys):
    runs = [lora_run("kvfleet base", 0, 260.0), lora_run("kvfleet LoRA", 0, 200.0),
            lora_run("kvfleet base", 1, 250.0), lora_run("kvfleet LoRA", 1, 180.0)]
    args = Namespace(num_requests=32, streams=32, adapters=4, rank=16, peft_tokens=64)
    lora.report(runs, [], [25.0, 30.0], args)
    out = capsys.readouterr().out
    assert "| transformers + peft generate (64 tokens each) | 27.5 | 2 |" in out
    assert "kvfleet LoRA ÷ peft generate: 7.0x (median of the rounds' ratios: 8.0 / 6.0)" in out


def test_lora_failed_requests_fail_the_run(capsys):
    assert lora.report_failures([lora_run("kvfleet LoRA", 0, 200.0)]) == 0
    assert lora.report_failures([lora_run("kvfleet LoRA", 0, 200.0),
                                 lora_run("vLLM LoRA", 1, 50.0, ok=30)]) == 1
    assert "FAILED: vLLM LoRA, round 2: 2 of 32 requests failed (HTTP 500: boom)" in \
        capsys.readouterr().out


def test_speculation_failed_requests_fail_the_run(capsys):
    def measurement(ok: int) -> Measurement:
        return Measurement("vLLM", 0, RunKey("quoting", 4, "greedy"), 32, ok, 100, 1.0, 10.0,
                           100.0, None, [], None if ok == 32 else "timed out")

    assert speculation.report_failures([measurement(32)]) == 0
    assert speculation.report_failures([measurement(32), measurement(31)]) == 1
    assert ("FAILED: vLLM, round 1, quoting, 4 streams, greedy: 1 of 32 requests failed "
            "(timed out)") in capsys.readouterr().out
