"""Speed comparisons of kvfleet against its peers, each printing its figures (docs/BENCHMARKS.md).
Run one as a module from the repository root: `.venv/bin/python -m benchmarks.gateway_load`."""
