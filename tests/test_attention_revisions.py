"""benchmarks/attention_revisions.py: the step it times is a real decode step's attention (its
pages, contexts and bytes), and its shapes are parsed or refused."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from benchmarks.attention_revisions import Step, parse_shape
from kvfleet.worker.engine.kernels import cpu_attention


def test_shapes_are_parsed_and_bad_ones_refused():
    assert parse_shape("9x3x64") == (9, 3, 64)
    assert parse_shape("32X8x64") == (32, 8, 64)
    for bad in ("9x3", "9x0x64", "9x4x64", "axbxc", "9x3x64x1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_shape(bad)


def test_each_sequence_owns_its_pages_and_the_contexts_spread_around_the_mean():
    step = Step((4, 2, 32), streams=5, context=100, layers=2, dtype=torch.float32)
    assert step.ctx.tolist() == [50, 75, 100, 125, 150]
    used = []
    for seq, ctx in enumerate(step.ctx.tolist()):
        used += step.tables[seq, :-(-ctx // step.block_size)].tolist()
    assert len(used) == len(set(used)) and max(used) < step.num_blocks  # no page shared
    assert used != sorted(used)  # at random places, as in a pool that has served a while
    assert step.bytes == 500 * 2 * 32 * 2 * 4 * 2  # keys and values of every layer


def reference(step: Step, layer: int) -> torch.Tensor:
    """Layer `layer`'s attention by gathering each sequence's pages and SDPA."""
    heads, kv_heads, dim = step.shape
    pool, q = step.pools[layer], step.queries[layer]
    out = torch.empty(step.streams, heads, dim)
    for seq, ctx in enumerate(step.ctx.tolist()):
        pages = step.tables[seq, :-(-ctx // step.block_size)].long()
        k, v = (pool[i][:, pages].reshape(kv_heads, -1, dim)[:, :ctx] for i in (0, 1))
        rep = heads // kv_heads
        out[seq] = F.scaled_dot_product_attention(
            q[:, seq:seq + 1], k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0))[:, 0]
    return out


def test_the_timed_step_computes_each_layers_attention():
    step = Step((6, 2, 64), streams=4, context=70, layers=2, dtype=torch.float32)
    outs = step.run(cpu_attention.decode_kernel(), threads=2)
    for layer, out in enumerate(outs):
        torch.testing.assert_close(out, reference(step, layer), rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[0], outs[1])  # each layer its own pool and queries
