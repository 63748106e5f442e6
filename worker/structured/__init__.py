"""Constrained decoding on the worker: compiled grammars, per-request matchers, logit masks."""
