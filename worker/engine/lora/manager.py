"""The engine's adapters: which requests hold which loaded adapter, which adapter each device slot
holds, and the step's adapter rows that every linear's term reads.

Life of an adapter request:
1. `acquire` (Engine.add_request): an adapter already loaded from that path is pinned for the
   request at once; another is checked (shared.lora.inspect_adapter: LoraLoadError before the
   request is queued) and loaded if the host cache has room, else the request is pending; while
   one is pending, every later adapter request is pending too, loaded or not.
2. `load_pending` (before each schedule): pending requests, in arrival order, pin their adapter,
   loading it as room appears (an adapter no request pins is evicted, one no pending request
   wants first); none pins ahead of an earlier one that found no room. So the pins are held by
   requests that arrived before the first pending one: they run and finish whatever waits behind
   it, and the room they free is its. The scheduler admits only requests holding their pin.
3. `assign_slots` (after the schedule): the step's adapters (at most max_loras: the scheduler's
   rule) get slots; one not in a slot is loaded into a free one or into the least recently used
   one this step does not need. The chunks carry their slot (attached when the scheduler
   builds the step's output, lora/feature.py); the loads go in the step's plan,
   so tensor-parallel ranks load the same adapters into the same slots (`ensure_slot`).
4. `start_step` / `end_step` (around the forward, model_runner.py): the plan's chunks with a slot
   become the step's rows; every targeted linear adds its term for them. A step without adapter
   rows has none: each linear's update returns at once, the base path unchanged. CUDA graphs
   are captured with no rows set (their replays carry no term), so a step with adapter rows runs
   eagerly (model_runner.py) and base-only steps may still replay graphs.
5. `release` (the request left): its pin goes.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvfleet.shared.lora import SUPPORTED_MODULES
from kvfleet.worker.engine.memory.device import is_cuda
from kvfleet.worker.engine.memory.kv_cache import format_bytes
from kvfleet.worker.engine.lora.cache import AdapterCache
from kvfleet.worker.engine.lora.layers import LoraTarget, TargetPart, lora_targets
from kvfleet.worker.engine.core.lora_request import LoraLoadError, LoraRequest, LoraStats
from kvfleet.worker.engine.lora.sgmv import SlotRows
from kvfleet.worker.engine.lora.slots import (
    KernelSlots, ProductSlots, SlotLoad, SlotTable, StackedSlots, slot_bytes)
from kvfleet.worker.engine.kernels.cpu_attention import DTYPE_CODES
from kvfleet.worker.engine.kernels.cpu_kernels import layer_ops_kernel
from kvfleet.worker.engine.kernels.kernel_binding import BoundKernel
from kvfleet.worker.engine.lora.weights import (
    AdapterWeights, ShardSlices, check_adapter, load_adapter)
from kvfleet.worker.engine.model.model_prep import add_linear_update
from kvfleet.worker.engine.kernels.triton_attention import triton_available

if TYPE_CHECKING:
    from kvfleet.worker.engine.attention import AttentionBackend
    from kvfleet.worker.engine.core.config import LoraConfig
    from kvfleet.worker.engine.parallel.tp_group import RankGroup
    from kvfleet.worker.engine.parallel.tp_shard import HeadShard
    from kvfleet.worker.engine.core.model_runner import StepPlan
    from kvfleet.worker.engine.core.scheduler import ScheduledChunk


class LoraManager:
    """Adapters of one engine (one per tensor-parallel rank, each over its shard)."""

    def __init__(self, config: LoraConfig, model_config: dict, dtype: torch.dtype,
                 device: torch.device, slices: ShardSlices, use_triton: bool = False,
                 invariant: bool = False):
        self.model_config, self.dtype, self.slices = model_config, dtype, slices
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.num_layers = int(model_config["num_hidden_layers"])
        self.module_dims = slices.dims(model_config)  # module -> its (in, out) on this rank
        dims = {f"layers.{i}.{m}": self.module_dims[m]
                for i in range(self.num_layers) for m in SUPPORTED_MODULES}
        self.cache = AdapterCache(config.lora_cache_size, self._load)
        self.table = SlotTable(config.max_loras)
        # on the device from here on: allocated before the KV budget is planned
        if use_triton or is_cuda(device):
            self.slots = StackedSlots(config.max_loras, dims, config.max_lora_rank, dtype,
                                      device, use_triton)
        elif dtype in DTYPE_CODES and isinstance(layer_ops_kernel(), BoundKernel):
            self.slots = KernelSlots(config.max_loras, dims, config.max_lora_rank, dtype, device)
        else:
            self.slots = ProductSlots(config.max_loras, dims, config.max_lora_rank, dtype,
                                      device, invariant)
        self.host_bytes_at_most = slot_bytes(dims, config.lora_cache_size,
                                             config.max_lora_rank, dtype)
        self._holding: dict[str, str] = {}  # req_id -> adapter name it pinned
        self._pending: OrderedDict[str, LoraRequest] = OrderedDict()  # arrival order
        self._step: SlotRows | None = None  # the adapter rows of the forward running now
        self.targets: list[LoraTarget] = []

    @classmethod
    def for_engine(cls, config: LoraConfig, model: nn.Module, dtype: torch.dtype,
                   device: torch.device, attention_backend: AttentionBackend,
                   deterministic: bool, ranks: RankGroup | None = None,
                   shard: HeadShard | None = None) -> LoraManager:
        """The manager of an engine whose model is `model` (the caller's, unsharded config)."""
        model_config = model.config.to_dict()
        slices = ShardSlices.whole() if ranks is None else ShardSlices.of_rank(
            model_config, shard, ranks.rank, ranks.world_size)
        # the SGMV kernels on CUDA, and where attention runs in Triton (its interpreter in tests)
        use_triton = triton_available() and (is_cuda(device) or attention_backend.triton_kernels)
        return cls(config, model_config, dtype, device, slices, use_triton, deterministic)

    def _load(self, name: str, path: str) -> AdapterWeights:
        return load_adapter(name, path, self.model_config, self.max_rank, self.dtype, self.slices)

    # ---- the model ----------------------------------------------------------------------------

    def install(self, model: nn.Module) -> None:
        """One update per targeted linear product of the prepared `model`, for its lifetime."""
        self.targets = lora_targets(model, self.module_dims, self.num_layers)
        for target in self.targets:
            add_linear_update(target.module, partial(self._update, target.parts))

    def _update(self, parts: tuple[TargetPart, ...], x: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor | None:
        step = self._step
        if step is None:  # no adapter rows in this forward: the base path as it is
            return None
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        out2 = out.reshape(-1, out.shape[-1])  # [T, out]: a view of `out` where it can be
        self.slots.add_target(parts, x2, out2, step)
        return out2.view(out.shape)

    # ---- requests -----------------------------------------------------------------------------

    def acquire(self, req_id: str, lora: LoraRequest) -> None:
        """Pin `lora`'s adapter for the request, loading it if there is room; else the request
        waits (`is_ready` False) until `load_pending` loads it. LoraLoadError: not servable."""
        loaded = self.cache.get(lora.name, lora.path) is not None
        if loaded and not self._pending:
            self._pin(req_id, lora.name)
            return
        if self.cache.in_use_elsewhere(lora.name, lora.path):
            raise LoraLoadError(f"adapter {lora.name} is in use from another path than "
                                f"{lora.path}")
        if not loaded:
            check_adapter(lora.path, self.model_config, self.max_rank)  # refused before queued
        if not self._pending and self.cache.has_room():
            self._load_for(req_id, lora)
        else:  # behind the pending ones: pins only in arrival order (no deadlock, no starving)
            self._pending[req_id] = lora

    def _load_for(self, req_id: str, lora: LoraRequest) -> None:
        replaced = lora.name in self.cache.loaded()
        wanted = {pending.name for pending in self._pending.values()}
        self.cache.load(lora.name, lora.path, keep=wanted)
        if replaced:  # another path under the same name: slots holding the old one are stale
            self.table.forget(lora.name)
        self._pin(req_id, lora.name)

    def _pin(self, req_id: str, name: str) -> None:
        self.cache.pin(name)
        self._holding[req_id] = name

    def is_ready(self, req_id: str) -> bool:
        """The request's adapter is loaded and pinned for it (a base request: always)."""
        return req_id not in self._pending

    def load_pending(self) -> list[tuple[str, LoraLoadError]]:
        """Load the adapters of pending requests in arrival order, as room allows; the requests
        whose adapter could not be loaded after all (removed since it was checked, ...)."""
        failed = []
        for req_id, lora in list(self._pending.items()):
            if self.cache.get(lora.name, lora.path) is not None:
                del self._pending[req_id]
                self._pin(req_id, lora.name)
            elif self.cache.has_room():
                del self._pending[req_id]
                try:
                    self._load_for(req_id, lora)
                except LoraLoadError as exc:
                    failed.append((req_id, exc))
            else:
                break  # arrival order: no later request pins before this one
        return failed

    def release(self, req_id: str) -> None:
        """The request left the engine."""
        self._pending.pop(req_id, None)
        name = self._holding.pop(req_id, None)
        if name is not None:
            self.cache.unpin(name)

    # ---- steps --------------------------------------------------------------------------------

    def assign_slots(self, chunks: list[ScheduledChunk]) -> tuple[dict[str, int], list[SlotLoad]]:
        """Put the step's adapters in slots (loading those not in one); req_id -> the slot of
        each adapter chunk's adapter, and the loads (for the other ranks)."""
        names = list(dict.fromkeys(c.seq.lora.name for c in chunks if c.seq.lora is not None))
        loads: list[SlotLoad] = []
        slot_of: dict[str, int] = {}
        for name in names:
            slot = self.table.slot_of(name)
            if slot is None:
                slot = self.table.choose(keep=set(names))
                weights = self.cache.get(name)  # pinned by the chunk's request: loaded
                self._fill(slot, weights)
                loads.append((slot, name, weights.path))
            self.table.touch(slot)
            slot_of[name] = slot
        return {c.seq.req_id: slot_of[c.seq.lora.name] for c in chunks
                if c.seq.lora is not None}, loads

    def _fill(self, slot: int, weights: AdapterWeights) -> None:
        self.slots.load(slot, weights)
        self.table.put(slot, weights.name, weights.path)

    def ensure_slot(self, slot: int, name: str, path: str) -> None:
        """`slot` holds adapter `name` (a tensor-parallel rank following rank 0's loads)."""
        if self.table.holds(slot, name, path):
            return
        weights = self.cache.get(name, path) or self.cache.load(name, path)
        self._fill(slot, weights)

    def start_step(self, plan: StepPlan) -> None:
        """The plan's adapter rows are what the linears' terms apply to until `end_step`."""
        for slot, name, path in plan.lora_loads:
            self.ensure_slot(slot, name, path)
        rows, row = [], 0
        for chunk in plan.chunks:
            if chunk.lora_slot >= 0:
                if rows and rows[-1][2] == chunk.lora_slot and rows[-1][0] + rows[-1][1] == row:
                    start, length, slot = rows.pop()  # one segment for consecutive chunks
                    rows.append((start, length + chunk.num_tokens, slot))
                else:
                    rows.append((row, chunk.num_tokens, chunk.lora_slot))
            row += chunk.num_tokens
        self._step = self.slots.step_rows(rows) if rows else None

    def end_step(self) -> None:
        self._step = None

    # ---- reports ------------------------------------------------------------------------------

    def stats(self) -> LoraStats:
        return LoraStats(loaded=self.cache.loaded(),
                         in_slots=[name for name in self.table.held if name is not None],
                         loads_total=dict(self.cache.loads_total),
                         evictions_total=dict(self.cache.evictions_total),
                         num_waiting_for_load=len(self._pending))

    def report(self) -> str:
        """The budget line: the slots' device bytes and the host cache's most."""
        kind = "SGMV kernels" if isinstance(self.slots, StackedSlots) and self.slots.use_triton \
            else "torch products"
        return (f"LoRA: {self.max_loras} slots at rank {self.max_rank}, "
                f"{format_bytes(self.slots.num_bytes)} beside the weights ({kind}); up to "
                f"{self.cache.capacity} adapters in host memory, "
                f"{format_bytes(self.host_bytes_at_most)} at most")
