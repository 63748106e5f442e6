"""The device's adapter slots: `max_loras` adapters' factors where a step's linears read them, and
which adapter each slot holds. A step's adapters are all in slots before its forward (manager.py);
its rows reach each linear's term as `SlotRows` (sgmv.py), built once per step.

Two stores, one contract (`load`, `step_rows`, `add`):
- `StackedSlots` (CUDA, and the Triton path under the interpreter): per linear one tensor of every
  slot's A and one of every slot's B, zero-padded to max_lora_rank (scale folded into B),
  allocated at start-up before the KV budget is sized; the SGMV kernels (sgmv.py) read them.
- `ProductSlots` (CPU): per slot and linear the products cpu_linear.py computes the base linears
  with, built when an adapter is loaded into the slot (kvfleet's own product where the engine is
  batch-invariant, so an adapter's rows stay batch-invariant as the base rows are).
"""

from __future__ import annotations

import torch

from worker.engine.cpu_linear import product
from worker.engine.device import is_cpu
from worker.engine.lora.sgmv import SlotRows, sgmv, sgmv_torch
from worker.engine.lora.weights import AdapterWeights, LinearDims

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
    """Slots as products per (slot, linear), built on load from the adapter's own rank."""

    def __init__(self, num_slots: int, dims: dict[str, LinearDims], max_rank: int,
                 dtype: torch.dtype, device: torch.device, invariant: bool):
        self.dtype, self.device, self.invariant = dtype, device, invariant
        # slot -> "layers.<i>.<module>" -> (shrink [in -> r], expand [r -> out, scale folded])
        self._products: list[dict[str, tuple[torch.nn.Module, torch.nn.Module]]] = [
            {} for _ in range(num_slots)]
        self.num_bytes = slot_bytes(dims, num_slots, max_rank, dtype)  # at most (full rank)

    def load(self, slot: int, weights: AdapterWeights) -> None:
        self._products[slot] = {key: (self._linear(pair.a), self._linear(pair.b))
                                for key, pair in weights.pairs.items()}

    def _linear(self, weight: torch.Tensor) -> torch.nn.Module:
        """x @ weight.T as the device computes a linear ([out, in] weight)."""
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                 dtype=self.dtype, device=self.device)
        with torch.no_grad():
            linear.weight.copy_(weight)
        linear.requires_grad_(False)
        return product(linear, self.invariant) if is_cpu(self.device) else linear

    def step_rows(self, segments: list[tuple[int, int, int]]) -> SlotRows:
        return SlotRows.of(segments, self.device)

    def add(self, key: str, x: torch.Tensor, out: torch.Tensor, step: SlotRows) -> None:
        """out [T, out_features] (a view) += each slot's term for its rows of x [T, in]."""
        for slot, rows in zip(step.slots, step.rows):
            pair = self._products[slot].get(key)
            if pair is not None:
                shrink, expand = pair
                out[rows] += expand(shrink(x[rows]))


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
