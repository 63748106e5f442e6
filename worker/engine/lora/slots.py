"""The device's adapter slots: `max_loras` adapters' factors where a step's linears read them, and
which adapter each slot holds. A step's adapters are all in slots before its forward (manager.py);
its rows reach each linear's term as `SlotRows` (sgmv.py), built once per step.

Two stores, one contract (`load`, `step_rows`, `add`):
- `StackedSlots` (CUDA, and the Triton path under the interpreter): per linear one tensor of every
  slot's A and one of every slot's B, zero-padded to max_lora_rank (scale folded into B),
  allocated at start-up before the KV budget is sized; the SGMV kernels (sgmv.py) read them.
- `ProductSlots` (CPU): per targeted linear, every slot's factors stacked into the products
  cpu_linear.py computes the base linears with (kvfleet's own product where the engine is
  batch-invariant, so an adapter's rows stay batch-invariant as the base rows are).
"""

from __future__ import annotations

import torch

from kvfleet.worker.engine.kernels.cpu_attention import DTYPE_CODES
from kvfleet.worker.engine.kernels.cpu_kernels import layer_ops_kernel
from kvfleet.worker.engine.kernels.cpu_linear import product
from kvfleet.worker.engine.memory.device import is_cpu
from kvfleet.worker.engine.lora.sgmv import SlotRows, sgmv, sgmv_torch
from kvfleet.worker.engine.lora.weights import AdapterWeights, LinearDims

SlotLoad = tuple[int, str, str]  # (slot, adapter name, path): load it there before the forward


class SlotTable:
    """Which adapter each slot holds; a new one goes to a free slot, else to the slot least
    recently used by a step whose adapter the coming step does not use."""

    def __init__(self, num_slots: int):
        self.held: list[str | None] = [None] * num_slots  # adapter name per slot
        self._paths: list[str | None] = [None] * num_slots  # and the directory it came from
        self._last_used = [0] * num_slots
        self._clock = 0

    def slot_of(self, name: str) -> int | None:
        return self.held.index(name) if name in self.held else None

    def choose(self, keep: set[str]) -> int:
        """The slot to load a new adapter into, keeping those in `keep` (the step's)."""
        free = [s for s, name in enumerate(self.held) if name is None]
        if free:
            return free[0]
        candidates = [s for s, name in enumerate(self.held) if name not in keep]
        if not candidates:
            raise RuntimeError(f"a step uses more adapters than the {len(self.held)} slots")
        return min(candidates, key=lambda s: self._last_used[s])

    def put(self, slot: int, name: str, path: str) -> None:
        self.held[slot], self._paths[slot] = name, path

    def holds(self, slot: int, name: str, path: str) -> bool:
        return self.held[slot] == name and self._paths[slot] == path

    def touch(self, slot: int) -> None:
        self._clock += 1
        self._last_used[slot] = self._clock

    def forget(self, name: str) -> None:
        """`name` changed (loaded again from another path): no slot holds it any more."""
        self.held = [None if held == name else held for held in self.held]


def slot_bytes(dims: dict[str, LinearDims], num_slots: int, max_rank: int,
               dtype: torch.dtype) -> int:
    """Bytes of `num_slots` adapters at `max_rank` over linears of `dims` ("layers.<i>.<m>")."""
    per_rank = sum(d.in_features + d.out_features for d in dims.values())
    return num_slots * max_rank * per_rank * dtype.itemsize



