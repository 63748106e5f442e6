"""benchmarks/gpu_throughput.py (what gpu_check.sh runs on a GPU) on a tiny random model on CPU: the
script's every system runs and reports, so it is not first exercised on the GPU host."""

from __future__ import annotations

import json

from benchmarks import gpu_throughput


def test_gpu_throughput_runs_every_system(tmp_path, capsys):
    workload = tmp_path / "trace.jsonl"
    workload.write_text("".join(json.dumps({"prompt": "word " * n, "max_tokens": m}) + "\n"
                                for n, m in [(5, 6), (12, 3), (3, 9), (20, 4)]))
    rows_path = tmp_path / "rows.json"
    assert gpu_throughput.main(["--smoke", "--workload", str(workload), "--json", str(rows_path)]) == 0
    rows = json.loads(rows_path.read_text())
    systems = {(r["test"], r["system"]) for r in rows}
    assert {("decode", "kvfleet"), ("decode", "HF generate"), ("trace", "kvfleet"),
            ("trace", "HF generate (static batch 2)")} <= systems
    trace = {r["system"]: r["tokens"] for r in rows if r["test"] == "trace"}
    assert set(trace.values()) == {6 + 3 + 9 + 4}  # every system produced each max_tokens
    assert all(r["seconds"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "kvfleet = " in printed and "tok/s" in printed
