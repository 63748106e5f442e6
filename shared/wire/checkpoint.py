"""The checkpoint codec: a request's output token ids so far, one Redis string that the worker
extends with APPEND every step (O(1)) and a claimer or a re-attaching gateway reads whole.

Encoding: each token id as an unsigned 32-bit integer, little-endian, whatever the host's byte
order (a checkpoint written on one machine is read on another).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

TOKEN_BYTES = 4
# An array typecode of exactly 4 bytes ('I' on every platform CPython supports; 'L' otherwise).
_TYPECODE = next(code for code in "IL" if array.array(code).itemsize == TOKEN_BYTES)
_SWAP = sys.byteorder != "little"


def encode_checkpoint(token_ids: Sequence[int]) -> bytes:
    """The bytes to APPEND for `token_ids` (ids must fit in uint32: vocabularies do)."""
    data = array.array(_TYPECODE, token_ids)
    if _SWAP:  # pragma: no cover - no big-endian machine in CI
        data.byteswap()
    return data.tobytes()


def decode_checkpoint(raw: bytes | None) -> list[int]:
    """The token ids of a checkpoint string; None (no checkpoint yet) is none. A trailing partial
    token cannot come from APPEND of whole tokens; it is ignored rather than failing a reader."""
    raw = raw or b""
    data = array.array(_TYPECODE)
    data.frombytes(raw[:len(raw) - len(raw) % TOKEN_BYTES])
    if _SWAP:  # pragma: no cover
        data.byteswap()
    return data.tolist()
