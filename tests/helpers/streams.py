"""Hooks of end-to-end tests that act on a fleet while its clients stream: once the requests'
owners and checkpoints say so, do something (start a worker, kill one, drain one)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvfleet.shared.wire import Keys, RequestRecord
from kvfleet.shared.wire.checkpoint import TOKEN_BYTES

# (the requests' ids, their current workers as bytes, their checkpointed token counts)
Ready = Callable[[list[str], list[bytes | None], list[int]], bool]


def when_streaming(client, keys: Keys, ready: Ready, act: Callable[[list[str], list], None],
                   what: str, timeout_s: float = 300, poll_s: float = 0.05):
    """A `run_all` hook (`on_started(records)`): once every record has its request id and
    `ready(ids, owners, progress)` holds, `act(ids, owners)` once; fails after `timeout_s`."""
    def hook(records):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ids = [r.get("id") for r in records]
            if all(ids):
                owners = [client.hget(keys.request(i), RequestRecord.WORKER) for i in ids]
                progress = [client.strlen(keys.checkpoint(i)) // TOKEN_BYTES for i in ids]
                if ready(ids, owners, progress):
                    act(ids, owners)
                    return
            time.sleep(poll_s)
        raise AssertionError(f"never within {timeout_s} s: {what}")
    return hook
