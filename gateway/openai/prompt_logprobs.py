"""The prompt tokens' logprobs (computed by the worker in prefill) in the two shapes clients read:
vLLM's `prompt_logprobs` field, and the head of OpenAI's legacy `logprobs` for `echo`."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.gateway.models.tokenization import PromptProcessor
from kvfleet.gateway.openai.responses import CompletionLogprobs, PromptLogprob, PromptLogprobs
from kvfleet.gateway.output.choice_stream import ChoiceDelta
from kvfleet.shared.wire import TokenLogprob


def prompt_logprobs_of(deltas: Sequence[ChoiceDelta]) -> list[TokenLogprob] | None:
    """The prompt logprobs one of a choice's deltas carries (None if none did)."""
    return next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)


def vllm_prompt_logprobs(processor: PromptProcessor, entries: list[TokenLogprob] | None,
                         prompt: list[int]) -> PromptLogprobs:
    """vLLM's shape: None for the first prompt token, then per token its own candidate and the
    top-N alternatives, by token id (a position the worker did not report reads None)."""
    out: PromptLogprobs = [None]
    by_position = list(entries or [])
    for position in range(1, len(prompt)):
        entry = by_position[position - 1] if position - 1 < len(by_position) else None
        if entry is None:
            out.append(None)
            continue
        candidates = {token_id: PromptLogprob(logprob=logprob, rank=rank + 1,
                                              decoded_token=processor.token_text(token_id))
                      for rank, (token_id, logprob) in enumerate(entry.top)}
        candidates[entry.token_id] = PromptLogprob(
            logprob=entry.logprob, rank=entry.rank,
            decoded_token=processor.token_text(entry.token_id))
        out.append(candidates)
    return out


def echo_logprobs(processor: PromptProcessor, entries: list[TokenLogprob] | None,
                  prompt: list[int]) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs of an echoed prompt: every prompt token, the first with no
    logprob (`null`), the others with theirs and their top alternatives (the token itself
    included, as vLLM does). Returns them and the text offset after the prompt."""
    out = CompletionLogprobs()
    by_position = list(entries or [])
    offset = 0
    for position, token_id in enumerate(prompt):
        token = processor.token_text(token_id)
        entry = by_position[position - 1] if 0 < position <= len(by_position) else None
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        top = {processor.token_text(t): logprob for t, logprob in entry.top}
        top.setdefault(token, entry.logprob)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append(top)
    return out, offset
