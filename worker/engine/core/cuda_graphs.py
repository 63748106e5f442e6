"""Decode steps replayed from CUDA graphs: one graph per (batch-size, proposals) bucket, captured
over static input buffers, so a small-batch step costs one replay instead of thousands of kernel
launches.

Every input of a decode step lives in a buffer allocated once (token ids, positions, the slot each
new K/V goes to, context lengths, block tables); a step copies its values into the first rows and
replays the graph of the smallest bucket that holds it. With speculative decoding a stream's step
is its last token and up to k proposals: bucket (n, k) gives each of n streams k + 1 query rows
(k = 0: plain decode), a stream with fewer proposals fills the rest with padding rows. Padding
rows (and padding streams up to n) write only a scratch block that the block manager never hands
out, and sit at positions after the stream's real rows, which a real row never attends to; their
logits are dropped. Attention is the Triton paged kernel, whose launch depends only on the bucket
(grid = tiles x KV heads; loop bounds are read from the context-length buffer on the device).

Mode "eager" runs the same static-buffer path without capturing: that is how CPU tests check it
gives the same tokens as the ordinary path.
"""

from __future__ import annotations

import torch

from kvfleet.worker.engine.attention import CONTEXT_KWARG
from kvfleet.worker.engine.attention.triton_backend import TritonBackend, TritonMetadata
from kvfleet.worker.engine.memory.kv_cache import KVCachePool
from kvfleet.worker.engine.core.scheduler import ScheduledChunk
from kvfleet.worker.engine.kernels.triton_attention import PagedAttentionPlan, queries_per_tile

CUDA_GRAPH_MODES = ("auto", "off", "eager")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including max_batch."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def proposal_buckets(max_proposals: int) -> list[int]:
    """0 (plain decode), then 1, 2, 4, ... up to and including max_proposals."""
    powers = [1 << i for i in range(max_proposals.bit_length()) if 1 << i < max_proposals]
    return [0] + sorted(set(powers + [max_proposals])) if max_proposals else [0]


