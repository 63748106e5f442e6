"""Runs the model: one flattened forward per step over every scheduled token, logits only where a
token is sampled (and at the prompt positions of requests that asked for prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvfleet.worker.engine.attention import (
    CONTEXT_KWARG, AttentionBackend, AttentionMetadata, StepGeometry, register_paged_attention)
from kvfleet.worker.engine.attention.sdpa_backend import SdpaBackend
from kvfleet.worker.engine.memory.kv_cache import KVCachePool
from kvfleet.worker.engine.core.scheduler import ScheduledChunk, SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence


@dataclass
class PromptSpan:
    """Prompt positions `[first_position, first_position + num_rows)` of `seq` whose logits (the
    distribution of the next prompt token) are rows `[row, row + num_rows)` of the step's
    prompt logits."""

    seq: Sequence
    first_position: int
    num_rows: int
    row: int


@dataclass
class StepLogits:
    """What one forward returns: the logits of the emitting chunks, and of prompt spans."""

    emitting: list[ScheduledChunk]  # the chunks that sample a token, in logits row order
    logits: torch.Tensor  # [K, vocab]: `num_logits` rows per emitting chunk (1 + its proposals)
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None  # [sum of the spans' num_rows, vocab]

    def __iter__(self):
        """`emitting, logits = runner.execute(...)` for callers that need no prompt logits."""
        return iter((self.emitting, self.logits))


@dataclass
class PlannedChunk:
    """Positions [start, start + num_tokens) of one sequence, as the forward sees them."""

    start: int
    num_tokens: int
    block_table: list[int]  # the blocks covering positions [0, end)
    emits_token: bool
    num_draft: int = 0  # its last tokens are proposals: each of their rows is verified too
    lora_slot: int = -1  # its rows take the adapter in this device slot; -1: the base model

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_logits(self) -> int:
        return 1 + self.num_draft if self.emits_token else 0


@dataclass
class StepPlan:
    """Everything a forward needs, in plain lists: what rank 0 sends the other tensor-parallel
    ranks each step. Chunks in forward order: decodes by context length, then prefill chunks."""

    chunks: list[PlannedChunk]
    token_ids: list[int]  # every chunk's tokens, concatenated in chunk order
    # (slot, adapter name, path): load these adapters into these slots before the forward
    lora_loads: list[tuple[int, str, str]] = field(default_factory=list)


@dataclass
class StepRows:
    """Rank 0's side of a plan: which logits rows belong to whom."""

    emitting: list[ScheduledChunk]  # the chunks that sample a token, in logits row order
    prompt_spans: list[PromptSpan]  # the P prompt rows after them
    prompt_indices: list[int]  # their flattened positions

    @property
    def num_logits(self) -> int:
        """K: the emitting chunks' logits rows, before the prompt rows."""
        return sum(c.num_logits for c in self.emitting)


