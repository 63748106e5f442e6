"""Runs the model: one flattened forward per step over every scheduled token, logits only where a
token is sampled (and at the prompt positions of requests that asked for prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from worker.engine.attention import (
    CONTEXT_KWARG, AttentionContext, DecodeGroup, PrefillChunk, register_paged_attention)
from worker.engine import cpu_attention
from worker.engine.cpu_attention import CpuDecodePlan, CpuPrefillPlan
from worker.engine.kv_cache import KVCachePool
from worker.engine.scheduler import ScheduledChunk, SchedulerOutput
from worker.engine.sequence import Sequence
from worker.engine.triton_attention import build_plan, queries_per_tile


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

    emitting: list[ScheduledChunk]  # the K chunks that sample a token, in logits row order
    logits: torch.Tensor  # [K, vocab]
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

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    """Everything a forward needs, in plain lists: what rank 0 sends the other tensor-parallel
    ranks each step. Chunks in forward order: decodes by context length, then prefill chunks."""

    chunks: list[PlannedChunk]
    token_ids: list[int]  # every chunk's tokens, concatenated in chunk order


@dataclass
class StepRows:
    """Rank 0's side of a plan: which logits rows belong to whom."""

    emitting: list[ScheduledChunk]  # the K chunks that sample a token, in logits row order
    prompt_spans: list[PromptSpan]  # the P prompt rows after them
    prompt_indices: list[int]  # their flattened positions


