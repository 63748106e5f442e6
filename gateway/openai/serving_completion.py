"""POST /v1/completions: prompts (strings or token ids) in, text out, streamed or whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvfleet.gateway.dashboard.metrics import RequestTracker
from kvfleet.gateway.openai.fields import UNSUPPORTED_COMPLETIONS
from kvfleet.gateway.openai.prompt_logprobs import echo_logprobs, prompt_logprobs_of, vllm_prompt_logprobs
from kvfleet.gateway.openai.request_schemas import CompletionRequest
from kvfleet.gateway.openai.responses import CompletionChoice, CompletionLogprobs, CompletionResponse
from kvfleet.gateway.openai.serving import OpenAIServing, UsageTally, outcome_of, running_usage
from kvfleet.gateway.openai.sse_chunks import CompletionChunkEncoder
from kvfleet.gateway.output.choice_stream import ChoiceDelta, ChoiceStream
from kvfleet.gateway.output.merge import merge_choices
from kvfleet.shared.wire import TokenLogprob


class CompletionServing(OpenAIServing):

    endpoint = "completions"
    unsupported_fields = UNSUPPORTED_COMPLETIONS

    async def prompts(self, request: CompletionRequest) -> list[list[int]]:
        return await self.processor.completion_prompts_async(request.prompt)

    def _echoes(self, request: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Per choice, the prompt text that `echo` puts before the completion ("" without it)."""
        return [self.processor.decode(p) if request.echo else "" for p in prompts
                for _ in range(request.num_candidates())]

    async def _respond(self, request: CompletionRequest, choices: list[ChoiceStream],
                       prompts: list[list[int]], response_id: str, created: int,
                       tracker: RequestTracker, model: str) -> CompletionResponse:
        echoes = self._echoes(request, prompts)
        per_prompt = request.num_candidates()
        usage = UsageTally(per_prompt)
        out = []
        collected = await self.collect(choices, tracker)
        for index, deltas in enumerate(collected):  # every candidate is billed
            usage.add(index, deltas[-1].usage, deltas[-1].numerics)
        for index in best_candidates(collected, per_prompt, request.n):
            deltas = collected[index]
            final = deltas[-1]
            prompt = prompts[index // per_prompt]
            prompt_entries = prompt_logprobs_of(deltas)
            logprobs = None
            if request.echo_logprobs:
                logprobs, _ = echo_logprobs(self.processor, prompt_entries, prompt)
            elif request.logprobs is not None:
                logprobs = CompletionLogprobs()
            if logprobs is not None:
                self._add_logprobs(logprobs, deltas, len(echoes[index]))
            out.append(CompletionChoice(
                index=len(out), logprobs=logprobs, finish_reason=final.finish_reason,
                stop_reason=final.stop_reason,
                text=echoes[index] + "".join(d.text for d in deltas),
                prompt_logprobs=(vllm_prompt_logprobs(self.processor, prompt_entries, prompt)
                                 if request.prompt_logprobs is not None else None)))
        info = usage.info()
        reasons = [c.finish_reason for c in out]
        tracker.finish(outcome_of(reasons), info.prompt_tokens, info.completion_tokens, reasons)
        return CompletionResponse(id=response_id, created=created, model=model,
                                  choices=out, usage=info,
                                  system_fingerprint=usage.system_fingerprint())

    async def _stream(self, request: CompletionRequest, choices: list[ChoiceStream],
                      prompts: list[list[int]], response_id: str, created: int,
                      tracker: RequestTracker, model: str) -> AsyncIterator[bytes]:
        echoes = self._echoes(request, prompts)
        running = running_usage(request, prompts)
        frames = CompletionChunkEncoder(response_id, created, model,
                       running.info if running else None)
        usage = UsageTally(request.n)
        offsets = [len(echo) for echo in echoes]
        # echo with logprobs: the prompt's chunk waits for its logprobs (the first delta's)
        echo_pending = [bool(echo) and request.echo_logprobs for echo in echoes]
        finish_reasons: list[str | None] = []
        try:
            for index, echo in enumerate(echoes):
                if echo and not echo_pending[index]:
                    yield frames.text(index, echo)
            async for index, delta in merge_choices([aiter(c) for c in choices]):
                if echo_pending[index]:
                    echo_pending[index] = False
                    head, _ = echo_logprobs(self.processor, delta.prompt_logprobs,
                                            prompts[index // request.n])
                    yield frames.text(index, echoes[index], head)
                if delta.token_ids:
                    tracker.on_tokens(len(delta.token_ids))
                    if running is not None:
                        running.add(len(delta.token_ids))
                logprobs = None
                if request.logprobs is not None and delta.logprobs:
                    logprobs = CompletionLogprobs()
                    offsets[index] = self._add_logprobs(logprobs, [delta], offsets[index])
                if delta.text or logprobs is not None:
                    yield frames.text(index, delta.text, logprobs)
                if delta.finish_reason is not None:
                    usage.add(index, delta.usage, delta.numerics)
                    finish_reasons.append(delta.finish_reason)
                    yield frames.text(index, "", finish_reason=delta.finish_reason,
                                      stop_reason=delta.stop_reason, numerics=delta.numerics)
            info = usage.info()
            if request.include_usage:
                yield frames.usage(info, usage.system_fingerprint())
            tracker.finish(outcome_of(finish_reasons), info.prompt_tokens, info.completion_tokens,
                           finish_reasons)
        except Exception:
            tracker.finish("error")
            raise
        finally:
            tracker.finish("abort")  # no-op after a finish: only a client gone mid-stream

    def _add_logprobs(self, out: CompletionLogprobs, deltas: list[ChoiceDelta],
                      text_offset: int) -> int:
        """Append the deltas' token logprobs in the legacy shape; returns the next text offset."""
        for delta in deltas:
            for entry in delta.logprobs or []:
                token = self.processor.token_text(entry.token_id)
                out.tokens.append(token)
                out.token_logprobs.append(entry.logprob)
                out.top_logprobs.append(self._top(entry))
                out.text_offset.append(text_offset)
                text_offset += len(token)
        return text_offset

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top = {self.processor.token_text(token_id): logprob for token_id, logprob in entry.top}
        return top or {self.processor.token_text(entry.token_id): entry.logprob}


def best_candidates(candidates: list[list[ChoiceDelta]], per_prompt: int, n: int) -> list[int]:
    """Indices of the choices to return: per prompt, the n of its `per_prompt` candidates with
    the highest cumulative logprob (best first, as vLLM's best_of), or all of them in order."""
    if per_prompt == n:
        return list(range(len(candidates)))
    chosen = []
    for first in range(0, len(candidates), per_prompt):
        group = range(first, first + per_prompt)
        chosen += sorted(group, key=lambda i: -_cumulative_logprob(candidates[i]))[:n]
    return chosen


def _cumulative_logprob(deltas: list[ChoiceDelta]) -> float:
    return sum(entry.logprob for delta in deltas for entry in delta.logprobs or [])
