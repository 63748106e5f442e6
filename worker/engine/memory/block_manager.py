"""Which KV blocks each sequence holds: block tables, reference counts, free list, prefix cache.

Pure bookkeeping over block ids `0 .. num_blocks-1` (the tensors live in `kv_cache.py`); no torch.

Prefix caching: a *full* block whose KV is computed is published under a hash chained from its
parent block's hash and its own token ids (shared/wire/prefix_hash.py, from a root naming the
served model, or the model and a request's LoRA adapter: the gateways' router hashes prompts the
same way), so equal hashes mean equal token prefixes under the same weights (an edit anywhere earlier changes every later hash). A block whose reference count drops
to 0 keeps its hash and content and waits in an LRU list; it is evicted only when a new block is
needed and no never-cached block is free. Blocks are shared only when full and are never written
again, so a sequence never changes KV another sequence reads. Within the step being formed, the
full blocks a prefill chunk fills are shared before they are published (`blocks_computed`, passed
to `find_cached_prefix`): a prompt admitted beside the chunk that computes its prefix reads those
keys from the pool, which every layer fills for the whole step before any row attends.

The host tier (kv_tier.py, `--kv-offloading-size`): with one, a cached block the pool evicts
is offered to it (`TierIndex.offload`), and a lookup that misses the pool goes on in the tier:
each further block it holds is brought back into a free pool block, published again and counted
as a hit (`prefix_host_hit_tokens` when a request takes it), its bytes copied in before the step.
The disk tier (`--kv-offloading-disk`), behind it: a block the host tier drops for room goes
there (`TierIndex.keep` from the host slot), and a lookup goes on there after the host tier
(`prefix_disk_hit_tokens`, within the host hits).

Blocks from a peer (worker/handoff/peer_prefixes.py): `install` publishes blocks another worker computed
under their hashes, taking free blocks for them as a restore does; they wait evictable, like any
cached block, until a request's lookup takes them (`prefix_peer_hit_tokens` then). `locate` says
where the cache holds a hash (a pool block or the tier), for a peer asking for it.

Announcements (prefix-affinity routing): every hash published to or evicted from the cache is
recorded as a net change since the last `drain_announcements`, which the worker sends to Redis,
with its tier: a block the pool evicts into the host tier is announced as moved there (the worker
still holds it), one the tier drops (or never took) as removed, one brought back as on device.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvfleet.shared.wire.prefix_hash import BlockHash, hash_block, root_hash

if TYPE_CHECKING:
    from kvfleet.worker.engine.memory.kv_tier import TierIndex


# where a held block is: the KV pool, the host tier, the disk tier behind it (kv_tier.py)
DEVICE, HOST, DISK = "device", "host", "disk"


class NetChange:
    """The net change of a set of hashes, each held in a tier (DEVICE or HOST) or not at all,
    since the last drain: only where an item was at the last drain and where it is now count,
    so a change undone in between cancels out (added then removed, removed then added again,
    offloaded to the host tier then restored). Callers state each move from where the item is
    (`add` one not held, `remove` one held in `tier`, `offload` one on device, `restore` one in
    the host tier)."""

    def __init__(self) -> None:
        # item -> (tier at the last drain, tier now); None: not held
        self._pending: dict[BlockHash, tuple[str | None, str | None]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def _move(self, item: BlockHash, before: str | None, after: str | None) -> None:
        first = self._pending[item][0] if item in self._pending else before
        if first == after:
            del self._pending[item]
        else:
            self._pending[item] = (first, after)

    def add(self, item: BlockHash) -> None:
        self._move(item, None, DEVICE)

    def remove(self, item: BlockHash, tier: str = DEVICE) -> None:
        self._move(item, tier, None)

    def offload(self, item: BlockHash) -> None:
        """Evicted from the pool, kept in the host tier."""
        self._move(item, DEVICE, HOST)

    def restore(self, item: BlockHash) -> None:
        """Brought back from the host tier into the pool."""
        self._move(item, HOST, DEVICE)

    def merge(self, later: NetChange) -> None:
        """Apply a later net change (a drained one) on top of this one."""
        for item, (before, after) in later._pending.items():
            self._move(item, before, after)

    def peek(self) -> tuple[list[BlockHash], list[BlockHash], list[BlockHash]]:
        """(stored, removed, host), the announcement's wire form, without clearing: `stored`
        the items now on device and those now in the host tier that were not held before (a
        reader that knows no tiers adds them too); `removed` those no longer held; `host` those
        now in the host tier (moved there, or new: then in `stored` too)."""
        pending = self._pending.items()
        return ([h for h, (before, now) in pending if now == DEVICE or (now and before is None)],
                [h for h, (_, now) in pending if now is None],
                [h for h, (_, now) in pending if now == HOST])

    def drain(self) -> NetChange:
        """The change since the last drain (its own NetChange); this one starts over empty."""
        drained = NetChange()
        drained._pending, self._pending = self._pending, {}
        return drained


class BlockManager:
    """Block tables (append-only per sequence), reference counts, free list and the prefix cache.

    `allocate_slots` returns None when memory is short; deciding whom to preempt is the
    scheduler's job. Every block a sequence holds comes back with `free(req_id)`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 root: BlockHash | None = None, tier: TierIndex | None = None,
                 disk: TierIndex | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root = root_hash() if root is None else root  # parent of every first block
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free_uncached: deque[int] = deque(range(num_blocks))  # ref 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; LRU first
        self._cached: dict[BlockHash, int] = {}  # published hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._hash_memo: dict[str, list[BlockHash]] = {}  # chained hashes of a seq's full blocks
        self._num_published: dict[str, int] = {}  # leading blocks of a table already in the cache
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.tier = tier  # the host tier of evicted blocks; None: evicted blocks are gone
        self.disk = disk  # the disk tier of blocks the host tier drops; None: they are gone
        self.prefix_disk_hit_tokens = 0  # of prefix_host_hit_tokens, those from the disk tier
        self._restored_disk: set[int] = set()  # of _restored, those read from the disk tier
        self.prefix_host_hit_tokens = 0  # of prefix_hit_tokens, those brought back from the tier
        self._restored: set[int] = set()  # blocks brought back that no request took yet
        self.prefix_peer_hit_tokens = 0  # of prefix_hit_tokens, those installed from a peer
        self._installed: set[int] = set()  # blocks installed from a peer that no request took yet
        # hashes published to / evicted from the cache / moved between its tiers since the last
        # drain_announcements; bounded: without drains only the hashes held, at most num_blocks
        # plus the tier's capacity
        self._announcements = NetChange()
        if tier is not None:
            tier.on_drop = self._tier_dropped
        if disk is not None:
            if tier is None:
                raise ValueError("the disk tier sits behind a host tier")
            tier.on_evict = disk.keep  # a slot the host tier reuses goes to disk first
            disk.on_drop = self._tier_dropped

    # ---- counts -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: never-cached free ones plus evictable cached ones."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently published in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_table(self, req_id: str) -> list[int]:
        """The sequence's blocks in position order (the live list: append-only, do not mutate)."""
        return self._tables.get(req_id, [])

    def holds(self, req_id: str) -> bool:
        return req_id in self._tables

    def num_shared_leading_blocks(self, req_id: str) -> int:
        """Leading blocks of the sequence that other sequences also hold."""
        count = 0
        for block in self._tables.get(req_id, ()):
            if self._ref_counts[block] < 2:
                break
            count += 1
        return count

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup ------------------------------------------------------------------

    def block_hashes(self, req_id: str, token_ids: list[int],
                     root: BlockHash | None = None) -> list[BlockHash]:
        """Chained hashes of every full block of `token_ids` from `root` (a request's own, e.g.
        its adapter's; None: `self.root`), memoised per request (one root per request)."""
        memo = self._hash_memo.setdefault(req_id, [])
        bs = self.block_size
        for i in range(len(memo), len(token_ids) // bs):
            memo.append(hash_block(memo[i - 1] if i else (root or self.root),
                                   token_ids[i * bs:(i + 1) * bs]))
        return memo

    def set_root(self, root: BlockHash) -> None:
        """Hash from another root (the served model's: `prefix_hash.root_hash(model)`). Only
        while nothing was hashed yet, since hashes of the old root would never match again."""
        if root == self.root:
            return
        if self._cached or self._hash_memo:
            raise ValueError("the prefix root can change only before any block is hashed")
        self.root = root

    def num_cached_leading_blocks(self, token_ids: list[int],
                                  root: BlockHash | None = None) -> int:
        """How many leading full blocks of `token_ids` (hashed from `root`, default
        `self.root`) the cache holds now (no lookup is recorded and nothing is memoised: a
        question about a prompt that is not here)."""
        if not self.enable_prefix_caching:
            return 0
        count, parent, bs = 0, root or self.root, self.block_size
        for i in range(len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            if parent not in self._cached:
                break
            count += 1
        return count

    def num_held_leading_blocks(self, hashes: list[BlockHash]) -> int:
        """How many of `hashes` (a prompt's chained block hashes, in order) the cache holds from
        the first on, in the pool or the host tier."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._cached and self._tier_of(block_hash) is None:
                break
            count += 1
        return count

    def _tier_of(self, block_hash: BlockHash) -> TierIndex | None:
        """The tier beyond the pool holding `block_hash` (the host tier first), or None."""
        for tier in (self.tier, self.disk):
            if tier is not None and tier.holds(block_hash):
                return tier
        return None

    def locate(self, block_hash: BlockHash) -> tuple[str, int] | None:
        """Where the cache holds `block_hash`: (DEVICE, pool block) or (HOST, tier slot); None
        when it holds it in neither. Between steps only (a slot is reused at an eviction)."""
        block = self._cached.get(block_hash)
        if block is not None:
            return DEVICE, block
        tier = self._tier_of(block_hash)
        if tier is None:
            return None
        return (HOST if tier is self.tier else DISK), tier.slot_of(block_hash)

    def install(self, hashes: list[BlockHash], keep: list[BlockHash] = ()) -> list[int]:
        """Publish blocks a peer computed: a free pool block for each of `hashes` in order up
        to the first the cache holds already or the first with no free block left (a block in
        use stays in use); returns the blocks taken, which the caller fills before the next
        step. Each waits evictable, most recently used, until a request takes it. `keep`
        (cached blocks before them, the prompt's own) are touched first, so taking free blocks
        evicts other prefixes before them."""
        if not self.enable_prefix_caching:
            return []
        kept = set()
        for block_hash in keep:
            block = self._cached.get(block_hash)
            if block is not None and block in self._evictable:
                self._evictable.move_to_end(block)
                kept.add(block)
        # the room: never-cached free blocks and evictable ones other than `keep`'s (least
        # recently used before them); a block installed here joins the evictable ones after
        # them and must not be taken again by this call (its bytes are not written yet)
        room = len(self._free_uncached) + len(self._evictable) - len(kept)
        taken: list[int] = []
        for block_hash in hashes:
            if block_hash in self._cached or len(taken) >= room:
                break
            block = self._take_free_block()
            if block_hash in self._cached:  # cannot happen: a free block holds no new hash
                self._free_uncached.appendleft(block)
                break
            self._cached[block_hash] = block
            self._block_hash[block] = block_hash
            self._announcements.add(block_hash)
            self._evictable[block] = None
            self._installed.add(block)
            taken.append(block)
        return taken

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now (a worker's whole announcement, at its start)."""
        return list(self._cached)

    def host_hashes(self) -> list[BlockHash]:
        """Every hash the host or disk tier holds that the pool does not (announced in the host
        tier: the router weighs the two alike)."""
        held = dict.fromkeys(h for tier in (self.tier, self.disk) if tier is not None
                             for h in tier.hashes())
        return [h for h in held if h not in self._cached]

    def drain_announcements(self) -> NetChange:
        """The hashes published to, evicted from and moved between the tiers of the cache since
        the last drain, as a net change (a hash published and evicted in between is not in it;
        `.peek()` gives its wire form)."""
        return self._announcements.drain()

    def _tier_dropped(self, block_hash: BlockHash) -> None:
        """A tier dropped `block_hash` for room: gone unless the pool or another tier holds it
        (the host tier's drop went to the disk tier first)."""
        if block_hash in self._cached:
            return
        if self._tier_of(block_hash) is None:  # the dropping tier no longer lists it
            self._announcements.remove(block_hash, HOST)

    def find_cached_prefix(self, req_id: str, token_ids: list[int],
                           root: BlockHash | None = None,
                           computing: Mapping[BlockHash, int] | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of `token_ids`.

        At most `(len(token_ids) - 1) // block_size` blocks: at least the last token is always
        computed (its logits give the next token), and a block that would be partly recomputed is
        not shared, because recomputing writes into the block. `computing`: blocks the step being
        formed computes for other sequences (`blocks_computed`), shared as if cached.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        spare = self.num_free_blocks  # free blocks that are not among the hits
        live = 0  # hits other sequences hold: the request would not take them from the free ones
        for block_hash in self.block_hashes(req_id, token_ids, root)[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None and computing:
                block = computing.get(block_hash)
            # from the tier only while the whole request would fit: a request left waiting
            # would bring blocks back for others to evict again
            if (block is None and self.tier is not None and spare > 0
                    and self.blocks_for_tokens(len(token_ids)) - live <= self.num_free_blocks):
                block = self._restore(block_hash)
            if block is None:
                break
            if self.tier is not None:
                if self._ref_counts[block] == 0:
                    # most recently used: the restores after it take other blocks
                    self._evictable.move_to_end(block)
                    spare -= 1
                else:
                    live += 1
            hits.append(block)
        return hits

    def blocks_computed(self, req_id: str, token_ids: list[int], end: int,
                        root: BlockHash | None = None) -> dict[BlockHash, int]:
        """The full blocks a chunk of the sequence ending at position `end` fills that the
        cache does not hold yet: hash -> block. Published only after the step
        (`cache_full_blocks`); within the step they are another sequence's to share, since
        every layer writes the step's keys and values into the pool before any row attends."""
        if not self.enable_prefix_caching:
            return {}
        table = self._tables[req_id]
        start = self._num_published.get(req_id, 0)
        stop = min(end // self.block_size, len(table), len(token_ids) // self.block_size)
        if stop <= start:
            return {}
        hashes = self.block_hashes(req_id, token_ids, root)
        return {hashes[i]: table[i] for i in range(start, stop) if hashes[i] not in self._cached}

    def _restore(self, block_hash: BlockHash) -> int | None:
        """A free block published again as `block_hash`, filled from the host (or disk) tier
        before the step (the block stays free, evictable, until a request takes it); None if
        neither tier holds it."""
        if self._tier_of(block_hash) is None:
            return None
        block = self._take_free_block()
        # the block it evicted may have pushed the hash from the host tier to disk, or out
        tier = self._tier_of(block_hash)
        if tier is None:
            self._free_uncached.appendleft(block)
            return None
        self._cached[block_hash] = block
        self._block_hash[block] = block_hash
        self._announcements.restore(block_hash)
        self._evictable[block] = None
        self._restored.add(block)
        if tier is self.disk:
            self._restored_disk.add(block)
        tier.restore(block_hash, block)
        return block

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queried_tokens += num_queried_tokens
        self.prefix_hit_tokens += num_hit_tokens

    # ---- allocation ---------------------------------------------------------------------------

    def num_blocks_to_take(self, req_id: str, num_tokens: int, cached_blocks: list[int] = ()) -> int:
        """Free blocks an allocation covering `num_tokens` positions would consume."""
        held = len(self._tables.get(req_id, ())) + len(cached_blocks)
        new = max(0, self.blocks_for_tokens(num_tokens) - held)
        revived = sum(1 for b in cached_blocks if self._ref_counts[b] == 0)
        return new + revived

    def allocate_slots(self, req_id: str, num_tokens: int,
                       cached_blocks: list[int] = ()) -> list[int] | None:
        """Grow the sequence's table to cover positions `[0, num_tokens)`; None if short.

        `cached_blocks` (only when the sequence holds no blocks yet) are prefix-cache hits that
        become the head of its table. On None nothing changed.
        """
        if cached_blocks and self._tables.get(req_id):
            raise ValueError(f"{req_id}: cached blocks can only start a block table")
        if self.num_blocks_to_take(req_id, num_tokens, cached_blocks) > self.num_free_blocks:
            return None
        table = self._tables.setdefault(req_id, [])
        for block in cached_blocks:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
                if block in self._restored:
                    self._restored.discard(block)
                    self.prefix_host_hit_tokens += self.block_size
                    if block in self._restored_disk:
                        self._restored_disk.discard(block)
                        self.prefix_disk_hit_tokens += self.block_size
                elif block in self._installed:
                    self._installed.discard(block)
                    self.prefix_peer_hit_tokens += self.block_size
            self._ref_counts[block] += 1
            table.append(block)
        if cached_blocks:
            self._num_published[req_id] = len(cached_blocks)
        for _ in range(self.blocks_for_tokens(num_tokens) - len(table)):
            block = self._take_free_block()
            self._ref_counts[block] = 1
            table.append(block)
        return table

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Release the sequence's blocks past those covering positions `[0, num_tokens)`:
        slots reserved for proposed tokens that were not accepted. Such a block was never
        published (it holds no full block of computed tokens), so it is simply free again."""
        table = self._tables.get(req_id)
        keep = self.blocks_for_tokens(num_tokens)
        while table is not None and len(table) > keep:
            block = table.pop()
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                assert self._block_hash[block] is None, "a trimmed block was published"
                self._free_uncached.append(block)

    def _take_free_block(self) -> int:
        if self._free_uncached:
            return self._free_uncached.popleft()
        block, _ = self._evictable.popitem(last=False)  # least recently used cached block
        block_hash = self._block_hash[block]
        if self._cached.get(block_hash) == block:
            del self._cached[block_hash]
            if self.tier is not None:
                # brought back from disk this step and never filled: its bytes are still there
                if self.disk is None or not self.disk.cancel_load(block):
                    self.tier.offload(block_hash, block)
                self._restored.discard(block)
                self._restored_disk.discard(block)
            self._installed.discard(block)
            if self._tier_of(block_hash) is not None:
                self._announcements.offload(block_hash)
            else:
                self._announcements.remove(block_hash)
        self._block_hash[block] = None
        return block

    def cache_full_blocks(self, req_id: str, token_ids: list[int], num_computed_tokens: int,
                          root: BlockHash | None = None) -> None:
        """Publish the sequence's full blocks whose KV is computed (first publisher wins),
        hashed from `root` (None: `self.root`)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[req_id]
        start = self._num_published.get(req_id, 0)
        end = min(num_computed_tokens // self.block_size, len(table))
        if end <= start:
            return
        hashes = self.block_hashes(req_id, token_ids, root)
        for i in range(start, end):
            block, block_hash = table[i], hashes[i]
            if block_hash not in self._cached and self._block_hash[block] is None:
                self._cached[block_hash] = block
                self._block_hash[block] = block_hash
                self._announcements.add(block_hash)
        self._num_published[req_id] = end

    def free(self, req_id: str, forget: bool = True) -> int:
        """Release every block of the sequence; returns how many it held.

        Tail blocks are released first so that, among equally old entries, the LRU evicts a
        sequence's last blocks before its (more shareable) first ones. `forget=False` keeps the
        memoised hashes (a preempted sequence will look its prefix up again).
        """
        table = self._tables.pop(req_id, [])
        self._num_published.pop(req_id, None)
        if forget:
            self._hash_memo.pop(req_id, None)
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free_uncached.append(block)
        return len(table)

    def check_invariants(self) -> None:
        """Raise AssertionError if the counts disagree (tests and debugging)."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                refs[block] += 1
        assert refs == self._ref_counts, "reference counts disagree with block tables"
        free = set(self._free_uncached) | set(self._evictable)
        assert len(free) == len(self._free_uncached) + len(self._evictable)
        assert free == {b for b in range(self.num_blocks) if refs[b] == 0}
        for block_hash, block in self._cached.items():
            assert self._block_hash[block] == block_hash
        assert all(self._block_hash[b] is not None for b in self._evictable)