def plan_step(sched: SchedulerOutput, block_size: int) -> tuple[StepPlan, StepRows]:
    """Flatten a step: decoding chunks first (sorted by context length), then prefill chunks."""
    decodes = sorted((c for c in sched.chunks if c.num_tokens == 1), key=lambda c: c.end)
    prefills = [c for c in sched.chunks if c.num_tokens > 1]
    chunks, token_ids = [], []
    rows = StepRows([], [], [])
    for c in decodes + prefills:
        base = len(token_ids)  # flattened index of position c.start
        chunks.append(PlannedChunk(c.start, c.num_tokens, c.block_table[:-(-c.end // block_size)],
                                   c.emits_token, len(c.draft), c.lora_slot))
        token_ids.extend(c.token_ids)
        if c.emits_token:
            rows.emitting.append(c)
        span = _prompt_span(c, len(rows.prompt_indices))
        if span is not None:
            first = base + span.first_position - c.start
            rows.prompt_indices.extend(range(first, first + span.num_rows))
            rows.prompt_spans.append(span)
    return StepPlan(chunks, token_ids, list(sched.lora_loads)), rows


class StepTerms(Protocol):
    """What adds per-row terms to a forward's linears (the engine's LoRA adapters,
    lora/manager.py): told each plan before its forward, and when it is over."""

    def start_step(self, plan: StepPlan) -> None: ...

    def end_step(self) -> None: ...


@dataclass
class StepInputs:
    """The flattened batch of one step (decoding chunks first, then prefill chunks)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    logits_indices: torch.Tensor  # [K] int64: flattened positions of the emitting chunks' rows
    context: AttentionMetadata  # the attention backend's, for every layer


class ModelRunner:
    """Owns the model and the KV pool; turns a SchedulerOutput into logits.

    `model` is the engine's prepared copy (model_prep.py: sharded, placed, fused and packed
    there); the runner installs its paged attention on it and changes nothing else."""

    def __init__(self, model: torch.nn.Module, pool: KVCachePool,
                 attention_backend: AttentionBackend | None = None, decode_graphs=None,
                 num_heads: int | None = None, lora: StepTerms | None = None):
        self.model = model
        # the engine's adapters (their terms are installed on `model`): told each step's plan
        self.lora = lora
        # query heads this runner's attention computes (a tensor-parallel rank's share)
        self.num_heads = num_heads or model.config.num_attention_heads
        # resolved once at start-up (attention.resolve_attention_backend); gather + SDPA if none
        self.attention_backend = attention_backend or SdpaBackend()
        # cuda_graphs.DecodeGraphs or None: decode-only steps run from its static buffers
        self.decode_graphs = decode_graphs
        self.pool = pool
        self.block_size = pool.block_size
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        self.geometry = StepGeometry.of(pool, self.num_heads, dtype)
        num_kv_heads = pool.layout.num_kv_heads
        self._head_slot_rows = (torch.arange(num_kv_heads) * pool.num_blocks * pool.block_size).unsqueeze(1)
        model.set_attn_implementation(register_paged_attention())
        model.eval()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepLogits:
        """Forward the step: the emitting chunks' logits [K, vocab], and the prompt logits."""
        # graphs were captured without adapter terms: a step with adapter rows runs eagerly
        if (self.decode_graphs is not None and self.decode_graphs.can_run(sched.chunks)
                and not any(c.seq.wants_prompt_logprobs or c.lora_slot >= 0
                            for c in sched.chunks)):
            return StepLogits(*self.decode_graphs.run(sched.chunks))
        plan, rows = plan_step(sched, self.block_size)
        logits = self.forward(plan, rows.prompt_indices)  # [K + P, vocab]
        k = rows.num_logits
        if not rows.prompt_spans:
            return StepLogits(rows.emitting, logits)
        return StepLogits(rows.emitting, logits[:k], rows.prompt_spans, logits[k:])

    @torch.inference_mode()
    def forward(self, plan: StepPlan, prompt_indices: list[int] = (),
                keep_logits: bool = True) -> torch.Tensor:
        """Run the plan; logits [K + P, vocab] of its emitting chunks, then of `prompt_indices`
        ([0, vocab] without `keep_logits`: a tensor-parallel rank other than 0 skips the LM
        head's rows)."""
        inputs = self.prepare(plan)
        keep = inputs.logits_indices
        if prompt_indices:
            keep = torch.cat([keep, self._tensor(list(prompt_indices))])
        if self.lora is not None:
            self.lora.start_step(plan)  # its adapters in their slots, its rows for the terms
        try:
            output = self.model(
                input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False,
                logits_to_keep=keep if keep_logits else keep[:0], **{CONTEXT_KWARG: inputs.context})
        finally:
            if self.lora is not None:
                self.lora.end_step()
        return output.logits[0]

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Build every index the layers share; the backend builds its own metadata."""
        decodes = [c for c in plan.chunks if c.num_tokens == 1]
        prefills = [c for c in plan.chunks if c.num_tokens > 1]
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        num_tokens = 0
        bs = self.block_size
        for chunk in plan.chunks:
            table = chunk.block_table
            for pos in range(chunk.start, chunk.end):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            num_tokens += chunk.num_tokens
            logits_indices.extend(range(num_tokens - chunk.num_logits, num_tokens))
        write_index = (self._head_slot_rows + torch.tensor(slots, dtype=torch.int64)).view(-1)
        write_index = write_index.to(self.geometry.device, non_blocking=True)
        context = self.attention_backend.build_metadata(self.geometry, write_index, decodes,
                                                        prefills)
        return StepInputs(
            input_ids=self._tensor(plan.token_ids).unsqueeze(0),
            position_ids=self._tensor(positions).unsqueeze(0),
            logits_indices=self._tensor(logits_indices), context=context)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)


def _prompt_span(chunk: ScheduledChunk, row: int) -> PromptSpan | None:
    """The chunk's prompt positions whose logits give a prompt token's logprob not yet computed:
    position p predicts prompt token p + 1, so p < num_prompt_tokens - 1."""
    seq = chunk.seq
    if not seq.wants_prompt_logprobs:
        return None
    first = max(chunk.start, len(seq.prompt_logprobs))
    end = min(chunk.end, seq.num_prompt_tokens - 1)
    if first >= end:
        return None
    return PromptSpan(seq, first, end - first, row)