class ProductSlots:
    """Slots as products per targeted linear, every slot's factors stacked: one shrink product
    x @ [A of each part and slot] for all of a step's adapter rows, the columns of other slots
    than a row's own zeroed, then per part one expand product over every slot's B (scale folded)
    added into that part's columns. A step costs each linear 1 + parts products whatever its
    number of adapters (a product per adapter and part was 3-4x slower at 4 adapters).

    Each slot's block is `width` columns (max_lora_rank, even: bf16 products step over column
    pairs), zero past the adapter's rank. Row-invariant where the products are (kvfleet's own:
    every output summed over k in order, so a row's zeros before and after its slot's block add
    nothing): a row's term is the same whichever slot its adapter is in and whatever else the
    step holds. Stacked products are rebuilt for a linear at its first use after a slot's load."""

    def __init__(self, num_slots: int, dims: dict[str, LinearDims], max_rank: int,
                 dtype: torch.dtype, device: torch.device, invariant: bool):
        self.dtype, self.device, self.invariant = dtype, device, invariant
        self.num_slots, self.width = num_slots, max_rank + max_rank % 2
        self._weights: list[AdapterWeights | None] = [None] * num_slots
        self._version = 0  # bumped by every load; a linear's products remember theirs
        # parts' keys -> (version, shrink, [expand per part])
        self._products: dict[tuple[str, ...], tuple[int, torch.nn.Module,
                                                     list[torch.nn.Module]]] = {}
        self.num_bytes = slot_bytes(dims, num_slots, max_rank, dtype)  # at most (full rank)

    def load(self, slot: int, weights: AdapterWeights) -> None:
        self._weights[slot] = weights
        self._version += 1

    def step_rows(self, segments: list[tuple[int, int, int]]) -> SlotRows:
        return SlotRows.of(segments, self.device)

    def add_target(self, parts, x: torch.Tensor, out: torch.Tensor, step: SlotRows) -> None:
        """out [T, out_features] += each adapter row's term for every part of one linear."""
        shrink, expands = self._stacked(parts, x.shape[1])
        if shrink is None:  # no adapter in a slot changes this linear
            return
        rows = step.all_rows(x.shape[0])
        xs = x if rows is None else x[rows]
        h = shrink(xs)  # [N, parts x slots x width]
        h.mul_(step.slot_mask(self.num_slots, self.width, len(parts), h.dtype))
        span = self.num_slots * self.width
        for p, (part, expand) in enumerate(zip(parts, expands)):
            if expand is None:
                continue
            term = expand(h[:, p * span:(p + 1) * span])  # [N, part's columns]
            if rows is None:
                out[:, part.start:part.end] += term
            else:
                out[:, part.start:part.end].index_add_(0, rows, term)

    def _stacked(self, parts, in_features: int):
        """The linear's stacked (shrink, [expand or None per part]) for the slots as they are;
        (None, []) where no slot's adapter has a term for it."""
        keys = tuple(part.key for part in parts)
        built = self._products.get(keys)
        if built is None or built[0] != self._version:
            span = self.num_slots * self.width
            shrink = torch.zeros(len(parts) * span, in_features, dtype=self.dtype)
            expands: list[torch.nn.Module | None] = []
            for p, part in enumerate(parts):
                expand = torch.zeros(part.end - part.start, span, dtype=self.dtype)
                used = False
                for s, weights in enumerate(self._weights):
                    pair = None if weights is None else weights.pairs.get(part.key)
                    if pair is not None:
                        row = p * span + s * self.width
                        shrink[row:row + pair.rank] = pair.a
                        expand[:, s * self.width:s * self.width + pair.rank] = pair.b
                        used = True
                expands.append(self._linear(expand) if used else None)
            stacked = self._linear(shrink) if any(e is not None for e in expands) else None
            built = self._products[keys] = (self._version, stacked, expands)
        return built[1], built[2]

    def _linear(self, weight: torch.Tensor) -> torch.nn.Module:
        """x @ weight.T as the device computes a linear ([out, in] weight)."""
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                 dtype=self.dtype, device=self.device)
        with torch.no_grad():
            linear.weight.copy_(weight)
        linear.requires_grad_(False)
        return product(linear, self.invariant) if is_cpu(self.device) else linear


