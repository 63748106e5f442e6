"""A worker service's loop in a thread of the test's own process, stopped on exit."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(service) -> Iterator:
    """Connect `service` (a worker.service.WorkerService), run its loop in a daemon thread until
    the block ends, then stop it and wait for the loop to return."""
    service.connect()
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield service
    finally:
        stop.set()
        thread.join(10)
