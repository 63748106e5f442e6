"""Reading a process's Prometheus /metrics in end-to-end tests."""

from __future__ import annotations

import httpx


def metric_total(url: str, name: str, **labels) -> float:
    """The sum of metric `name`'s samples at `url` whose labels include `labels` (0: none)."""
    text = httpx.get(url, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
