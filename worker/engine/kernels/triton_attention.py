"""Paged attention in Triton for accelerators: every query of a step (decode tokens and prefill
chunks, with or without a cached prefix) attends over its sequence's K/V read in place through
the block table, 8-bit formats dequantised in registers; one launch per layer.

Grid: (query tiles, KV heads). A tile is up to BLOCK_Q consecutive queries of one sequence; a
program takes the tile's queries for all GROUP query heads that share its KV head, so a K/V row is
loaded once for the whole GQA group (M = BLOCK_Q x GROUP_PAD rows against each K/V block). Query i
of a chunk sits at absolute position ctx_len - q_len + i and sees keys [0, that position]: the
causal mask with the prefix's offset, so a chunk after a cached prefix needs no dense mask and no
gathered copy. Online softmax (flash attention) over BLOCK_N keys at a time, in fp32.

8-bit formats fold the per-(token, head) scale into the scores and probabilities instead of into
K/V: q.(c_k s_k) = (q.c_k) s_k and sum_n p_n s_n c_n = (p * s) . c, so the codes go to the dot as
they are (e4m3 and int8 codes are exact in bf16/fp32). int8 rows are stored rotated by R
(kv_format.py); the caller rotates q and un-rotates the output, as the SDPA path does.

Triton's interpreter (TRITON_INTERPRET=1, read when triton is imported) runs this on CPU tensors
for the tests; its `tl.dot` on bf16 operands is wrong there, so `dot_fp32` (on by default under
the interpreter) makes the dots take fp32 operands.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvfleet.worker.engine.memory.kv_cache import KVCachePool

try:  # bundled with CUDA builds of torch; optional on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

# queries x heads per program: decode-only steps need few rows, prefill tiles reuse K/V more
DECODE_ROWS = 16  # tl.dot needs at least 16 rows
PREFILL_ROWS = 64
BLOCK_N = 64  # keys per inner iteration

_FORMAT_CODES = {"fp8": 1, "int8": 2}  # anything else: plain floats (0)


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass
class PagedAttentionPlan:
    """Per-step metadata of the kernel, shared by every layer (all int32 on the pool's device).

    Sequences are in flattened query order: sequence s's queries are rows
    [q_start[s], q_start[s] + q_len[s]) of the step, its keys positions [0, ctx_len[s]).
    """

    q_start: torch.Tensor  # [S]
    q_len: torch.Tensor  # [S]
    ctx_len: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [S, max_blocks]: page of each block_size keys (padding: any page)
    tile_seq: torch.Tensor  # [num_tiles]: the sequence of each query tile
    tile_q0: torch.Tensor  # [num_tiles]: the tile's first query, counted within its sequence
    block_q: int  # queries per tile

    @property
    def num_tiles(self) -> int:
        return self.tile_seq.shape[0]


def group_pad(num_heads: int, num_kv_heads: int) -> int:
    """The GQA group size rounded up to a power of two (the kernel's rows per query)."""
    return triton.next_power_of_2(num_heads // num_kv_heads) if triton else 1


def queries_per_tile(num_heads: int, num_kv_heads: int, has_prefill: bool) -> int:
    rows = PREFILL_ROWS if has_prefill else DECODE_ROWS
    return max(1, rows // group_pad(num_heads, num_kv_heads))


def build_plan(q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]],
               block_q: int, device: torch.device) -> PagedAttentionPlan:
    """The plan of one step from per-sequence host lists (decodes have q_len 1)."""
    q_starts, tile_seq, tile_q0, start = [], [], [], 0
    for s, q_len in enumerate(q_lens):
        q_starts.append(start)
        start += q_len
        for q0 in range(0, q_len, block_q):
            tile_seq.append(s)
            tile_q0.append(q0)
    width = max(1, max((len(t) for t in block_tables), default=1))
    tables = [t + [0] * (width - len(t)) for t in block_tables]

    def on_device(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return PagedAttentionPlan(
        q_start=on_device(q_starts), q_len=on_device(q_lens), ctx_len=on_device(ctx_lens),
        block_tables=on_device(tables), tile_seq=on_device(tile_seq), tile_q0=on_device(tile_q0),
        block_q=block_q)


def paged_attention(query: torch.Tensor, pool: KVCachePool, layer: int, plan: PagedAttentionPlan,
                    scale: float, out: torch.Tensor, dot_fp32: bool | None = None) -> None:
    """out[t, h] = attention of query[h, t] ([H, T, D], any strides) over its sequence's cached
    K/V (already written for this step's tokens). `out` is [T, H, D]; the plan covers every t."""
    if triton is None:
        raise RuntimeError("the triton attention backend needs the `triton` package")
    num_heads, _, head_dim = query.shape
    kv = pool.layer(layer)  # [2, KVH, NB, bs, D]
    num_kv_heads, block_size = kv.shape[1], kv.shape[3]
    rotation = pool.rotation(torch.float32)
    q = query if rotation is None else (query.float() @ rotation).to(query.dtype)
    scales = pool.scales(layer)  # [2, KVH, NB, bs] or None
    k_scales, v_scales = (scales[0], scales[1]) if scales is not None else (kv[0], kv[1])
    if dot_fp32 is None:
        dot_fp32 = interpreting()
    if scale is None:
        scale = head_dim ** -0.5
    group = num_heads // num_kv_heads
    _paged_attention_kernel[(plan.num_tiles, num_kv_heads)](
        q, out, kv[0], kv[1], k_scales, v_scales,
        plan.tile_seq, plan.tile_q0, plan.q_start, plan.q_len, plan.ctx_len, plan.block_tables,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(1), q.stride(0), out.stride(0), out.stride(1),
        kv.stride(1), kv.stride(2), kv.stride(3),
        k_scales.stride(0), k_scales.stride(1), k_scales.stride(2),
        plan.block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=plan.block_q, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_FORMAT=_FORMAT_CODES.get(pool.kv_format.name, 0), DOT_FP32=dot_fp32)
    if rotation is not None:  # the plan covers every row of the step: un-rotate them all
        out.copy_(out.float() @ rotation.T)


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, o_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
        tile_seq_ptr, tile_q0_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, bt_ptr,
        scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kh, stride_kb, stride_ks,
        stride_sh, stride_sb, stride_ss,
        stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        q0 = tl.load(tile_q0_ptr + tile)
        q_start = tl.load(q_start_ptr + seq)
        q_len = tl.load(q_len_ptr + seq)
        ctx_len = tl.load(ctx_len_ptr + seq)

        # rows: query (q0 + r // GROUP_PAD) of the chunk, head kvh * GROUP + r % GROUP_PAD
        offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
        q_idx = q0 + offs_m // GROUP_PAD
        g = offs_m % GROUP_PAD
        row_valid = (q_idx < q_len) & (g < GROUP)
        q_pos = ctx_len - q_len + q_idx  # absolute position: sees keys [0, q_pos]
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_valid = offs_d < HEAD_DIM
        head = kvh * GROUP + g
        q_rows = (q_start + q_idx).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :],
                    mask=row_valid[:, None] & d_valid[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        # the tile's last query sees keys up to its own position, none beyond
        kv_end = tl.minimum(ctx_len, ctx_len - q_len + q0 + BLOCK_Q)
        for start in range(0, kv_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < kv_end
            page = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + offs_n // BLOCK_SIZE,
                           mask=n_valid, other=0).to(tl.int64)
            slot = offs_n % BLOCK_SIZE
            kv_rows = kvh.to(tl.int64) * stride_kh + page * stride_kb + slot * stride_ks  # [N]
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(k_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0)
            v = tl.load(v_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0)
            if KV_FORMAT == 1:  # fp8 e4m3 codes are kept as uint8; scales apply outside the dots
                k = k.to(tl.float8e4nv, bitcast=True)
                v = v.to(tl.float8e4nv, bitcast=True)
            k = k.to(q.dtype)
            v = v.to(q.dtype)

            qk = tl.dot(q, tl.trans(k)) * scale_log2  # [M, N] fp32, log2 units
            if KV_FORMAT != 0:
                s_rows = kvh.to(tl.int64) * stride_sh + page * stride_sb + slot * stride_ss
                k_scale = tl.load(ks_ptr + s_rows, mask=n_valid, other=0.0).to(tl.float32)
                v_scale = tl.load(vs_ptr + s_rows, mask=n_valid, other=0.0).to(tl.float32)
                qk = qk * k_scale[None, :]
            else:
                v_scale = tl.full([BLOCK_N], 1.0, tl.float32)  # unused: keeps the name defined
            visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV_FORMAT != 0:
                p = p * v_scale[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = (q_start + q_idx).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & d_valid[None, :])
