"""LoRA for a mixed batch on an accelerator, as two Triton kernels over the step's rows grouped by
slot (SGMV, as Punica and vLLM V1 compute it): each linear adds, for every slot of the step,
(x[rows] @ A_slot.T) @ B_slot.T into its output rows. Rows are grouped by slot through an index
(a step's decode rows are ordered by context length, not by adapter), so a slot's factors are read
once per tile of its rows, not once per request.

- shrink: xa[rows] = x[rows] @ A_slot.T, fp32 [T, R_pad] (grid: slots x row tiles; each program
  walks the input features in BLOCK_K steps);
- expand: out[rows, :] += xa[rows] @ B_slot.T (grid: slots x row tiles x output tiles), in
  place, each output element read and written by one program.
Slots are stacked per linear (slots.py): A [S, R, in], B [S, R, out] (B transposed: output
features contiguous), zero past each adapter's rank; `ranks[S]` lets a program whose slot has no
factors for this linear (rank 0) return at once. bf16 models round xa to bf16 before the expand,
as PEFT's lora_A output is; float32 models take IEEE fp32 dots (no TF32).

Under Triton's interpreter (tests, TRITON_INTERPRET=1) the dots take fp32 operands (its bf16 dot
is wrong there, as triton_attention.py notes). `sgmv_torch` is the same computation in torch: the
kernels' reference in the tests, and the path where triton is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvfleet.worker.engine.kernels.triton_attention import interpreting

try:  # bundled with CUDA builds of torch; optional on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None


@dataclass(frozen=True)
class SlotRows:
    """A step's adapter rows grouped by slot: group g holds slot `slots[g]`'s rows, as `rows[g]`
    (one slice where they are consecutive, else an index tensor) and, for the kernels, as
    `row_index[group_start[g]:group_start[g] + group_len[g]]` (int32 on the device)."""

    slots: list[int]
    rows: list[slice | torch.Tensor]
    row_index: torch.Tensor | None = None  # [N] int32: the adapter rows, grouped by slot
    group_start: torch.Tensor | None = None  # [G] int32
    group_len: torch.Tensor | None = None  # [G] int32
    group_slot: torch.Tensor | None = None  # [G] int32
    max_len: int = 0  # the largest group's rows (the grid's tiles)
    # every adapter row in ascending order ([N] int64) and its slot ([N] int64)
    ordered_rows: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict, compare=False, repr=False)

    def all_rows(self, num_rows: int) -> torch.Tensor | None:
        """The adapter rows of a step of `num_rows` rows to gather (ascending); None where they
        are all of them (in order: nothing to gather)."""
        return None if self.ordered_rows.shape[0] == num_rows else self.ordered_rows

    def slot_of_row(self, num_rows: int) -> torch.Tensor:
        """[num_rows] int64: each row's slot, -1 for the base model's rows (made once a step)."""
        full = self._masks.get("rows")
        if full is None or full.shape[0] != num_rows:
            full = torch.full((num_rows,), -1, dtype=torch.int64, device=self.row_slots.device)
            full[self.ordered_rows] = self.row_slots
            self._masks["rows"] = full
        return full

    def slot_mask(self, num_slots: int, width: int, num_parts: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """[N, parts x slots x width]: 1 in the `width` columns of each part where a row's own
        slot's block lies, 0 elsewhere (made once per step and shape)."""
        key = (num_slots, width, num_parts, dtype)
        mask = self._masks.get(key)
        if mask is None:
            onehot = torch.nn.functional.one_hot(self.row_slots, num_slots).to(dtype)
            mask = onehot.repeat_interleave(width, dim=1).repeat(1, num_parts)
            self._masks[key] = mask
        return mask

    @classmethod
    def of(cls, segments: list[tuple[int, int, int]], device: torch.device,
           for_kernels: bool = False) -> SlotRows:
        """From (start, length, slot) segments of consecutive rows."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for start, length, slot in segments:
            ranges.setdefault(slot, []).append((start, length))
        slots = list(ranges)
        indices = [[r for start, n in ranges[s] for r in range(start, start + n)] for s in slots]
        rows = [slice(ranges[s][0][0], ranges[s][0][0] + ranges[s][0][1]) if len(ranges[s]) == 1
                else torch.tensor(index, dtype=torch.int64).to(device, non_blocking=True)
                for s, index in zip(slots, indices)]
        ordered = sorted((r, slot) for start, n, slot in segments
                         for r in range(start, start + n))
        order = torch.tensor(ordered, dtype=torch.int64).reshape(-1, 2).to(device,
                                                                          non_blocking=True)
        if not for_kernels:
            return cls(slots, rows, ordered_rows=order[:, 0], row_slots=order[:, 1])
        lengths = [len(index) for index in indices]
        starts = [sum(lengths[:g]) for g in range(len(lengths))]
        table = torch.tensor([starts, lengths, slots], dtype=torch.int32).to(device,
                                                                          non_blocking=True)
        flat = torch.tensor([r for index in indices for r in index], dtype=torch.int32)
        return cls(slots, rows, flat.to(device, non_blocking=True), table[0], table[1], table[2],
                   max(lengths, default=0), order[:, 0], order[:, 1])


def padded_rank(rank: int) -> int:
    """The kernels' rank tile: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(rank) if triton else 1 << (rank - 1).bit_length())


