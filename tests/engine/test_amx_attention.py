"""Attention on AMX tiles (worker/engine/kernels/cpu_amx.cpp, "Attention on tiles"), the form of
every query row of a batch-invariant step on CPUs with AMX-BF16, checked on any x86 CPU through
the kernel's emulation build (the tile instructions replaced by their scalar model), and on an
AMX CPU the real tiles against that emulation bit for bit:
- a row's result depends on that row alone: a prompt computed in one chunk, in several, or row by
  row as decodes, beside other sequences or alone, on 1 or 2 threads, gives the same bits;
- it is attention: against a float64 reference of the same bf16 inputs, within bf16's rounding;
- the engine takes it in its default settings on such a CPU (the backend says so).
"""

from __future__ import annotations

import pytest
import torch

from kvfleet.shared.cpu_features import cpu_features
from kvfleet.worker.engine.kernels import cpu_kernels, cpu_linear
from kvfleet.worker.engine.kernels.kernel_binding import BoundKernel
from tests.engine.kernel_variants import build_variant

HAS_AMX = cpu_linear.AMX_FLAGS <= cpu_features().flags
HEADS, KV_HEADS, BLOCK = 6, 2, 16


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> BoundKernel:
    return build_variant("amx", tmp_path_factory.mktemp("amx_attention"), ("KVFLEET_AMX_EMULATE",))


