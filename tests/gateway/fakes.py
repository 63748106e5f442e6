"""A scripted in-process EngineClient: the handlers' tests run without Redis or a worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvfleet.gateway.fleet.client import EngineClient, EngineUnavailable, EventStream
from kvfleet.shared.wire import GenerationRequest, TokenEvent, Usage

Script = list[TokenEvent | float | Exception]  # events, pauses (seconds), or an error to raise


class FakeEventStream(EventStream):
    """Plays a script, then waits forever (a real stream never ends by itself)."""

    def __init__(self, script: Script, on_close: Callable[[], None]):
        self._script = list(script)
        self._on_close = on_close

    async def __anext__(self) -> TokenEvent:
        while self._script:
            item = self._script.pop(0)
            if isinstance(item, float):
                await asyncio.sleep(item)
            elif isinstance(item, Exception):
                raise item
            else:
                return item
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self._on_close()


class FakeEngineClient(EngineClient):
    """`responder(request)` gives each submitted request its script."""

    def __init__(self, responder: Callable[[GenerationRequest], Script] | None = None):
        self.responder = responder or (lambda request: [])
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.closed: list[str] = []
        self.ready = True
        self.unavailable = False
        self.checkpoints: dict[str, list[int]] = {}  # what read_checkpoint answers, by request id
        self.default_checkpoint: list[int] = []  # ... for ids not in `checkpoints`

    async def submit(self, request: GenerationRequest) -> EventStream:
        if self.unavailable:
            raise EngineUnavailable("cannot enqueue the request in Redis: connection refused")
        self.submitted.append(request)
        return FakeEventStream(self.responder(request),
                               lambda: self.closed.append(request.req_id))

    async def cancel(self, req_id: str) -> None:
        self.cancelled.append(req_id)

    async def is_ready(self) -> bool:
        return self.ready

    async def read_checkpoint(self, req_id: str) -> list[int]:
        return list(self.checkpoints.get(req_id, self.default_checkpoint))


def token_events(token_ids: list[int], *, prompt_tokens: int, attempt: int = 0, per_event: int = 1,
                 finish_reason: str = "stop", cached_tokens: int = 0, start: int = 0,
                 logprobs: bool = False) -> list[TokenEvent]:
    """Events carrying `token_ids` a few at a time, the last one final with usage."""
    from kvfleet.shared.wire import TokenLogprob

    events = []
    for i in range(0, len(token_ids), per_event):
        chunk = token_ids[i:i + per_event]
        lps = ([TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.5)]) for t in chunk]
               if logprobs else None)
        events.append(TokenEvent(seq=start + i, attempt=attempt, token_ids=chunk, logprobs=lps))
    final_usage = Usage(prompt_tokens, start + len(token_ids), cached_tokens)
    if events:
        events[-1].finish_reason = finish_reason
        events[-1].usage = final_usage
    else:
        events.append(TokenEvent(seq=start, attempt=attempt, finish_reason=finish_reason,
                                 usage=final_usage))
    return events


def worker_events(request: GenerationRequest, token_ids: list[int], tokenizer,
                  **options) -> list[TokenEvent]:
    """The events a worker sends for an answer that would run to `token_ids`: cut where the
    worker's own StopChecker stops it (stop strings on the text as the request shows it, stop ids,
    EOS, min_tokens), with what stopped it in the final event, as the worker reports it. A
    scripted end other than "stop" (`finish_reason="length"`) is played as it is."""
    from kvfleet.worker.engine.core.stopping import StopChecker

    if options.get("finish_reason", "stop") != "stop":
        return token_events(token_ids, prompt_tokens=len(request.prompt_token_ids), **options)

    checker = StopChecker([tokenizer.eos_token_id], max_model_len=1 << 30, tokenizer=tokenizer)
    stop = None
    for n in range(1, len(token_ids) + 1):
        stop = checker.find_stop(token_ids[:n], request.params)
        if stop is not None:
            token_ids = token_ids[:n]
            break
    if stop is not None:
        options["finish_reason"] = "stop"
    events = token_events(token_ids, prompt_tokens=len(request.prompt_token_ids), **options)
    if events[-1].finish_reason == "stop":  # a worker that decides stops says so every time
        events[-1].stop_reason = stop.reason if stop else None
        events[-1].text_after_stop = stop.text_after if stop else 0
    return events
