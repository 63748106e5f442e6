"""benchmarks/step_cost.py: the line whose intercept it reports as a step's fixed cost."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.step_cost import SCENARIOS, fit_line, medians


def test_the_line_through_points_on_a_line_is_that_line():
    a, b = fit_line([(1, 12.5), (32, 28.0), (512, 268.0)])
    assert a == pytest.approx(12.0)
    assert b == pytest.approx(0.5)


def test_the_line_is_the_least_squares_one():
    # (0, 0), (1, 2), (2, 1): mean x 1, mean y 1, slope 0.5, intercept 0.5
    assert fit_line([(0, 0), (1, 2), (2, 1)]) == pytest.approx((0.5, 0.5))


def test_one_x_value_gives_no_line():
    with pytest.raises(ValueError):
        fit_line([(32, 1.0), (32, 2.0)])


def test_medians_take_each_rounds_intercept():
    """Per-scenario medians over every step; `a` and `b`: medians of each round's line through
    its scenarios' medians (seconds in, ms out)."""
    def round_(a: float, b: float) -> dict:
        return {"wall": {name: [(a + b * tokens) / 1e3] * 3 for name, tokens in SCENARIOS}}

    m = medians([round_(10, 0.5), round_(12, 0.5), round_(30, 0.7)], "wall")
    assert m["a"] == pytest.approx(12.0)
    assert m["b"] == pytest.approx(0.5)
    assert m["decode 1"] == pytest.approx(12.5)


def test_the_march_wrapper_builds_for_the_named_cpu_kind():
    """benchmarks/cxx_march.sh (CXX= for the kernels' build): the compiler's arguments with
    -march=native, and only it, replaced by the CPU kind asked for (znver3 by default)."""
    wrapper = str(Path(__file__).resolve().parent.parent / "benchmarks" / "cxx_march.sh")
    env = dict(os.environ, KVFLEET_BENCH_CXX="echo")
    env.pop("KVFLEET_BENCH_MARCH", None)
    args = ["-O3", "-march=native", "-fopenmp", "x.cpp"]
    out = subprocess.run([wrapper, *args], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["-O3", "-march=znver3", "-fopenmp", "x.cpp"]
    env["KVFLEET_BENCH_MARCH"] = "haswell"
    out = subprocess.run([wrapper, *args], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["-O3", "-march=haswell", "-fopenmp", "x.cpp"]
