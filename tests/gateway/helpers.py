"""Constants and helpers the gateway tests share (conftest.py holds the fixtures)."""

from __future__ import annotations

from kvfleet.shared.models import DEFAULT_MODEL

MODEL = DEFAULT_MODEL
CONTEXT_LENGTH = 512  # small, so the context-length checks are cheap to trigger


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
