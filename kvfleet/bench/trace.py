"""A recorded prompt trace for load tests: one JSON object per line,
`{"t": arrival seconds, "prompt": str, "max_tokens": int, "ignore_eos": bool, "model": str}`
(`model` optional: the request names it instead of the run's --model, e.g. a LoRA adapter)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """The trace file is missing, unreadable, or has a malformed line."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # offset from the trace's first arrival
    prompt: str
    max_tokens: int
    ignore_eos: bool = False
    # chat messages sent instead of one user message holding `prompt` (a multi-turn chat that
    # resends its history); traces read from a file have none
    messages: tuple[dict[str, str], ...] | None = None
    # the `model` this request names instead of the run's --model (a trace spread over several
    # models or LoRA adapters); None: the run's
    model: str | None = None
    # the prompt as token ids, sent instead of `prompt` to the completions endpoint (a prompt of
    # an exact length, not tokenised by the server); traces read from a file have none
    prompt_token_ids: tuple[int, ...] | None = None


def load_trace(path: str | Path, num_requests: int | None = None) -> list[TraceRequest]:
    """The first `num_requests` lines (all when None), sorted by arrival, times shifted so that
    the first request arrives at 0."""
    requests = [_parse_line(line, path, number) for number, line in _read_lines(path)]
    if num_requests is not None:
        requests = requests[:num_requests]
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    requests.sort(key=lambda request: request.arrival_s)
    first_s = requests[0].arrival_s
    return [dataclasses.replace(r, arrival_s=r.arrival_s - first_s) for r in requests]


def _read_lines(path: str | Path) -> list[tuple[int, str]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {getattr(exc, 'strerror', None) or exc}") \
            from None
    return [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _parse_line(line: str, path: str | Path, number: int) -> TraceRequest:
    where = f"{path}:{number}"
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(entry, dict):
        raise TraceError(f"{where}: expected a JSON object")
    arrival_s, prompt = entry.get("t", 0.0), entry.get("prompt")
    max_tokens, ignore_eos = entry.get("max_tokens"), entry.get("ignore_eos", False)
    if not isinstance(arrival_s, (int, float)) or isinstance(arrival_s, bool) or arrival_s < 0:
        raise TraceError(f"{where}: 't' must be a number of seconds >= 0")
    if not isinstance(prompt, str) or not prompt:
        raise TraceError(f"{where}: 'prompt' must be a non-empty string")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise TraceError(f"{where}: 'max_tokens' must be an integer >= 1")
    if not isinstance(ignore_eos, bool):
        raise TraceError(f"{where}: 'ignore_eos' must be true or false")
    model = entry.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise TraceError(f"{where}: 'model' must be a non-empty string")
    return TraceRequest(float(arrival_s), prompt, max_tokens, ignore_eos, model=model)
