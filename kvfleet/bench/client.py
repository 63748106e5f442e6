"""One benchmark request: a streaming POST to an OpenAI-compatible server, timed chunk by chunk.

Timing is taken on the client with a monotonic clock: TTFT is send -> first chunk that carries
content; the gaps between content chunks are the inter-token latencies. A server may put more
than one token in a chunk, so a request's per-token ITL is each chunk gap divided by its mean
tokens per chunk (usage.completion_tokens / content chunks); with one token per chunk the two
are the same."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from kvfleet.bench.trace import TraceRequest

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_MAX_ERROR_CHARS = 200


@dataclass(frozen=True)
class BenchTarget:
    model: str
    endpoint: str = "chat"  # a key of ENDPOINT_PATHS
    timeout_s: float = 300.0  # whole request, send to last byte
    temperature: float | None = None  # sent when set (0 = greedy); else the server's default


@dataclass
class RequestRecord:
    """Filled in as the stream arrives, so a request cut short keeps what it measured.
    Times ending in `_at_s` are seconds since the start of the run."""

    index: int
    scheduled_at_s: float
    max_tokens: int
    sent_at_s: float | None = None
    finished_at_s: float | None = None
    status_code: int | None = None
    error: str | None = None
    done: bool = False  # the stream ended with [DONE]
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_offsets_s: list[float] = field(default_factory=list)  # content chunks, since send
    output_tokens: int | None = None  # usage.completion_tokens, else the content chunk count
    prompt_tokens: int | None = None
    usage_reported: bool = False
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    finish_reason: str | None = None
    response_id: str | None = None  # the chunks' "id"
    content: list[str] = field(default_factory=list, repr=False)  # the content chunks' text

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def ok(self) -> bool:
        return self.error is None and self.done

    @property
    def tokens_per_chunk(self) -> float:
        if not self.chunk_offsets_s or not self.output_tokens:
            return 1.0
        return self.output_tokens / len(self.chunk_offsets_s)

    @property
    def itl_s(self) -> list[float]:
        """Per-token inter-token latencies (chunk gaps ÷ mean tokens per chunk)."""
        offsets, per_chunk = self.chunk_offsets_s, self.tokens_per_chunk
        return [(b - a) / per_chunk for a, b in zip(offsets, offsets[1:])]

    @property
    def tokens_per_s(self) -> float | None:
        """The stream's pace after its first chunk: 1 / mean per-token ITL. None when the
        answer came in a single chunk (no pace to measure)."""
        itl_s = self.itl_s
        decode_s = sum(itl_s)
        return len(itl_s) / decode_s if itl_s and decode_s > 0 else None


def request_body(target: BenchTarget, request: TraceRequest) -> dict:
    body = {"model": request.model or target.model, "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if target.endpoint == "chat":
        body["messages"] = (list(request.messages) if request.messages is not None
                            else [{"role": "user", "content": request.prompt}])
    elif request.prompt_token_ids is not None:
        body["prompt"] = list(request.prompt_token_ids)
    else:
        body["prompt"] = request.prompt
    if target.temperature is not None:
        body["temperature"] = target.temperature
    if request.ignore_eos:
        body["ignore_eos"] = True  # a vLLM/kvfleet extension; sent only when the trace asks
    return body


async def stream_request(client: httpx.AsyncClient, target: BenchTarget,
                         request: TraceRequest, record: RequestRecord, run_start: float) -> None:
    """Send one request and fill `record`; never raises for a failed request."""
    sent = time.perf_counter()
    record.sent_at_s = sent - run_start
    try:
        async with asyncio.timeout(target.timeout_s):
            await _stream(client, target, request, record, sent)
    except TimeoutError:
        record.error = f"timeout after {target.timeout_s:g} s"
    except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    finally:
        finish_record(record, run_start)


def finish_record(record: RequestRecord, run_start: float) -> None:
    """Stamp the end time and fall back to counting chunks when the server sent no usage."""
    if record.finished_at_s is None:
        record.finished_at_s = time.perf_counter() - run_start
    if record.sent_at_s is not None:
        record.e2e_s = record.finished_at_s - record.sent_at_s
    if record.output_tokens is None:
        record.output_tokens = len(record.chunk_offsets_s)
    if record.error is None and not record.done:
        record.error = "stream ended before [DONE]"


async def _stream(client: httpx.AsyncClient, target: BenchTarget, request: TraceRequest,
                  record: RequestRecord, sent: float) -> None:
    path = ENDPOINT_PATHS[target.endpoint]
    async with client.stream("POST", path, json=request_body(target, request)) as response:
        record.status_code = response.status_code
        if response.status_code != 200:
            record.error = await _http_error(response)
            return
        async for line in response.aiter_lines():
            if _handle_line(line, target.endpoint, record, sent):
                return


def _handle_line(line: str, endpoint: str, record: RequestRecord, sent: float) -> bool:
    """Apply one SSE line to the record; True when the stream is over."""
    if not line.startswith("data:"):
        return False  # blank separators, comments, event: lines
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        record.done = True
        return True
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        record.error = f"bad SSE data: {data[:80]!r}"
        return True
    if "error" in chunk:
        record.error = f"stream error: {_error_message(chunk)}"
        return True
    _apply_chunk(chunk, endpoint, record, time.perf_counter() - sent)
    return False


def _apply_chunk(chunk: dict, endpoint: str, record: RequestRecord, offset_s: float) -> None:
    record.response_id = record.response_id or chunk.get("id")
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if endpoint == "chat" \
            else choice.get("text")
        if text:
            if record.ttft_s is None:
                record.ttft_s = offset_s
            record.chunk_offsets_s.append(offset_s)
            record.content.append(text)
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    usage = chunk.get("usage")
    if usage:
        record.usage_reported = True
        record.output_tokens = usage.get("completion_tokens")
        record.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")


async def _http_error(response: httpx.Response) -> str:
    body = (await response.aread()).decode("utf-8", "replace")
    try:
        message = _error_message(json.loads(body))
    except (json.JSONDecodeError, AttributeError):
        message = body.strip()
    return f"HTTP {response.status_code}: {message}"[:_MAX_ERROR_CHARS]


def _error_message(document: dict) -> str:
    """OpenAI's error shape {"error": {"message": ...}}, or FastAPI's {"detail": ...}."""
    error = document.get("error", document.get("detail", document))
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)
