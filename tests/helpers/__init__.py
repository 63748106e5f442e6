"""Helpers the tests (and some benchmarks) share: real gateway and worker processes on one Redis."""
