"""The host tier's index: which evicted prefix blocks it holds, by block hash, in which of its
slots, least recently used first (`--kv-offloading-size`; offloading.py holds the bytes).

Pure bookkeeping, no torch. The block manager (block_manager.py) calls it where the prefix cache
loses a block and where a lookup misses the pool:

- `offload(hash, block)`: a cached block is evicted from the pool. A hash the tier already holds
  is only touched (the tier is inclusive: a block brought back keeps its host copy, so evicting
  it again copies nothing); else it takes a free slot, or the least recently used slot that no
  copy of this step reads, and the block's bytes go there at once (the caller's `save`), while
  the pool still holds them: nothing writes the pool while a step is scheduled.
- `restore(hash, block)`: a waiting request's prefix continues in the tier; the block manager
  took a free pool block for it. The copy into the pool waits for the step's `before_execute`
  (`take_loads`), after the swaps of preempted streams have read their blocks; until then the
  slot is pinned (no offload of this step overwrites it).

`on_drop(hash)` (set by the block manager) hears of each hash the tier drops for room: the worker
announces it removed unless the pool (or the disk tier) holds it again. `on_evict(hash, slot)`,
just before, lets the disk tier keep the slot's bytes (`keep`): the same index, one tier down,
with host slots as its sources.

A slot is reused only after its hash left the index, so the tier never holds more than
`capacity_blocks` blocks, whatever the traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvfleet.shared.wire.prefix_hash import BlockHash

Save = Callable[[int, int], None]  # (pool block, slot): copy the block's bytes to the slot now


class TierIndex:
    """block hash -> slot, LRU first; the loads this step still owes; the tier's counts."""

    def __init__(self, capacity_blocks: int, save: Save):
        if capacity_blocks < 1:
            raise ValueError("the host tier holds no block")
        self.capacity_blocks = capacity_blocks
        self._save = save
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free: list[int] = list(range(capacity_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._loads: dict[int, int] = {}  # pool block -> slot it is filled from before the step
        self.num_offloaded_blocks = 0  # blocks copied into the tier
        self.num_evicted_blocks = 0  # blocks dropped from the tier for room
        self.num_restored_blocks = 0  # blocks copied back into the pool
        self.num_dropped_blocks = 0  # evicted from the pool with no slot left (every slot pinned)
        self.on_drop: Callable[[BlockHash], None] | None = None  # a hash dropped for room
        # called with a hash and its slot as it is dropped for room, before the slot is reused:
        # the disk tier keeps the bytes (tiers/offloading.py)
        self.on_evict: Callable[[BlockHash, int], None] | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def slot_of(self, block_hash: BlockHash) -> int:
        """The slot holding `block_hash` (KeyError if none); a peer's read, so not touched."""
        return self._slots[block_hash]

    def hashes(self) -> list[BlockHash]:
        return list(self._slots)

    def offload(self, block_hash: BlockHash, block: int) -> None:
        """The pool evicts `block`, published as `block_hash`: keep its bytes here."""
        if self._loads.pop(block, None) is not None:  # brought back this step, never filled:
            return  # its hash is still here (a pinned slot is not evicted)
        self.keep(block_hash, block)

    def keep(self, block_hash: BlockHash, source: int) -> None:
        """Keep `block_hash`'s bytes, copied now from `source` (the caller's `save` reads it: a
        pool block, or the host tier's slot for the disk tier), unless they are here already."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        slot = self._free_slot()
        if slot is None:
            self.num_dropped_blocks += 1
            return
        self._save(source, slot)
        self._slots[block_hash] = slot
        self.num_offloaded_blocks += 1

    def restore(self, block_hash: BlockHash, block: int) -> None:
        """Fill pool block `block` with `block_hash`'s bytes before the step runs."""
        slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._loads[block] = slot
        self.num_restored_blocks += 1

    def cancel_load(self, block: int) -> bool:
        """Forget the restore into `block` this step (the pool evicts it before it was filled:
        the bytes stay here); whether there was one."""
        return self._loads.pop(block, None) is not None

    def take_loads(self) -> list[tuple[int, int]]:
        """(slot, pool block) of every restore since the last call; their slots unpinned."""
        loads = [(slot, block) for block, slot in self._loads.items()]
        self._loads.clear()
        return loads

    def _free_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        pinned = set(self._loads.values())
        for block_hash, slot in self._slots.items():  # least recently used first
            if slot not in pinned:
                if self.on_evict is not None:
                    self.on_evict(block_hash, slot)
                del self._slots[block_hash]
                self.num_evicted_blocks += 1
                if self.on_drop is not None:
                    self.on_drop(block_hash)
                return slot
        return None
