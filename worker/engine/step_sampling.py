"""From a forward's logits to tokens: the batch sampled at once (under its requests' grammar
masks), row by row when that fails so that only the culprits fail; the prompt logprobs appended
to their sequences; the grammars moved past the new tokens."""

from __future__ import annotations

import logging

import torch

from shared.wire import TokenLogprob
from worker.engine.device import DeviceFailure, is_sticky_device_error
from worker.engine.model_runner import StepLogits
from worker.engine.prompt_logprobs import compute_prompt_logprobs
from worker.engine.sampler import Sampler, SamplerInput
from worker.engine.scheduler import ScheduledChunk, TokenEmission
from worker.engine.sequence import Sequence
from worker.structured.requests import ConstrainedRequests

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
                logits: torch.Tensor) -> tuple[dict[str, Sample], Failures]:
    """Sample every emitting row ([K, vocab] logits); if the batch fails, row by row."""
    inputs = [SamplerInput(c.seq.params, c.seq.prompt_token_ids, c.seq.output_token_ids)
              for c in emitting]
    try:
        mask = constrained.mask([c.seq.req_id for c in emitting])
        results = sampler.sample(logits, inputs, mask)
        return {c.seq.req_id: r for c, r in zip(emitting, results)}, []
    except Exception as exc:
        raise_if_sticky(exc)
        log.exception("sampling failed for a batch of %d; retrying row by row", len(inputs))
    samples, failed = {}, []
    for i, chunk in enumerate(emitting):
        try:
            mask = constrained.mask([chunk.seq.req_id])
            samples[chunk.seq.req_id] = sampler.sample(logits[i:i + 1], inputs[i:i + 1], mask)[0]
        except Exception as exc:
            raise_if_sticky(exc)
            failed.append((chunk.seq, exc))
    return samples, failed


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
    """Move each constrained request's grammar past its new token; a token the grammar refuses
    (it cannot be sampled: the mask forbids it) fails the request."""
    if not len(constrained):
        return []
    failed = []
    for emission in emissions:
        req_id = emission.seq.req_id
        if emission.token_id is not None and not emission.finished:
            try:
                constrained.advance(req_id, emission.token_id)
            except ValueError as exc:
                failed.append((emission.seq, exc))
        if emission.finished:
            constrained.discard(req_id)
    return failed