class DecodeGraphs:
    """Static buffers for decode steps of up to `max_batch` sequences, each verifying up to
    `max_proposals` proposed tokens, and their graphs."""

    def __init__(self, model: torch.nn.Module, pool: KVCachePool, scratch_block: int,
                 max_batch: int, max_model_len: int, max_proposals: int = 0):
        self.model = model
        self.pool = pool
        self.scratch_block = scratch_block
        self.buckets = batch_buckets(max_batch)
        self.proposal_buckets = proposal_buckets(max_proposals)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # decode steps run by replaying a captured graph (the metric's count)
        # [rows, vocab], written by replays
        self._graph_logits: dict[tuple[int, int], torch.Tensor] = {}
        device, bs = pool.device, pool.block_size
        size, max_blocks = self.buckets[-1], -(-max_model_len // bs)
        max_rows = size * (1 + self.proposal_buckets[-1])

        def static(*shape, dtype=torch.int32, fill=0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = static(1, max_rows, dtype=torch.int64)
        self.positions = static(1, max_rows, dtype=torch.int64)
        self.slots = static(max_rows, dtype=torch.int64)  # slot of each row's new K/V
        self.ctx_len = static(size, fill=1)
        self.block_tables = static(size, max_blocks, fill=scratch_block)
        num_kv_heads = pool.layout.num_kv_heads
        self._head_slot_rows = (torch.arange(num_kv_heads, device=device)
                                * pool.num_blocks * bs).unsqueeze(1)  # [KVH, 1]
        self._block_q = queries_per_tile(model.config.num_attention_heads, num_kv_heads,
                                         has_prefill=False)
        # per proposals bucket k, for `size` streams of k + 1 rows: constant, sliced per bucket
        self._layout = {k: self._query_layout(size, k, device) for k in self.proposal_buckets}
        self._backend = TritonBackend()  # the metadata's: the paged kernel takes every row

    def _query_layout(self, size: int, k: int, device: torch.device) -> dict[str, torch.Tensor]:
        """q_start, q_len, and the tiles (stream, first query) of `size` streams of k + 1 rows."""
        rows = k + 1
        tiles = [(s, q0) for s in range(size) for q0 in range(0, rows, self._block_q)]
        return {"q_start": torch.arange(0, size * rows, rows, dtype=torch.int32, device=device),
                "q_len": torch.full((size,), rows, dtype=torch.int32, device=device),
                "tile_seq": torch.tensor([t[0] for t in tiles], dtype=torch.int32, device=device),
                "tile_q0": torch.tensor([t[1] for t in tiles], dtype=torch.int32, device=device)}

    def bucket(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """The smallest (streams, proposals) bucket that holds a decode-only step; None for a
        step with a prefill chunk or beyond the largest bucket."""
        if not chunks or any(c.num_tokens - len(c.draft) != 1 for c in chunks):
            return None
        proposals = max(len(c.draft) for c in chunks)
        size = next((b for b in self.buckets if b >= len(chunks)), None)
        k = next((b for b in self.proposal_buckets if b >= proposals), None)
        return None if size is None or k is None else (size, k)

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        return self.bucket(chunks) is not None

    def run(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Forward one decode-only step; (emitting chunks, their logits [K, vocab]: each
        chunk's `num_logits` rows)."""
        key = self.bucket(chunks)
        self._fill(chunks, *key)
        if key in self.graphs:
            self.graphs[key].replay()
            self.num_replays += 1
            logits = self._graph_logits[key]
        else:
            logits = self._forward(*key)
        rows_per_stream = key[1] + 1
        emitting = [c for c in chunks if c.emits_token]
        rows = [i * rows_per_stream + j for i, c in enumerate(chunks) for j in range(c.num_logits)]
        if rows_per_stream == 1 and len(emitting) == len(chunks):
            return emitting, logits[:len(chunks)]
        return emitting, logits.index_select(0, torch.tensor(rows, device=logits.device))

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its memory pool)."""
        memory_pool = torch.cuda.graph_pool_handle()
        keys = sorted(((size, k) for size in self.buckets for k in self.proposal_buckets),
                      key=lambda key: key[0] * (key[1] + 1), reverse=True)
        for size, k in keys:
            self._fill([], size, k)
            self._forward(size, k)  # warm-up: compiles kernels, fills caches outside the capture
            torch.cuda.synchronize(self.pool.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool):
                self._graph_logits[(size, k)] = self._forward(size, k)
            self.graphs[(size, k)] = graph

    @torch.inference_mode()
    def _forward(self, size: int, k: int) -> torch.Tensor:
        """The captured body: reads only the static buffers; logits [size x (k + 1), vocab]."""
        rows = size * (k + 1)
        layout = self._layout[k]
        num_tiles = size * -(-(k + 1) // self._block_q)
        write_index = (self._head_slot_rows + self.slots[:rows]).view(-1)  # [KVH * rows]
        plan = PagedAttentionPlan(
            q_start=layout["q_start"][:size], q_len=layout["q_len"][:size],
            ctx_len=self.ctx_len[:size], block_tables=self.block_tables[:size],
            tile_seq=layout["tile_seq"][:num_tiles], tile_q0=layout["tile_q0"][:num_tiles],
            block_q=self._block_q)
        context = TritonMetadata(self._backend, self.pool, write_index, plan)
        output = self.model(
            input_ids=self.input_ids[:, :rows], position_ids=self.positions[:, :rows],
            use_cache=False, logits_to_keep=0, **{CONTEXT_KWARG: context})
        return output.logits[0]

    def _fill(self, chunks: list[ScheduledChunk], size: int, k: int) -> None:
        """Copy the step's rows into the static buffers: each stream's last token and proposals,
        then padding rows up to k + 1 a stream, then padding streams up to `size`."""
        bs, rows_per_stream = self.pool.block_size, k + 1
        scratch_slot = self.scratch_block * bs
        ids, positions, slots, ctx, tables = [], [], [], [], []
        width = max([-(-(c.start + rows_per_stream) // bs) for c in chunks], default=1)
        for c in chunks:
            tokens = c.token_ids
            for j in range(rows_per_stream):
                position = c.start + j
                real = j < len(tokens)
                ids.append(tokens[j] if real else 0)
                positions.append(position)
                slots.append(c.block_table[position // bs] * bs + position % bs if real
                             else scratch_slot)
            ctx.append(c.start + rows_per_stream)
            table = c.block_table[:width]
            tables.append(table + [self.scratch_block] * (width - len(table)))
        padding = size - len(chunks)
        ids += [0] * (padding * rows_per_stream)
        positions += list(range(rows_per_stream)) * padding
        slots += [scratch_slot] * (padding * rows_per_stream)
        ctx += [rows_per_stream] * padding
        tables += [[self.scratch_block] * width] * padding
        device, rows = self.pool.device, size * rows_per_stream

        def put(buffer: torch.Tensor, values) -> None:
            buffer.copy_(torch.tensor(values, dtype=buffer.dtype).to(device, non_blocking=True))

        put(self.input_ids[0, :rows], ids)
        put(self.positions[0, :rows], positions)
        put(self.slots[:rows], slots)
        put(self.ctx_len[:size], ctx)
        put(self.block_tables[:size, :width], tables)
