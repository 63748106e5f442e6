"""Human-readable numbers for operator output: decimal byte units (1 GB = 1e9 bytes, as the seed
uses), thousands separators, and no trailing zeros ("40 GB", "0.5 MB", "62.5")."""

from __future__ import annotations

import math

_BYTE_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))


def format_number(value: float | None, max_decimals: int = 2) -> str:
    """1446.76 -> '1,446.76'; 40.0 -> '40'; 62.5 -> '62.5'; None -> '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "inf"
    text = f"{value:,.{max_decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_bytes(num_bytes: float) -> str:
    """500_000 -> '0.5 MB'; 40e9 -> '40 GB'; 23_040 -> '23.04 KB'; 512 -> '512 B'."""
    for scale, unit in _BYTE_UNITS:
        # From 0.1 MB up, say MB: the seed quotes KV per token as "0.5 MB".
        if abs(num_bytes) >= scale or (unit == "MB" and abs(num_bytes) >= scale / 10):
            return f"{format_number(num_bytes / scale, 3)} {unit}"
    return f"{format_number(num_bytes, 0)} B"


def format_money(amount: float | None) -> str:
    """0.3472 -> '$0.3472'; 3617.5 -> '$3,617.50'."""
    if amount is None:
        return "-"
    if abs(amount) < 1:
        return f"${amount:.4f}"
    return f"${amount:,.2f}"


def format_seconds(value_s: float | None) -> str:
    """0.0123 -> '12.3 ms'; 2.5 -> '2.5 s'."""
    if value_s is None:
        return "-"
    if abs(value_s) < 1:
        return f"{format_number(value_s * 1000, 1)} ms"
    return f"{format_number(value_s, 2)} s"