def plan_step(sched: SchedulerOutput, block_size: int) -> tuple[StepPlan, StepRows]:
    """Flatten a step: decoding chunks first (sorted by context length), then prefill chunks."""
    decodes = sorted((c for c in sched.chunks if c.num_tokens == 1), key=lambda c: c.end)
    prefills = [c for c in sched.chunks if c.num_tokens > 1]
    chunks, token_ids = [], []
    rows = StepRows([], [], [])
    for c in decodes + prefills:
        base = len(token_ids)  # flattened index of position c.start
        chunks.append(PlannedChunk(c.start, c.num_tokens, c.block_table[:-(-c.end // block_size)],
                                   c.emits_token))
        token_ids.extend(c.seq.token_ids[c.start:c.end])
        if c.emits_token:
            rows.emitting.append(c)
        span = _prompt_span(c, len(rows.prompt_indices))
        if span is not None:
            first = base + span.first_position - c.start
            rows.prompt_indices.extend(range(first, first + span.num_rows))
            rows.prompt_spans.append(span)
    return StepPlan(chunks, token_ids), rows


@dataclass
class StepInputs:
    """The flattened batch of one step (decoding chunks first, then prefill chunks)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    logits_indices: torch.Tensor  # [K] int64: flattened positions of the emitting chunks' rows
    context: AttentionContext


class ModelRunner:
    """Owns the model and the KV pool; turns a SchedulerOutput into logits.

    `model` is the engine's prepared copy (model_prep.py: sharded, placed, fused and packed
    there); the runner installs its paged attention on it and changes nothing else."""

    def __init__(self, model: torch.nn.Module, pool: KVCachePool, decode_group_cost_tokens: int = 512,
                 attention_backend: str = "sdpa", decode_graphs=None, num_heads: int | None = None):
        self.model = model
        # query heads this runner's attention computes (a tensor-parallel rank's share)
        self.num_heads = num_heads or model.config.num_attention_heads
        # "sdpa" (gather + SDPA) | "cpu" (C++ decode kernel, SDPA prefill) | "triton" (paged kernel)
        self.attention_backend = attention_backend
        # cuda_graphs.DecodeGraphs or None: decode-only steps run from its static buffers
        self.decode_graphs = decode_graphs
        self.pool = pool
        self.block_size = pool.block_size
        # a decode group costs about as much as gathering this many padded tokens (call overhead)
        self.decode_group_cost_tokens = decode_group_cost_tokens
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.dtype = dtype  # attention masks are built additive in it (see _additive)
        # the CPU kernel reads plain K/V in the model's dtype; other formats keep gather + SDPA
        self.cpu_decode_kernel = (attention_backend == "cpu" and cpu_attention.supports(pool, dtype))
        # and prefill chunks through the C++ prefill kernel where it computes them (AVX-512;
        # bf16 with AVX512-BF16): no dense copy of cached prefixes, and SDPA's bf16 products run
        # as converted fp32 sgemm on CPUs without AMX
        self.cpu_prefill_kernel = (self.cpu_decode_kernel and cpu_attention.prefill_supported(
            pool, dtype, pool.layout.head_dim))
        num_kv_heads = pool.layout.num_kv_heads
        self._group_size = self.num_heads // num_kv_heads  # query heads per KV head
        # row offsets of K (then V) of each KV head in the pool's [2 * KVH * NB, ...] block view
        self._head_block_rows = (torch.arange(2 * num_kv_heads) * pool.num_blocks).unsqueeze(1)
        self._head_slot_rows = (torch.arange(num_kv_heads) * pool.num_blocks * pool.block_size).unsqueeze(1)
        model.set_attn_implementation(register_paged_attention())
        model.eval()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepLogits:
        """Forward the step: the emitting chunks' logits [K, vocab], and the prompt logits."""
        if (self.decode_graphs is not None and self.decode_graphs.can_run(sched.chunks)
                and not any(c.seq.wants_prompt_logprobs for c in sched.chunks)):
            return StepLogits(*self.decode_graphs.run(sched.chunks))
        plan, rows = plan_step(sched, self.block_size)
        logits = self.forward(plan, rows.prompt_indices)  # [K + P, vocab]
        k = len(rows.emitting)
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
        output = self.model(
            input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False,
            logits_to_keep=keep if keep_logits else keep[:0], **{CONTEXT_KWARG: inputs.context})
        return output.logits[0]

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Build every index and mask the layers share (decodes grouped by context length)."""
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
            if chunk.emits_token:
                logits_indices.append(num_tokens - 1)
        write_index = (self._head_slot_rows + torch.tensor(slots, dtype=torch.int64)).view(-1)
        write_index = write_index.to(self.device, non_blocking=True)
        if self.attention_backend == "triton":
            context = AttentionContext(self.pool, write_index,
                                       kernel_plan=self._kernel_plan(decodes, prefills))
        elif self.cpu_prefill_kernel:
            context = AttentionContext(
                pool=self.pool, write_index=write_index, cpu_decode=self._cpu_decode_plan(decodes),
                cpu_prefill=self._cpu_prefill_plan(prefills, q_start=len(decodes)), cpu_kernel=True)
        elif self.cpu_decode_kernel:
            context = AttentionContext(
                pool=self.pool, write_index=write_index, cpu_decode=self._cpu_decode_plan(decodes),
                prefills=self._prefill_chunks(prefills, q_start=len(decodes)), cpu_kernel=True)
        else:
            context = AttentionContext(
                pool=self.pool, write_index=write_index,
                decode_groups=self._decode_groups(decodes),
                prefills=self._prefill_chunks(prefills, q_start=len(decodes)))
        return StepInputs(
            input_ids=self._tensor(plan.token_ids).unsqueeze(0),
            position_ids=self._tensor(positions).unsqueeze(0),
            logits_indices=self._tensor(logits_indices), context=context)

    def _kernel_plan(self, decodes: list[PlannedChunk], prefills: list[PlannedChunk]):
        """The Triton kernel's metadata: every chunk in flattened order, its blocks so far."""
        chunks = decodes + prefills
        bs = self.block_size
        block_q = queries_per_tile(self.num_heads, self.pool.layout.num_kv_heads,
                                   has_prefill=bool(prefills))
        return build_plan([c.num_tokens for c in chunks], [c.end for c in chunks],
                          [c.block_table[:-(-c.end // bs)] for c in chunks], block_q, self.device)

    def _padded_tables(self, chunks: list[PlannedChunk]) -> torch.Tensor:
        """[len(chunks), width] int32: each chunk's pages up to its last key, padded with its
        first page to the longest."""
        bs = self.block_size
        width = max(-(-c.end // bs) for c in chunks)
        rows = [c.block_table[:width] for c in chunks]
        return torch.tensor([row + [c.block_table[0]] * (width - len(row))
                             for c, row in zip(chunks, rows)], dtype=torch.int32)

    def _cpu_decode_plan(self, decodes: list[PlannedChunk]) -> CpuDecodePlan | None:
        """Every decode's block table and context length."""
        if not decodes:
            return None
        return CpuDecodePlan(len(decodes), self._padded_tables(decodes),
                             torch.tensor([c.end for c in decodes], dtype=torch.int32))

    def _cpu_prefill_plan(self, prefills: list[PlannedChunk], q_start: int) -> CpuPrefillPlan | None:
        """Every prefill chunk's block table, rows and keys."""
        if not prefills:
            return None
        lens = [c.num_tokens for c in prefills]
        starts = list(accumulate(lens[:-1], initial=q_start))
        return CpuPrefillPlan(self._padded_tables(prefills),
                              torch.tensor(starts, dtype=torch.int32),
                              torch.tensor(lens, dtype=torch.int32),
                              torch.tensor([c.end for c in prefills], dtype=torch.int32))

    def _decode_groups(self, decodes: list[PlannedChunk]) -> list[DecodeGroup]:
        """Split the decodes (sorted by length) where that saves more padding than a call costs."""
        bs = self.block_size
        num_blocks = [-(-c.end // bs) for c in decodes]
        groups, q_start = [], 0
        for first, last in split_sorted(num_blocks, self.decode_group_cost_tokens // bs):
            members = decodes[first:last + 1]
            width = num_blocks[last]  # blocks per sequence after padding
            blocks: list[int] = []
            for chunk, used in zip(members, num_blocks[first:last + 1]):
                blocks.extend(chunk.block_table[:used])
                blocks.extend([chunk.block_table[0]] * (width - used))  # padding, masked out
            length = width * bs
            lengths = torch.tensor([c.end for c in members], dtype=torch.int64)
            mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
            groups.append(DecodeGroup(
                q_start=q_start, num_seqs=len(members), context_len=length,
                gather_index=self._gather_index(blocks),
                mask=self._additive(mask.view(1, len(members), 1, length))))
            q_start += len(members)
        return groups

    def _prefill_chunks(self, prefills: list[PlannedChunk], q_start: int) -> list[PrefillChunk]:
        bs = self.block_size
        result = []
        for chunk in prefills:
            q_end = q_start + chunk.num_tokens
            if chunk.start == 0:
                result.append(PrefillChunk(q_start, q_end, chunk.end, None, None))
            else:
                query_pos = torch.arange(chunk.start, chunk.end).unsqueeze(1)  # [n, 1]
                mask = torch.arange(chunk.end).unsqueeze(0) <= query_pos  # [n, ctx]
                mask = mask.repeat(self._group_size, 1)  # [n_rep * n, ctx]: per packed head
                blocks = chunk.block_table[:-(-chunk.end // bs)]
                result.append(PrefillChunk(q_start, q_end, chunk.end, self._gather_index(blocks),
                                           self._additive(mask)))
            q_start = q_end
        return result

    def _additive(self, keep: torch.Tensor) -> torch.Tensor:
        """A bool mask (True where a key takes part) as SDPA's additive mask in the model's dtype:
        0 or -inf. SDPA converts a bool mask to exactly this on every call; built once a step,
        every layer reuses it."""
        mask = torch.zeros(keep.shape, dtype=self.dtype).masked_fill_(~keep, float("-inf"))
        return mask.to(self.device, non_blocking=True)

    def _gather_index(self, blocks: list[int]) -> torch.Tensor:
        """Rows of K then V of every KV head for `blocks`: [2 * KVH * len(blocks)]."""
        rows = self._head_block_rows + torch.tensor(blocks, dtype=torch.int64)
        return rows.view(-1).to(self.device, non_blocking=True)

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


def split_sorted(sizes: list[int], group_cost: int) -> list[tuple[int, int]]:
    """Split ascending `sizes` into runs [first, last] minimising padded total + cost per run.

    A run is padded to its last (largest) size: cost(run) = sizes[last] * len(run) + group_cost.
    O(n^2) dynamic programme; n is at most the running group.
    """
    n = len(sizes)
    if n == 0:
        return []
    best = [0] + [None] * n  # best[i]: cheapest split of sizes[:i]
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            cost = best[start] + sizes[end - 1] * (end - start) + group_cost
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], n
    while end > 0:
        runs.append((cut[end], end - 1))
        end = cut[end]
    return runs[::-1]