class KernelSlots:
    """Slots for kvfleet's own LoRA kernel on the CPU (cpu_layer_ops.cpp `kvfleet_lora_add`):
    per targeted linear every slot's factors in the engine's dtype (fp32 sums), one call per linear and step computing each
    adapter row's term with its own slot's factors only (no products of other slots' zeros, no
    gather, no per-slot calls), each row alone in a fixed order: batch-, slot- and
    thread-invariant in float32 and bf16. Stacked factors are rebuilt for a linear at its first
    use after a slot's load."""

    def __init__(self, num_slots: int, dims: dict[str, LinearDims], max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.num_slots, self.width = num_slots, max_rank
        self._weights: list[AdapterWeights | None] = [None] * num_slots
        self._version = 0
        self._stacks: dict[tuple[str, ...], tuple] = {}
        self.num_bytes = slot_bytes(dims, num_slots, max_rank, dtype)
        self._kvfleet_lora_add = layer_ops_kernel().kvfleet_lora_add
        self._code = DTYPE_CODES[dtype]

    def load(self, slot: int, weights: AdapterWeights) -> None:
        self._weights[slot] = weights
        self._version += 1

    def step_rows(self, segments: list[tuple[int, int, int]]) -> SlotRows:
        return SlotRows.of(segments, self.device)

    def add_target(self, parts, x: torch.Tensor, out: torch.Tensor, step: SlotRows) -> None:
        """out [T, out_features] += each adapter row's term for every part of one linear."""
        stack = self._stack(parts, x.shape[1])
        if stack is None:
            return
        a, b, starts, lengths, offsets = stack
        if x.stride(-1) != 1:
            x = x.contiguous()
        if out.stride(-1) != 1:
            raise ValueError("LoRA: the linear's output rows must be contiguous")
        slots = step.slot_of_row(x.shape[0])
        status = self._kvfleet_lora_add(
            self._code, x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], slots.data_ptr(),
            a.data_ptr(), a.shape[1], b.data_ptr(), len(parts), self.width, starts.data_ptr(),
            lengths.data_ptr(), offsets.data_ptr(), out.data_ptr(), out.stride(0),
            torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"kvfleet_lora_add failed ({status})")

    def _stack(self, parts, in_features: int):
        keys = tuple(part.key for part in parts)
        built = self._stacks.get(keys)
        if built is None or built[0] != self._version:
            w, num_slots = self.width, self.num_slots
            a = torch.zeros(num_slots, len(parts) * w, in_features, dtype=self.dtype)
            bs, used = [], False
            for p, part in enumerate(parts):
                b = torch.zeros(num_slots, w, part.end - part.start, dtype=self.dtype)
                for s, weights in enumerate(self._weights):
                    pair = None if weights is None else weights.pairs.get(part.key)
                    if pair is not None:
                        a[s, p * w:p * w + pair.rank] = pair.a
                        b[s, :pair.rank] = pair.b.T
                        used = True
                bs.append(b.reshape(-1))
            offsets = torch.tensor([0] + [t.numel() for t in bs[:-1]]).cumsum(0)
            stack = None if not used else (
                a, torch.cat(bs), torch.tensor([part.start for part in parts]),
                torch.tensor([part.end - part.start for part in parts]), offsets)
            built = self._stacks[keys] = (self._version, stack)
        return built[1]


class StackedSlots:
    """Slots stacked per linear: A [S, R, in], B [S, R, out] (B.T, scale folded), zero past each
    adapter's rank, and every (linear, slot)'s rank; computed by the SGMV kernels (or
    `sgmv_torch` without triton)."""

    def __init__(self, num_slots: int, dims: dict[str, LinearDims], max_rank: int,
                 dtype: torch.dtype, device: torch.device, use_triton: bool):
        self.device, self.use_triton = device, use_triton
        self.a = {key: torch.zeros(num_slots, max_rank, d.in_features, dtype=dtype, device=device)
                  for key, d in dims.items()}
        self.b = {key: torch.zeros(num_slots, max_rank, d.out_features, dtype=dtype,
                                   device=device) for key, d in dims.items()}
        self._index = {key: i for i, key in enumerate(dims)}
        self._host_ranks = [[0] * num_slots for _ in dims]  # [linear][slot]
        self._ranks = torch.zeros(len(dims), num_slots, dtype=torch.int32, device=device)
        self.num_bytes = slot_bytes(dims, num_slots, max_rank, dtype)

    def load(self, slot: int, weights: AdapterWeights) -> None:
        for key, i in self._index.items():
            pair = weights.pairs.get(key)
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
            self._host_ranks[i][slot] = 0 if pair is None else pair.rank
            if pair is not None:
                self.a[key][slot, :pair.rank].copy_(pair.a, non_blocking=True)
                self.b[key][slot, :pair.rank].copy_(pair.b.T, non_blocking=True)
        self._ranks.copy_(torch.tensor(self._host_ranks, dtype=torch.int32))

    def step_rows(self, segments: list[tuple[int, int, int]]) -> SlotRows:
        return SlotRows.of(segments, self.device, for_kernels=self.use_triton)

    def add_target(self, parts, x: torch.Tensor, out: torch.Tensor, step: SlotRows) -> None:
        """out [T, out_features] += each adapter row's term for every part of one linear."""
        for part in parts:
            self.add(part.key, x, out[:, part.start:part.end], step)

    def add(self, key: str, x: torch.Tensor, out: torch.Tensor, step: SlotRows) -> None:
        i = self._index[key]
        ranks = self._host_ranks[i]
        max_rank = max(ranks[slot] for slot in step.slots)
        if max_rank == 0:
            return
        if self.use_triton:
            sgmv(x if x.stride(-1) == 1 else x.contiguous(), out, self.a[key], self.b[key],
                 self._ranks[i], max_rank, step)
        else:
            sgmv_torch(x, out, self.a[key], self.b[key], ranks, step)
