"""The prefix cache's block hashes, defined once for the worker's block manager and the gateway's
router (docs/ARCHITECTURE.md, "Prefix-affinity routing").

A full block of `block_size` token ids is named by a 128-bit BLAKE2b chained from its parent
block's digest, so equal hashes mean equal token prefixes. The chain starts at a root made from
the model (and the LoRA adapter, `lora_root`) a request runs under: the same tokens under another
model or adapter never match. Workers announce a block by its *announce id*, the first 8 bytes of the digest (64 bits:
a collision among a fleet's few million blocks is improbable and would cost one mis-routed
request, never a wrong answer, because the worker's own cache compares full digests).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
DIGEST_BYTES = 16
ANNOUNCE_BYTES = 8  # one announce id, as sent and stored in Redis
_ROOT_PERSON = b"kvfleet-prefix"


def root_hash(model: str = "", adapter: str = "") -> BlockHash:
    """The parent of a prompt's first block: the model's (and the adapter's) name."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_ROOT_PERSON)
    h.update(model.encode())
    h.update(b"\0")
    h.update(adapter.encode())
    return h.digest()


def lora_root(model: str, lora: str = "", lora_path: str = "") -> BlockHash:
    """The root of a request's prompt: its model's, or under a LoRA adapter the adapter's, named
    by its registered name and directory (a name registered again from another directory is
    another adapter: its blocks must not match the old weights' KV)."""
    return root_hash(model, f"{lora}\0{lora_path}" if lora else "")


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """One block's digest from its parent's digest and its token ids."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash,
                 max_blocks: int | None = None) -> list[BlockHash]:
    """Chained digests of every full block of `token_ids` (at most `max_blocks`)."""
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    data = array("q", token_ids[:count * block_size]).tobytes()
    step = 8 * block_size
    out: list[BlockHash] = []
    parent = root
    for i in range(count):
        h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
        h.update(data[i * step:(i + 1) * step])
        parent = h.digest()
        out.append(parent)
    return out


def announce_id(block_hash: BlockHash) -> bytes:
    """The 8 bytes a block is announced and indexed by."""
    return block_hash[:ANNOUNCE_BYTES]


def pack_ids(hashes: Sequence[BlockHash]) -> bytes:
    """Announce ids of `hashes`, concatenated (what the ANNOUNCE_BLOCKS script splits)."""
    return b"".join(h[:ANNOUNCE_BYTES] for h in hashes)


def unpack_ids(packed: bytes) -> list[bytes]:
    """The announce ids in a `pack_ids` string."""
    n = ANNOUNCE_BYTES
    return [packed[i:i + n] for i in range(0, len(packed) - len(packed) % n, n)]
