"""What the completion and chat handlers share: one GenerationRequest per choice (for the served
model or LoRA adapter the request named: its `Target`), submitting them, usage totals and the SSE
framing. One handler object per served model (gateway/models/loader.py): its processor is that
model's tokenizer and limits, an adapter's requests included."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvfleet.gateway.dashboard.metrics import GatewayMetrics, RequestTracker
from kvfleet.gateway.fleet.client import EngineClient, EngineError
from kvfleet.gateway.http.errors import bad_request, error_body, model_not_found
from kvfleet.gateway.http.tracing import RequestSpan
from kvfleet.gateway.models.catalog import Target
from kvfleet.gateway.models.tokenization import PromptProcessor
from kvfleet.gateway.openai.constraints import request_constraint
from kvfleet.gateway.openai.fields import check_extra_fields
from kvfleet.gateway.openai.request_schemas import MAX_CHOICES, SamplingRequest
from kvfleet.gateway.openai.responses import UsageInfo
from kvfleet.gateway.output.background import BackgroundTasks
from kvfleet.gateway.output.choice_stream import ChoiceDelta, ChoiceStream
from kvfleet.gateway.output.merge import merge_choices
from kvfleet.shared.wire import OutputConstraint
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import GenerationRequest, Usage

if TYPE_CHECKING:
    from kvfleet.gateway.admission.admission import Admission
    from kvfleet.gateway.admission.auth import Principal

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def sse_error(exc: Exception) -> bytes:
    """An error inside a stream that has already started (the status line is sent: 200)."""
    if isinstance(exc, EngineError):
        body = error_body(exc.message, exc.error_type, code=str(exc.status))
    else:
        log.exception("unexpected error while streaming", exc_info=exc)
        body = error_body(f"Internal error: {exc!r}", "server_error")
    return sse(json.dumps(body)).encode()


def wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


class UsageTally:
    """Usage of a response: each prompt counted once (its n choices share it), completions
    summed; and the numerics fingerprints its choices were computed on."""

    def __init__(self, n: int):
        self._n = n
        self._prompt: dict[int, Usage] = {}
        self._completion_tokens = 0
        self._numerics: list[str] = []  # in order of first appearance

    def add(self, index: int, usage: Usage, numerics: str | None = None) -> None:
        self._prompt.setdefault(index // self._n, usage)
        self._completion_tokens += usage.completion_tokens
        for fingerprint in (numerics or "").split("+"):
            if fingerprint and fingerprint not in self._numerics:
                self._numerics.append(fingerprint)

    def system_fingerprint(self) -> str | None:
        """OpenAI's `system_fingerprint`: the numerics fingerprint every token of the response
        was computed on; several joined by "+" where its tokens were computed on more than one
        (a stream resumed on other numerics, or choices served by workers of different
        numerics: such an answer may differ from one computed on either alone); None when no
        worker said (an older one)."""
        return "+".join(self._numerics) or None

    def info(self) -> UsageInfo:
        prompt = sum(u.prompt_tokens for u in self._prompt.values())
        cached = sum(u.cached_tokens for u in self._prompt.values())
        return UsageInfo.of(prompt, self._completion_tokens, cached)


class RunningUsage:
    """The usage of a stream so far (vLLM's `continuous_usage_stats`): every prompt once, the
    completion tokens every choice has streamed."""

    def __init__(self, prompts: list[list[int]]):
        self._prompt_tokens = sum(len(p) for p in prompts)
        self._completion_tokens = 0

    def add(self, num_tokens: int) -> None:
        self._completion_tokens += num_tokens

    def info(self) -> UsageInfo:
        return UsageInfo.of(self._prompt_tokens, self._completion_tokens, 0)


def running_usage(request: SamplingRequest, prompts: list[list[int]]) -> RunningUsage | None:
    return RunningUsage(prompts) if request.continuous_usage else None


class OpenAIServing:
    """Base of the handlers: talks to an EngineClient, never to Redis or HTTP objects."""

    def __init__(self, client: EngineClient, processor: PromptProcessor,
                 settings: GatewaySettings, background: BackgroundTasks,
                 metrics: GatewayMetrics, admission: Admission | None = None):
        self.client = client
        self.processor = processor
        self.settings = settings
        self.background = background
        self.metrics = metrics
        self.admission = admission

    @property
    def served_id(self) -> str:
        return self.processor.model.served_id

    @property
    def default_temperature(self) -> float:
        configured = self.settings.default_temperature
        return configured if configured is not None else self.processor.model.default_temperature

    endpoint = ""  # the metrics label of the route

    async def create(self, request: SamplingRequest, principal: Principal | None = None,
                     target: Target | None = None):
        """A whole response, or the SSE lines of a stream (for the route to send). `target`: what
        the request's `model` resolved to (this handler's model or one of its adapters); None:
        this handler's model, which the request must name.

        The steps every endpoint shares; a subclass says how it tokenises (`prompts`) and how it
        answers (`_respond`, `_stream`)."""
        target = target or self.own_target(request.model)
        tracker = self.metrics.track(self.endpoint, target.name)
        try:
            self.check_fields(request)
            constraint = self.constraint(request)
            prompts = await self.prompts(request)
            req_hex = self.client.new_request_hex("cmpl-")
            self._log_who(request, req_hex)
            requests = self.build_requests(req_hex, prompts, request, constraint, target)
            tracker.span = RequestSpan.current()  # tracing on: the middleware's span
            if tracker.span is not None:  # its context goes with every choice
                tracker.span.submitted(target.name, f"cmpl-{req_hex}", request.stream, requests)
            await self.admit(requests, principal)
            choices = await self.submit_all(requests)
            # The response id is the request id (`kvf:req:{id}` in Redis); the answer names the
            # model as the client did (an adapter's name for an adapter's request, as vLLM).
            reply = (request, choices, prompts, f"cmpl-{req_hex}", int(time.time()), tracker,
                     target.name)
            if request.stream:
                return stream_with_errors(self._stream(*reply))
            return await self._respond(*reply)
        except BaseException:
            tracker.discard()
            raise

    async def prompts(self, request: SamplingRequest) -> list[list[int]]:
        """The token ids of each prompt of the request."""
        raise NotImplementedError

    unsupported_fields: dict[str, str] = {}

    @staticmethod
    def _log_who(request: SamplingRequest, req_hex: str) -> None:
        """`user`, `safety_identifier` and `metadata` are for the operator: logged with the id."""
        who = {k: getattr(request, k, None) for k in ("user", "safety_identifier", "metadata")}
        who = {k: v for k, v in who.items() if v}
        if who:
            log.info("request cmpl-%s from %s", req_hex, who)

    def check_fields(self, request: SamplingRequest) -> None:
        """400 for an OpenAI field kvfleet does not implement; warn about unknown ones. Token ids
        are checked against the base model's vocabulary (an adapter's is the same)."""
        check_extra_fields(request.model_extra, self.unsupported_fields, self.endpoint)
        bad = next((t for t in request.token_bias() if t >= self.processor.model.vocab_size), None)
        if bad is not None:
            raise bad_request(f"`logit_bias`: token id {bad} is out of range: the model's "
                              f"vocabulary has {self.processor.model.vocab_size} tokens.",
                              param="logit_bias")

    def constraint(self, request: SamplingRequest) -> OutputConstraint | None:
        """The grammar every choice's output must follow (structured outputs), if any."""
        found = request_constraint(request)
        return found[1] if found else None

    async def _respond(self, request, choices: list[ChoiceStream], prompts: list[list[int]],
                       response_id: str, created: int, tracker: RequestTracker, model: str):
        raise NotImplementedError

    def _stream(self, request, choices: list[ChoiceStream], prompts: list[list[int]],
                response_id: str, created: int, tracker: RequestTracker,
                model: str) -> AsyncIterator[bytes]:
        raise NotImplementedError

    def own_target(self, model: str) -> Target:
        """This handler's own model as the target of a request naming `model`; 404 otherwise."""
        if model != self.served_id:
            raise model_not_found(model)
        return Target.of_model(model)

    def build_requests(self, req_hex: str, prompts: list[list[int]], request: SamplingRequest,
                       constraint: OutputConstraint | None = None,
                       target: Target | None = None) -> list[GenerationRequest]:
        """One GenerationRequest per choice: choice `p * n + i` is prompt p's i-th sample (with
        `best_of`, per prompt best_of candidates instead of n). An adapter's requests go to its
        base model's queues, naming the adapter and its directory for the worker."""
        target = target or Target.of_model(self.served_id)
        per_prompt = request.num_candidates()  # n, or best_of candidates to pick n from
        num_choices = len(prompts) * per_prompt
        if num_choices > MAX_CHOICES:
            name = "n" if per_prompt == request.n else "best_of"
            raise bad_request(f"{len(prompts)} prompts with {name}={per_prompt} make "
                              f"{num_choices} choices; at most {MAX_CHOICES} are allowed.",
                              param=name)
        base_seed = request.seed if request.seed is not None else random.getrandbits(63)
        now = time.time()
        requests = []
        for prompt_index, prompt_ids in enumerate(prompts):
            max_tokens = self.processor.resolve_max_tokens(
                len(prompt_ids), request.requested_max_tokens(), self.settings.default_max_tokens)
            for i in range(per_prompt):
                index = prompt_index * per_prompt + i
                req_id = f"cmpl-{req_hex}" if num_choices == 1 else f"cmpl-{req_hex}-{index}"
                params = request.to_sampling_params(max_tokens, wrap_int64(base_seed + index),
                                                    self.default_temperature, constraint)
                requests.append(GenerationRequest(
                    req_id=req_id, model=target.model, prompt_token_ids=prompt_ids,
                    params=params, deadline=now + self.settings.request_timeout_s,
                    priority=request.queue_priority, created=now, lora=target.lora,
                    lora_path=target.lora_path))
        return requests

    async def submit_all(self, requests: list[GenerationRequest]) -> list[ChoiceStream]:
        """Submit every choice before answering: Redis being down is a 503, not a broken stream."""
        choices: list[ChoiceStream] = []
        try:
            for request in requests:
                events = await self.client.submit(request)
                decoder = (self.processor.decoder if request.params.skip_special_tokens
                           else self.processor.decoder_with_special)
                choices.append(ChoiceStream(self.client, request, events,
                                            self.processor.tokenizer, self.background, decoder,
                                            eos_token_ids=self.processor.eos_token_ids))
        except BaseException:
            for choice in choices:
                await choice.close()
            raise
        return choices

    async def admit(self, requests: list[GenerationRequest], principal: Principal | None) -> None:
        """Rate limits and backpressure; raises APIError 429 when the request must wait."""
        if self.admission is not None:
            await self.admission.admit(requests, principal)

    async def collect(self, choices: list[ChoiceStream], tracker: RequestTracker
                      ) -> list[list[ChoiceDelta]]:
        """Every delta of every choice, by choice index (the non-streaming answer)."""
        deltas: list[list[ChoiceDelta]] = [[] for _ in choices]
        async for index, delta in merge_choices([aiter(c) for c in choices]):
            if delta.token_ids:
                tracker.on_tokens(len(delta.token_ids))
            deltas[index].append(delta)
        return deltas


def outcome_of(finish_reasons: list[str | None]) -> str:
    """One metrics outcome for n choices: `length` if any choice hit its limit, else `stop`."""
    return "length" if "length" in finish_reasons else "stop"


async def stream_with_errors(chunks: AsyncIterator[bytes | str]) -> AsyncIterator[bytes | str]:
    """SSE lines, an error event if the fleet failed mid-stream, and always `[DONE]` at the end."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
        yield sse_error(exc)
    yield SSE_DONE