def sgmv_torch(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               ranks: list[int], groups: SlotRows) -> None:
    """out[rows] += (x[rows] @ A_s[:r].T) @ B_s[:r] per slot s of the step, in torch; x [T, in],
    out [T, out], a [S, R, in], b [S, R, out]."""
    for slot, rows in zip(groups.slots, groups.rows):
        rank = ranks[slot]
        if rank == 0:
            continue
        xa = x[rows].float() @ a[slot, :rank].float().T  # [n, r]
        if out.dtype != torch.float32:
            xa = xa.to(out.dtype).float()  # rounded as the kernel rounds it
        delta = xa @ b[slot, :rank].float()  # [n, out]
        out[rows] = (out[rows].float() + delta).to(out.dtype)


def sgmv(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         ranks: torch.Tensor, max_rank: int, groups: SlotRows,
         dot_fp32: bool | None = None) -> None:
    """The kernels: out [T, out] (a view with unit column stride) += each slot's LoRA term for
    its rows; x [T, in], a [S, R, in], b [S, R, out], ranks [S] int32 (the slots' ranks for this
    linear; `max_rank` the largest of the step's). `groups` built `for_kernels`."""
    if not groups.slots or max_rank == 0:
        return
    if dot_fp32 is None:
        dot_fp32 = interpreting()
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    block_r = padded_rank(max_rank)
    block_m = 16 if groups.max_len <= 16 else 64
    num_tiles = triton.cdiv(groups.max_len, block_m)
    # [T, R_pad]: only the adapter rows are written and read
    xa = torch.empty((x.shape[0], block_r), dtype=torch.float32, device=x.device)
    precision = "ieee" if dot_fp32 or x.dtype == torch.float32 else "tf32"
    common = dict(BLOCK_M=block_m, BLOCK_R=block_r, DOT_FP32=dot_fp32, PRECISION=precision)
    index = (groups.row_index, groups.group_start, groups.group_len, groups.group_slot)
    num_groups = len(groups.slots)
    _shrink_kernel[(num_groups, num_tiles)](
        x, a, ranks, xa, *index, x.shape[1], x.stride(0), a.stride(0), a.stride(1),
        xa.stride(0), BLOCK_K=64, **common)
    block_n = 64
    _expand_kernel[(num_groups, num_tiles, triton.cdiv(out.shape[1], block_n))](
        xa, b, ranks, out, *index, out.shape[1], xa.stride(0), b.stride(0), b.stride(1),
        out.stride(0), BLOCK_N=block_n, **common)


if triton is not None:

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, rank_ptr, xa_ptr, row_index_ptr, group_start_ptr, group_len_ptr,
        group_slot_ptr,
        K, stride_xm, stride_as, stride_ar, stride_xam,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        group = tl.program_id(0)
        tile = tl.program_id(1)
        length = tl.load(group_len_ptr + group)
        slot = tl.load(group_slot_ptr + group)
        rank = tl.load(rank_ptr + slot)
        if (tile * BLOCK_M >= length) | (rank == 0):
            return
        first = tl.load(group_start_ptr + group)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = offs_m < length
        rows = tl.load(row_index_ptr + first + offs_m, mask=m_valid, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_valid = offs_r < rank
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_valid = offs_k < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                        mask=m_valid[:, None] & k_valid[None, :], other=0.0)  # [M, K]
            a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                        mask=k_valid[:, None] & r_valid[None, :], other=0.0)  # [K, R]
            if DOT_FP32:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc += tl.dot(x, a, input_precision=PRECISION)
        tl.store(xa_ptr + rows[:, None] * stride_xam + offs_r[None, :], acc,
                 mask=m_valid[:, None])

    @triton.jit
    def _expand_kernel(
        xa_ptr, b_ptr, rank_ptr, out_ptr, row_index_ptr, group_start_ptr, group_len_ptr,
        group_slot_ptr,
        N, stride_xam, stride_bs, stride_br, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        group = tl.program_id(0)
        tile = tl.program_id(1)
        col_tile = tl.program_id(2)
        length = tl.load(group_len_ptr + group)
        slot = tl.load(group_slot_ptr + group)
        rank = tl.load(rank_ptr + slot)
        if (tile * BLOCK_M >= length) | (rank == 0):
            return
        first = tl.load(group_start_ptr + group)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = offs_m < length
        rows = tl.load(row_index_ptr + first + offs_m, mask=m_valid, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < N
        xa = tl.load(xa_ptr + rows[:, None] * stride_xam + offs_r[None, :],
                     mask=m_valid[:, None], other=0.0)  # [M, R] fp32
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
                    + offs_n[None, :], mask=(offs_r < rank)[:, None] & n_valid[None, :],
                    other=0.0)  # [R, N]
        xa = xa.to(b.dtype)  # bf16 models: the shrink's output rounded, as PEFT's is
        if DOT_FP32:
            xa = xa.to(tl.float32)
            b = b.to(tl.float32)
        delta = tl.dot(xa, b, input_precision=PRECISION)  # [M, N] fp32
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        mask = m_valid[:, None] & n_valid[None, :]
        out = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (out.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)
