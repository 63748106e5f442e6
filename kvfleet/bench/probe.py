"""What a benchmark asks the server before it starts: is it reachable, which model does it serve
(the first id of GET /v1/models), and how many workers does the fleet have (GET /health)."""

from __future__ import annotations

import httpx

# Keys of the /health JSON that may carry the worker count: an int, or a list/dict of workers.
_WORKER_KEYS = ("num_workers", "workers", "workers_alive", "live_workers")


class FleetUnreachable(RuntimeError):
    """The server did not answer, or answered without what the benchmark needs."""


async def list_models(client: httpx.AsyncClient) -> list[str]:
    """Model ids from GET /v1/models; [] when the server has no such route."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise FleetUnreachable(f"cannot reach {client.base_url}: {_reason(exc)}") from None
    if response.status_code != 200:
        return []
    try:
        return [entry["id"] for entry in response.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []


async def resolve_model(client: httpx.AsyncClient, model: str | None) -> str:
    """The given model, or the server's first; raises if the server is unreachable."""
    models = await list_models(client)
    if model:
        return model
    if not models:
        raise FleetUnreachable(f"{client.base_url}/v1/models lists no model; pass --model")
    return models[0]


async def count_workers(client: httpx.AsyncClient) -> int | None:
    """The fleet's worker count from GET /health, or None when it does not say."""
    try:
        response = await client.get("/health")
        document = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(document, dict):
        return None
    for key in _WORKER_KEYS:
        value = document.get(key)
        count = len(value) if isinstance(value, (list, dict)) else value
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            return count
    return None


async def speculation_counts(client: httpx.AsyncClient, model: str) -> tuple[int, int] | None:
    """(proposed, accepted) speculative tokens of the model's live workers since they started,
    from a kvfleet gateway's GET /dashboard/data; None from a server that does not say."""
    try:
        response = await client.get("/dashboard/data")
        workers = response.json()["workers"] if response.status_code == 200 else None
        rows = [w for w in workers if w["model"] == model]
        return (sum(w["spec_draft_tokens"] for w in rows),
                sum(w["spec_accepted_tokens"] for w in rows))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def speculation_summary(before: tuple[int, int] | None,
                        after: tuple[int, int] | None) -> dict | None:
    """The run's proposed and accepted tokens and their ratio (None: not reported; a worker
    that restarted during the run makes the difference meaningless, also None)."""
    if before is None or after is None:
        return None
    proposed, accepted = after[0] - before[0], after[1] - before[1]
    if proposed < 0 or accepted < 0:
        return None
    return {"proposed_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else None}


def _reason(exc: httpx.HTTPError) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
