"""SSE frames of one streamed response, built from pre-serialised JSON templates: the hot path
(one text delta per token) escapes the text and joins bytes, with no pydantic model and no
`json.dumps` of a whole chunk. The frames parse to exactly what `responses.chunk_json` makes of
the corresponding pydantic chunk (tests/gateway/test_gateway_sse_chunks.py holds them equal)."""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring  # the C escaper json.dumps(ensure_ascii=False) uses

from pydantic import BaseModel

from kvfleet.gateway.openai.responses import UsageInfo

_SEPARATORS = (",", ":")


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=_SEPARATORS)


def _logprobs_json(logprobs: BaseModel | None) -> str:
    return "null" if logprobs is None else _json(logprobs.model_dump())


def _finish_json(finish_reason: str | None, stop_reason: int | str | None) -> str:
    """The choice's closing fields: `stop_reason` only beside a finish reason (as the models)."""
    if finish_reason is None:
        return '"finish_reason":null'
    stop = ("null" if stop_reason is None else str(stop_reason) if isinstance(stop_reason, int)
            else encode_basestring(stop_reason))
    return f'"finish_reason":{encode_basestring(finish_reason)},"stop_reason":{stop}'


class _ChunkEncoder:
    """What both chunk shapes share: the head `{"id":...,"choices":[` and the usage chunk.

    Field order follows the pydantic models, so a frame is byte-equal to `chunk_json`'s too.
    """

    object_name = ""

    def __init__(self, response_id: str, created: int, model: str,
                 usage_so_far: Callable[[], UsageInfo] | None = None):
        head = (f'{{"id":{_json(response_id)},"object":"{self.object_name}",'
                f'"created":{int(created)},"model":{_json(model)},"choices":[')
        self._head = head
        self._tail = '],"usage":null,"system_fingerprint":null}'
        # vLLM's continuous_usage_stats: every choice chunk carries the usage at that point
        self._usage_so_far = usage_so_far

    def _frame(self, choice: str, fingerprint: str | None = None) -> bytes:
        """One choice's chunk; `fingerprint` (a choice's last chunk: the numerics its tokens
        were computed on) as its `system_fingerprint`."""
        if self._usage_so_far is not None or fingerprint is not None:
            usage = ("null" if self._usage_so_far is None
                     else _json(self._usage_so_far().model_dump()))
            tail = f'],"usage":{usage},"system_fingerprint":{_json(fingerprint)}}}'
            return f"data: {self._head}{choice}{tail}\n\n".encode()
        return f"data: {self._head}{choice}{self._tail}\n\n".encode()

    def usage(self, usage: UsageInfo, fingerprint: str | None = None) -> bytes:
        """The last chunk of `stream_options.include_usage`: no choices, the usage (and the
        response's system_fingerprint)."""
        return (f'data: {self._head}],"usage":{_json(usage.model_dump())},'
                f'"system_fingerprint":{_json(fingerprint)}}}\n\n').encode()


class CompletionChunkEncoder(_ChunkEncoder):
    """Frames of a /v1/completions stream (`CompletionResponse` with one `CompletionChoice`)."""

    object_name = "text_completion"

    def text(self, index: int, text: str, logprobs: BaseModel | None = None,
             finish_reason: str | None = None, stop_reason: int | str | None = None,
             numerics: str | None = None) -> bytes:
        return self._frame(f'{{"index":{index},"text":{encode_basestring(text)},'
                           f'"logprobs":{_logprobs_json(logprobs)},'
                           f'{_finish_json(finish_reason, stop_reason)}}}', numerics)


class ChatChunkEncoder(_ChunkEncoder):
    """Frames of a /v1/chat/completions stream (`ChatCompletionChunk` with one
    `ChatChunkChoice`); a delta leaves out the fields it does not set, as `chunk_json` does."""

    object_name = "chat.completion.chunk"

    def role(self, index: int) -> bytes:
        """The first chunk of a choice: the assistant role and empty content."""
        return self._choice(index, '{"role":"assistant","content":""}', None, None)

    def content(self, index: int, text: str, logprobs: BaseModel | None = None) -> bytes:
        return self._choice(index, f'{{"content":{encode_basestring(text)}}}', logprobs, None)

    def pieces(self, index: int, piece, logprobs: BaseModel | None = None) -> list[bytes]:
        """Frames of one ChatPiece: reasoning, content (with the logprobs), tool-call deltas."""
        frames = []
        if piece.reasoning:
            frames.append(self._choice(
                index, f'{{"reasoning_content":{encode_basestring(piece.reasoning)}}}', None, None))
        if piece.content or (logprobs is not None and not piece.tool_calls):
            frames.append(self.content(index, piece.content, logprobs))
            logprobs = None
        if piece.tool_calls:
            calls = [c.model_dump(exclude_none=True) for c in piece.tool_calls]
            frames.append(self._choice(index, f'{{"tool_calls":{_json(calls)}}}', logprobs, None))
        return frames

    def finish(self, index: int, finish_reason: str, stop_reason: int | str | None = None,
               numerics: str | None = None) -> bytes:
        """A choice's last chunk: its finish reason, and as `system_fingerprint` the numerics
        its tokens were computed on."""
        return self._choice(index, "{}", None, finish_reason, stop_reason, numerics)

    def _choice(self, index: int, delta: str, logprobs: BaseModel | None,
                finish_reason: str | None, stop_reason: int | str | None = None,
                numerics: str | None = None) -> bytes:
        return self._frame(f'{{"index":{index},"delta":{delta},'
                           f'"logprobs":{_logprobs_json(logprobs)},'
                           f'{_finish_json(finish_reason, stop_reason)}}}', numerics)
