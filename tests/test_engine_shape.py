"""The engine's step loop stays the loop it is (issue 50): worker/engine/engine.py at most 300
lines, with at most 10 branch lines that name a feature; the features plug in through the step
lifecycle (worker/engine/core/lifecycle.py), not through branches in the loop."""

from __future__ import annotations

import re

from tests.test_architecture import ROOT

ENGINE = ROOT / "worker" / "engine" / "engine.py"
MAX_LINES = 300
MAX_FEATURE_BRANCHES = 10
FEATURES = re.compile(r"lora|adapter|draft|speculat|propos|rank|tp_|tensor_parallel|swap|pace|"
                      r"handoff|offload|tier|graph", re.IGNORECASE)
BRANCH = re.compile(r"^\s*(if|elif|else)\b|\bif\b.*\belse\b")


def feature_branches(text: str) -> list[str]:
    """The branch lines (an if, elif or else, or a conditional expression) naming a feature."""
    return [line.strip() for line in text.splitlines()
            if BRANCH.search(line) and FEATURES.search(line.split("#")[0])]


def test_the_count_sees_a_feature_branch():
    text = ("if seq.lora is not None:\n    pass\nelse:\n    pass\n"
            "x = a if self.draft else b\nif done:  # the pace is kept\n    pass\n")
    assert feature_branches(text) == ["if seq.lora is not None:", "x = a if self.draft else b"]


def test_the_engine_loop_is_short_and_names_few_features():
    text = ENGINE.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert len(feature_branches(text)) <= MAX_FEATURE_BRANCHES, feature_branches(text)
