"""Prefix blocks copied between engines: a peer's cache as a tier of this one's.

A worker that admits a request whose prompt opening another worker holds can take those blocks
over the transfer plane instead of computing them (worker/handoff/peer_prefixes.py decides and fetches).
This is the engine's part:

- `export(hashes)`: between two steps, a host copy of the leading run of `hashes` this engine
  holds, in its pool or its host or disk tier (tiers/offloading.py), in the pool's own storage codes (an
  8-bit pool's blocks with their scales), block-major as a swapped-out sequence's copy is.
- `install(state, keep)`: between two steps, the copy's blocks published in this engine's
  prefix cache under the same hashes (`BlockManager.install`), their bytes written into free pool
  blocks at once; they wait evictable until a request's lookup takes them, and count as cached
  (`prefix_peer_hit_tokens`). A block holds the bytes the peer computed: a request continues as
  it would have there, which is the answer it gets here where the two engines' numerics agree
  (the worker takes blocks only from a peer with its own numerics fingerprint).

The copy means something only to an engine of the same layout (`SequenceMoves.layout`: model and
prefix root, dtype, KV format, block geometry); another is refused with HandoffError, nothing
changed. Not with tensor parallelism or a draft model (their other pools would need the same
copies): `gap` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfleet.shared.wire.prefix_hash import BlockHash
from kvfleet.worker.engine.core.handoff import (
    HandoffError, pack_tensors, state_blocks, unpack_tensors)
from kvfleet.worker.engine.memory.block_manager import DEVICE, HOST, BlockManager
from kvfleet.worker.engine.memory.kv_cache import HostBlocks, KVCachePool
from kvfleet.worker.engine.tiers.offloading import HostTier

_TENSORS = ("values", "scales")
KIND = "prefix"  # the header's kind: a prefix's blocks, not a sequence


@dataclass
class PrefixState:
    """The blocks of a prompt opening as they leave an engine: their hashes in chain order and a
    host copy of their KV ([layers, 2, KV heads, blocks, block size, head dim])."""

    layout: dict  # SequenceMoves.layout() of the engine that holds them
    hashes: list[BlockHash]
    values: torch.Tensor
    scales: torch.Tensor | None  # 8-bit KV formats

    @property
    def req_id(self) -> str:  # what the shared checks name in their errors
        return "a prefix"

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.scales)
                   if t is not None)

    def encode(self) -> tuple[bytes, list[memoryview]]:
        header = {"kind": KIND, "layout": self.layout, "hashes": list(self.hashes)}
        return pack_tensors(header, [("values", self.values), ("scales", self.scales)])

    @classmethod
    def decode(cls, header: bytes, payload) -> PrefixState:
        """HandoffError for anything but a well-formed prefix copy."""
        try:
            fields, tensors = unpack_tensors(header, payload, _TENSORS)
            hashes = fields["hashes"]
            if (fields.get("kind") != KIND or not isinstance(fields["layout"], dict)
                    or not all(isinstance(h, bytes) for h in hashes) or "values" not in tensors
                    or tensors["values"].dim() != 6 or tensors["values"].shape[3] != len(hashes)):
                raise ValueError("not a prefix's blocks")
        except HandoffError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise HandoffError(f"a malformed prefix copy: {exc!r}") from exc
        return cls(fields["layout"], [bytes(h) for h in hashes], tensors["values"],
                   tensors.get("scales"))


class PrefixCopies:
    """One engine's prefix blocks out to peers and in from them."""

    def __init__(self, pool: KVCachePool, block_manager: BlockManager, tier: HostTier | None,
                 layout: Callable[[], dict], moves_gap: Callable[[], str | None]):
        """`layout`, `moves_gap`: the engine's handoff layout and why no sequence can move
        (`SequenceMoves.layout`, `.gap`): a prefix copy matches as a sequence's does."""
        self.pool, self.block_manager, self.tier = pool, block_manager, tier
        self._layout, self._moves_gap = layout, moves_gap
        self.num_exported_blocks = 0
        self.num_installed_blocks = 0

    def gap(self) -> str | None:
        """None when prefixes can be copied in and out of this engine; else why not."""
        if not self.block_manager.enable_prefix_caching:
            return "prefix caching is off"
        gap = self._moves_gap()
        if gap is not None:
            return gap
        if self._layout().get("draft") is not None:
            return "a draft model's KV would need the same copies"
        return None

    def layout(self) -> dict:
        return self._layout()

    def num_held(self, hashes: list[BlockHash]) -> int:
        """Leading blocks of `hashes` held here, in the pool or the host tier."""
        return self.block_manager.num_held_leading_blocks(hashes)

    def export(self, hashes: list[BlockHash]) -> PrefixState | None:
        """A host copy of the leading run of `hashes` held here (between steps only); None when
        the first is not held or copies are off."""
        places = []
        for block_hash in hashes:
            place = self.block_manager.locate(block_hash)
            if place is None:
                break
            places.append(place)
        if not places or self.gap() is not None:
            return None
        pool_blocks = [index for tier, index in places if tier == DEVICE]
        from_pool = self.pool.copy_out(pool_blocks) if pool_blocks else None
        if len(pool_blocks) == len(places):
            values, scales = from_pool.values, from_pool.scales
        else:  # some from the host tier: assembled in chain order
            values, scales = self._assemble(places, from_pool)
        self.num_exported_blocks += len(places)
        return PrefixState(self.layout(), list(hashes[:len(places)]), values, scales)

    def _assemble(self, places: list[tuple[str, int]], from_pool: HostBlocks | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        slot_view = self.tier.values[0].unsqueeze(3)  # [layers, 2, KVH, 1, block size, D]
        values = torch.empty((*slot_view.shape[:3], len(places), *slot_view.shape[4:]),
                             dtype=slot_view.dtype)
        scales = None
        if self.tier.scales is not None:
            scale_view = self.tier.scales[0].unsqueeze(3)
            scales = torch.empty((*scale_view.shape[:3], len(places), *scale_view.shape[4:]),
                                 dtype=scale_view.dtype)
        pool_index = 0
        for i, (tier, index) in enumerate(places):
            if tier == DEVICE:
                values[:, :, :, i].copy_(from_pool.values[:, :, :, pool_index])
                if scales is not None:
                    scales[:, :, :, i].copy_(from_pool.scales[:, :, :, pool_index])
                pool_index += 1
            else:
                slots = self.tier if tier == HOST else self.tier.disk
                values[:, :, :, i].copy_(slots.values[index])
                if scales is not None:
                    scales[:, :, :, i].copy_(slots.scales[index])
        return values, scales

    def install(self, state: PrefixState, keep: list[BlockHash] = ()) -> int:
        """Publish the copy's blocks here (between steps only): those from its first up to the
        first already cached or the first with no free block; how many. `keep`: the prompt's
        blocks cached here before them, kept from eviction by this. HandoffError, nothing
        changed, for a copy of another layout."""
        gap = self.gap()
        if gap is not None:
            raise HandoffError(f"this engine takes no prefix copy: {gap}")
        layout = self.layout()
        if state.layout != layout:
            differing = sorted(k for k in state.layout.keys() | layout.keys()
                               if state.layout.get(k) != layout.get(k))
            raise HandoffError(f"a prefix copy of another layout (differing: {differing})")
        host = state_blocks(state, "values", "scales",
                            state.num_blocks * self.pool.block_size, self.pool)
        blocks = self.block_manager.install(state.hashes, list(keep))
        if blocks:
            taken = len(blocks)
            self.pool.copy_in(HostBlocks(host.values[:, :, :, :taken],
                                         None if host.scales is None
                                         else host.scales[:, :, :, :taken]), blocks)
        self.num_installed_blocks += len(blocks)
        return len(blocks)
