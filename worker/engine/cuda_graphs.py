"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured over static
input buffers, so a small-batch step costs one replay instead of thousands of kernel launches.

Every input of a decode step lives in a buffer allocated once (token ids, positions, the slot each
new K/V goes to, context lengths, block tables); a step copies its values into the first n rows
and replays the graph of the smallest bucket >= n. The rows from n to the bucket are padding: they
read and write only a scratch block that the block manager never hands out, so they cannot touch
a sequence's cache, and their logits are dropped. Attention is the Triton paged kernel, whose
launch depends only on the bucket (grid = bucket x KV heads; loop bounds are read from the
context-length buffer on the device).

Mode "eager" runs the same static-buffer path without capturing: that is how CPU tests check it
gives the same tokens as the ordinary path.
"""

from __future__ import annotations

import torch

from worker.engine.attention import CONTEXT_KWARG
from worker.engine.attention.triton_backend import TritonBackend, TritonMetadata
from worker.engine.kv_cache import KVCachePool
from worker.engine.scheduler import ScheduledChunk
from worker.engine.triton_attention import PagedAttentionPlan, queries_per_tile

CUDA_GRAPH_MODES = ("auto", "off", "eager")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_batch."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Static buffers for decode-only steps of up to `max_batch` sequences, and their graphs."""

    def __init__(self, model: torch.nn.Module, pool: KVCachePool, scratch_block: int,
                 max_batch: int, max_model_len: int):
        self.model = model
        self.pool = pool
        self.scratch_block = scratch_block
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # decode steps run by replaying a captured graph (the metric's count)
        self._graph_logits: dict[int, torch.Tensor] = {}  # [bucket, vocab], written by replays
        device, bs = pool.device, pool.block_size
        size, max_blocks = self.buckets[-1], -(-max_model_len // bs)

        def static(*shape, dtype=torch.int32, fill=0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = static(1, size, dtype=torch.int64)
        self.positions = static(1, size, dtype=torch.int64)
        self.slots = static(size, dtype=torch.int64)  # slot of each row's new K/V
        self.ctx_len = static(size, fill=1)
        self.block_tables = static(size, max_blocks, fill=scratch_block)
        self.q_start = torch.arange(size, dtype=torch.int32, device=device)
        self.q_len = static(size, fill=1)
        self.tile_q0 = static(size)
        num_kv_heads = pool.layout.num_kv_heads
        self._head_slot_rows = (torch.arange(num_kv_heads, device=device)
                                * pool.num_blocks * bs).unsqueeze(1)  # [KVH, 1]
        self._block_q = queries_per_tile(model.config.num_attention_heads, num_kv_heads,
                                         has_prefill=False)
        self._backend = TritonBackend()  # the metadata's: the paged kernel takes every row

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        return 0 < len(chunks) <= self.buckets[-1] and all(c.num_tokens == 1 for c in chunks)

    def run(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Forward one decode-only step; (emitting chunks, their logits [K, vocab])."""
        size = next(b for b in self.buckets if b >= len(chunks))
        self._fill(chunks, size)
        if size in self.graphs:
            self.graphs[size].replay()
            self.num_replays += 1
            logits = self._graph_logits[size]
        else:
            logits = self._forward(size)
        rows = [i for i, c in enumerate(chunks) if c.emits_token]
        if len(rows) < len(chunks):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        else:
            logits = logits[:len(chunks)]
        return [chunks[i] for i in rows], logits

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its memory pool)."""
        memory_pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self._fill([], size)
            self._forward(size)  # warm-up: compiles kernels, fills caches outside the capture
            torch.cuda.synchronize(self.pool.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool):
                self._graph_logits[size] = self._forward(size)
            self.graphs[size] = graph

    @torch.inference_mode()
    def _forward(self, size: int) -> torch.Tensor:
        """The captured body: reads only the static buffers; logits [size, vocab]."""
        write_index = (self._head_slot_rows + self.slots[:size]).view(-1)  # [KVH * size]
        plan = PagedAttentionPlan(
            q_start=self.q_start[:size], q_len=self.q_len[:size], ctx_len=self.ctx_len[:size],
            block_tables=self.block_tables[:size], tile_seq=self.q_start[:size],
            tile_q0=self.tile_q0[:size], block_q=self._block_q)
        context = TritonMetadata(self._backend, self.pool, write_index, plan)
        output = self.model(
            input_ids=self.input_ids[:, :size], position_ids=self.positions[:, :size],
            use_cache=False, logits_to_keep=0, **{CONTEXT_KWARG: context})
        return output.logits[0]

    def _fill(self, chunks: list[ScheduledChunk], size: int) -> None:
        """Copy the step's rows into the static buffers; rows len(chunks)..size become padding."""
        bs, n = self.pool.block_size, len(chunks)
        padding = size - n
        scratch_slot = self.scratch_block * bs
        ids = [c.seq.token_ids[c.start] for c in chunks] + [0] * padding
        positions = [c.start for c in chunks] + [0] * padding
        slots = [c.block_table[c.start // bs] * bs + c.start % bs for c in chunks]
        ctx = [c.end for c in chunks] + [1] * padding
        width = max([-(-c.end // bs) for c in chunks], default=1)
        tables = [c.block_table[:width] + [self.scratch_block] * (width - len(c.block_table[:width]))
                  for c in chunks] + [[self.scratch_block] * width] * padding
        device = self.pool.device

        def put(buffer: torch.Tensor, values) -> None:
            buffer.copy_(torch.tensor(values, dtype=buffer.dtype).to(device, non_blocking=True))

        put(self.input_ids[0, :size], ids)
        put(self.positions[0, :size], positions)
        put(self.slots[:size], slots + [scratch_slot] * padding)
        put(self.ctx_len[:size], ctx)
        put(self.block_tables[:size, :width], tables)
