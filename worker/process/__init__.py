"""A worker's processes: the worker (main.py starts it; service.py is its loop, which composes
the parts in worker/ with the handoffs in worker/handoff/) and a tensor-parallel rank's (tp_rank.py)."""