class Sequences:
    """Random bf16 K/V of sequences of `lengths` tokens in a paged pool (pages in a shuffled
    order), their queries [H, T, D] (all tokens of all sequences, one after the other)."""

    def __init__(self, lengths: list[int], dim: int, seed: int, block: int = BLOCK):
        g = torch.Generator().manual_seed(seed)
        self.block = block
        pages = [-(-n // block) for n in lengths]
        self.num_blocks = sum(pages) + 3
        order = torch.randperm(self.num_blocks, generator=g).tolist()
        self.tables, at = [], 0
        for n in pages:
            self.tables.append(order[at:at + n])
            at += n
        self.width = max(pages)
        self.lengths, self.dim = lengths, dim
        self.kv = (torch.randn(2, KV_HEADS, self.num_blocks, block, dim, generator=g) * 2).to(torch.bfloat16)
        self.q = (torch.randn(HEADS, sum(lengths), dim, generator=g) * 2).to(torch.bfloat16)
        self.first = [sum(lengths[:i]) for i in range(len(lengths))]  # each one's first query row

    def run(self, kernel, chunks: list[tuple[int, int, int]], threads: int = 2) -> torch.Tensor:
        """chunks: (sequence, first token, tokens); -> out [rows, H, D] of the chunks' rows, in
        the order given (each chunk's queries gathered into one q as an engine step's)."""
        rows = [self.first[s] + i for s, a, n in chunks for i in range(a, a + n)]
        q = self.q[:, rows].contiguous()
        out = torch.zeros(len(rows), HEADS, self.dim, dtype=torch.bfloat16)
        tables = torch.tensor([self.tables[s] + [0] * (self.width - len(self.tables[s]))
                               for s, _, _ in chunks], dtype=torch.int32)
        q_lens = torch.tensor([n for _, _, n in chunks], dtype=torch.int32)
        q_starts = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
        ctx_ends = torch.tensor([a + n for _, a, n in chunks], dtype=torch.int32)
        status = kernel.kvfleet_amx_attention(
            q.data_ptr(), q.stride(0), q.stride(1), self.kv.data_ptr(), out.data_ptr(),
            tables.data_ptr(), self.width, q_starts.data_ptr(), q_lens.data_ptr(),
            ctx_ends.data_ptr(), len(chunks), HEADS, KV_HEADS, self.dim, self.num_blocks, self.block,
            self.dim ** -0.5, threads)
        assert status == 0
        return out

    def reference(self, s: int) -> torch.Tensor:
        """Causal attention of sequence s in float64 from the same bf16 values: [T, H, D]."""
        n, table = self.lengths[s], self.tables[s]
        pages = self.kv[:, :, table].reshape(2, KV_HEADS, -1, self.dim)[:, :, :n].double()
        k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=0) for x in pages)
        q = self.q[:, self.first[s]:self.first[s] + n].double()
        scores = q @ k.transpose(1, 2) * self.dim ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("dim, block", [(64, 16), (128, 16), (64, 24)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(emulated, dim, block):
    """A 70-token prompt (page boundaries, a partial 32-key tile) in one chunk, in three, row by
    row as decodes, and beside another sequence: the same bits. Pages of 16 keys are read in
    place, pages of 24 (no whole 16-key tiles) from a dense copy."""
    seqs = Sequences([70, 45], dim, seed=dim, block=block)
    whole = seqs.run(emulated, [(0, 0, 70)])
    assert torch.equal(seqs.run(emulated, [(0, 0, 20), (0, 20, 25), (0, 45, 25)]), whole)
    decodes = torch.cat([seqs.run(emulated, [(0, i, 1)], threads=1) for i in range(70)])
    assert torch.equal(decodes, whole)
    mixed = seqs.run(emulated, [(1, 44, 1), (0, 0, 70), (1, 0, 30)])  # a decode first, as a step
    assert torch.equal(mixed[1:71], whole)
    assert torch.equal(mixed[71:], seqs.run(emulated, [(1, 0, 30)]))


@pytest.mark.parametrize("dim, block", [(64, 16), (128, 16), (64, 24), (32, 64)])
def test_it_is_causal_attention_within_bf16s_rounding(emulated, dim, block):
    seqs = Sequences([70, 45], dim, seed=3 + dim, block=block)
    got = seqs.run(emulated, [(0, 0, 70), (1, 0, 45)]).double()
    want = torch.cat([seqs.reference(0), seqs.reference(1)])
    scale = want.abs().max()
    # the probabilities are rounded to bf16 (8 bits) before P.V and the output to bf16
    assert (got - want).abs().max() <= 2 ** -6 * scale
    # a negative control: a row given one key too many is further off than this tolerance
    shifted = torch.cat([seqs.reference(0)[1:], seqs.reference(0)[-1:]])
    assert (shifted - seqs.reference(0)).abs().max() > 2 ** -6 * scale


def test_shapes_it_does_not_compute_are_refused(emulated):
    seqs = Sequences([5], 64, seed=1)
    q = seqs.q.contiguous()
    out = torch.zeros(5, HEADS, 64, dtype=torch.bfloat16)
    table = torch.tensor([seqs.tables[0]], dtype=torch.int32)
    one = torch.tensor([0], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    args = (q.data_ptr(), q.stride(0), q.stride(1), seqs.kv.data_ptr(), out.data_ptr(),
            table.data_ptr(), 1, one[0].data_ptr(), one[1].data_ptr(), one[1].data_ptr(), 1)
    assert emulated.kvfleet_amx_attention(*args, HEADS, KV_HEADS, 48, seqs.num_blocks, BLOCK,
                                          0.1, 1) == 1  # head_dim 48: no whole tile
    assert emulated.kvfleet_amx_attention(*args, HEADS, 4, 64, seqs.num_blocks, BLOCK,
                                          0.1, 1) == 2  # 6 heads over 4 KV heads


@pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX-BF16 tiles (amx_tile, amx_bf16)")
def test_the_real_tiles_attend_as_the_emulation_does(emulated):
    amx = cpu_kernels.amx_kernel()
    for dim, block in ((64, 16), (128, 64), (64, 24)):
        seqs = Sequences([70, 45, 3], dim, seed=11 + dim, block=block)
        chunks = [(2, 2, 1), (0, 0, 70), (1, 10, 35)]
        for threads in (1, 2):
            assert torch.equal(seqs.run(amx, chunks, threads), seqs.run(emulated, chunks, threads))


def test_the_backend_takes_the_tiles_where_the_engine_is_invariant_on_amx():
    from kvfleet.worker.engine.attention.registry import resolve_attention_backend
    from kvfleet.worker.engine.memory.kv_format import resolve_kv_format
    fmt = resolve_kv_format("auto", torch.bfloat16)
    backend = resolve_attention_backend("auto", torch.device("cpu"), torch.bfloat16, fmt, 64,
                                        deterministic=True)
    assert backend.describe().endswith(
        "on AMX tiles: batch-invariant)" if cpu_linear.amx_tiles() is None
        else "16 rows at a time: batch-invariant)" if "avx512_bf16" in cpu_features().flags
        else "in the decode kernel: batch-invariant)")
    assert backend.prefill_rows is (cpu_linear.amx_tiles() is not None
                                    and "avx512_bf16" in cpu_features().flags)
    loose = resolve_attention_backend("auto", torch.device("cpu"), torch.bfloat16, fmt, 64,
                                      deterministic=False)
    assert "AMX" not in loose.describe()
