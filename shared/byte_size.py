"""Sizes in bytes as settings take them: `2GiB`, `512MB`, or a number of bytes."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator
from pydantic.fields import FieldInfo

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
               "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; plain integers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 2GiB, 512MB or a number of bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def binary_size_text(num_bytes: int) -> str:
    """4294967296 -> '4GiB': the largest binary unit that divides it (how defaults are shown)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


# A number of bytes, given as a size text or an integer.
ByteSize = Annotated[int, BeforeValidator(parse_bytes)]


def is_byte_size(field: FieldInfo) -> bool:
    return any(getattr(meta, "func", None) is parse_bytes for meta in field.metadata)
