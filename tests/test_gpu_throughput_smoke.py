"""benchmarks/gpu_throughput.py (what gpu_check.sh runs on a GPU) on a tiny random model on CPU: the
script's every system runs and reports, so it is not first exercised on the GPU host; and the
report's lines (ratios, HBM fraction, the issue's targets) from given rows."""

from __future__ import annotations

import json

from benchmarks import gpu_throughput
from benchmarks.gpu_throughput import Row, report


def test_gpu_throughput_runs_every_system(tmp_path, capsys):
    workload = tmp_path / "trace.jsonl"
    workload.write_text("".join(json.dumps({"prompt": "word " * n, "max_tokens": m}) + "\n"
                                for n, m in [(5, 6), (12, 3), (3, 9), (20, 4)]))
    out_path = tmp_path / "out.json"
    assert gpu_throughput.main(["--smoke", "--workload", str(workload), "--json", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    rows = out["rows"]
    systems = {(r["test"], r["system"]) for r in rows}
    assert {("decode", "kvfleet"), ("decode", "HF generate"), ("trace", "kvfleet"),
            ("trace", "transformers continuous batching"),
            ("trace", "HF generate (static batch 2)")} <= systems
    trace = {r["system"]: r["tokens"] for r in rows if r["test"] == "trace"}
    assert set(trace.values()) == {6 + 3 + 9 + 4}  # every system produced each max_tokens
    assert all(r["seconds"] > 0 for r in rows)
    assert out["decode"]["tiny"]["hbm_bytes_per_s"] > 0
    printed = capsys.readouterr().out
    assert "kvfleet = " in printed and "tok/s" in printed
    assert "GB/s achieved in kvfleet's decode steps = no HBM peak known on cpu" in printed


def rows_of(model: str, **tokens_per_s: float) -> list[Row]:
    systems = {"decode_kvfleet": ("decode", "kvfleet"), "decode_hf": ("decode", "HF generate"),
               "trace_kvfleet": ("trace", "kvfleet"),
               "trace_cb": ("trace", "transformers continuous batching")}
    return [Row(model, *systems[key], tokens=int(rate * 10), seconds=10.0)
            for key, rate in tokens_per_s.items()]


def test_the_report_prints_ratios_the_hbm_fraction_and_the_targets():
    info = dict(step_ms=10.0, bytes_per_step=36e9 * 0.010, graphs=True, backend="triton")
    lines = report("8b", rows_of("8b", decode_kvfleet=6000, decode_hf=1000), info, 4.8e12, "H200")
    text = "\n".join(lines)
    assert "kvfleet = 6.00x" in text
    assert "36.0 GB/s achieved" in text and "= 1% of 4800 GB/s (H200)" in text
    assert "target: decode HBM fraction of peak >= 0.7: 0.01 MISSED" in text
    assert "target: decode kvfleet / HF generate >= 5: 6.00 met" in text
    failed = Row("default", "trace", "transformers continuous batching", 0, 0.0, "failed: boom")
    lines = report("default", rows_of("default", trace_kvfleet=500) + [failed], {}, 0.0, "cpu")
    text = "\n".join(lines)
    assert "failed: boom" in text
    assert "target: trace kvfleet / transformers CB >= 10: not measured n/a" in text
