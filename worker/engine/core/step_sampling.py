"""From a forward's logits to tokens: the batch sampled at once (under its requests' grammar
masks), row by row when that fails so that only the culprits fail; the prompt logprobs appended
to their sequences; the grammars moved past the new tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC
from itertools import chain

import torch

from kvfleet.shared.wire import TokenLogprob
from kvfleet.worker.engine.memory.device import DeviceFailure, is_sticky_device_error
from kvfleet.worker.engine.core.model_runner import StepLogits
from kvfleet.worker.engine.core.prompt_logprobs import compute_prompt_logprobs
from kvfleet.worker.engine.core.sampler import Sampler, SamplerInput
from kvfleet.worker.engine.core.scheduler import ScheduledChunk, TokenEmission
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.structured.requests import ConstrainedRequests

log = logging.getLogger(__name__)

Failures = list[tuple[Sequence, Exception]]
Sample = tuple[int, TokenLogprob | None]  # token id, its logprob when asked for


def raise_if_sticky(error: Exception) -> None:
    """A device error that poisons every later step is not the requests' fault: leave them
    unfinished and let the worker exit (DeviceFailure), so they resume on another worker."""
    if is_sticky_device_error(error):
        log.critical("device failure: %s", error)
        raise DeviceFailure(f"{type(error).__name__}: {error}") from error


def sample_rows(sampler: Sampler, constrained: ConstrainedRequests, emitting: list[ScheduledChunk],
                logits: torch.Tensor) -> tuple[dict[str, list[Sample]], Failures]:
    """Each emitting chunk's new tokens from its logits rows ([K, vocab]: `num_logits` rows per
    chunk); if the batch fails, chunk by chunk, so that only the culprits fail."""
    try:
        results = _sample_chunks(sampler, constrained, emitting, logits)
        return {c.seq.req_id: r for c, r in zip(emitting, results)}, []
    except Exception as exc:
        raise_if_sticky(exc)
        log.exception("sampling failed for a batch of %d; retrying request by request",
                      len(emitting))
    samples, failed, row = {}, [], 0
    for chunk in emitting:
        rows = logits[row:row + chunk.num_logits]
        row += chunk.num_logits
        try:
            samples[chunk.seq.req_id] = _sample_chunks(sampler, constrained, [chunk], rows)[0]
        except Exception as exc:
            raise_if_sticky(exc)
            failed.append((chunk.seq, exc))
    return samples, failed


def _sample_chunks(sampler: Sampler, constrained: ConstrainedRequests,
                   chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[list[Sample]]:
    """Verification: row j of a chunk with proposals is sampled as plain decoding would sample
    the token after its first j proposals (same position, so the same seeded uniform; the same
    output so far, so the same penalties, min_tokens and grammar mask), and the proposals are
    accepted while each equals the token sampled before it. So the tokens are the ones plain
    decoding makes, token for token, greedy or sampled, given rows equal to plain decoding's
    (batch-invariant numerics, --deterministic). A chunk without proposals is one row."""
    inputs = []
    for c in chunks:
        seq = c.seq
        inputs += [SamplerInput(seq.params, seq.prompt_token_ids,
                                Continued(seq.output_token_ids, c.draft[:j]) if j else
                                seq.output_token_ids) for j in range(c.num_logits)]
    mask = constrained.mask_ahead([(c.seq.req_id, c.draft) for c in chunks])
    results = sampler.sample(logits, inputs, mask)
    accepted, row = [], 0
    for c in chunks:
        accepted.append(accept(c.draft, results[row:row + c.num_logits]))
        row += c.num_logits
    return accepted


def accept(proposals: list[int], rows: list[Sample]) -> list[Sample]:
    """The samples of a chunk's rows up to the first that differs from its proposal (kept: it
    is the token plain decoding makes there), or all of them when every proposal matched."""
    tokens = []
    for j, sample in enumerate(rows):
        tokens.append(sample)
        if j == len(proposals) or sample[0] != proposals[j]:
            break
    return tokens


class Continued(SequenceABC):
    """`tokens + extra` without copying `tokens`: the output as a row that verifies proposals
    sees it (as if they were accepted)."""

    def __init__(self, tokens: list[int], extra: list[int]):
        self._tokens, self._extra = tokens, extra

    def __len__(self) -> int:
        return len(self._tokens) + len(self._extra)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        n = len(self._tokens)
        return self._tokens[index] if index < n else self._extra[index - n]

    def __iter__(self):
        return chain(self._tokens, self._extra)


def record_prompt_logprobs(step: StepLogits) -> Failures:
    """Append the step's prompt logprobs to their sequences (positions in order: a chunk
    recomputed after a preemption adds none twice)."""
    if not step.prompt_spans:
        return []
    try:
        computed = compute_prompt_logprobs(step.prompt_spans, step.prompt_logits)
    except Exception as exc:
        raise_if_sticky(exc)
        log.exception("prompt logprobs failed for %d requests", len(step.prompt_spans))
        return [(span.seq, exc) for span in step.prompt_spans]
    for span, (seq, entries) in zip(step.prompt_spans, computed):
        if span.first_position != len(seq.prompt_logprobs):
            raise AssertionError(f"{seq.req_id}: prompt logprobs from position "
                                 f"{span.first_position}, {len(seq.prompt_logprobs)} held")
        seq.prompt_logprobs.extend(entries)
    return []


def advance_constrained(constrained: ConstrainedRequests, emissions: list[TokenEmission]) -> Failures:
    """Move each constrained request's grammar past its new tokens; a token the grammar refuses
    (it cannot be sampled: the mask forbids it) fails the request."""
    if not len(constrained):
        return []
    failed = []
    for emission in emissions:
        req_id = emission.seq.req_id
        if emission.token_ids and not emission.finished:
            try:
                constrained.advance(req_id, emission.token_ids)
            except ValueError as exc:
                failed.append((emission.seq, exc))
        if emission.finished:
            constrained.discard(req_id)
    return failed
