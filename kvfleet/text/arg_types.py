"""argparse value types for the operator commands: each turns one flag's text into a checked value
or raises `argparse.ArgumentTypeError`, so a bad value ends in argparse's usage error (exit 2)."""

from __future__ import annotations

import argparse
import math
import re

from kvfleet.shared.byte_size import parse_bytes

# Decimal multipliers for counts (parameters, tokens, tokens/s): "20B" = 20e9, "8k" = 8000.
_COUNT_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def count(text: str) -> float:
    """'20e9', '20B', '135M', '8k', '2893519' -> a non-negative number."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]?)\s*", text)
    if not match or match.group(2).lower() not in _COUNT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (use e.g. 20e9, 20B, 8k)")
    return float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).lower()]


def positive_count(text: str) -> float:
    value = count(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return value


def positive_int(text: str) -> int:
    value = count(text)
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1: {text!r}")
    return int(value)


def non_negative_int(text: str) -> int:
    value = count(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0: {text!r}")
    return int(value)


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0: {text!r}")
    return value


def positive_float_or_inf(text: str) -> float:
    """A rate multiplier: any positive number, or 'inf' for 'everything at once'."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0 (or 'inf'): {text!r}")
    return value


def fraction(text: str) -> float:
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1: {text!r}")
    return value


def size_bytes(text: str) -> int:
    """'80GB' -> 80_000_000_000 (decimal units, as the seed uses); '0.5MB' -> 500_000."""
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """'2000,8000,16k' -> [2000, 8000, 16000]."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list: {text!r}")
    return [positive_int(item) for item in items]


def positive_float_list(text: str) -> list[float]:
    """'0.25,0.5,1,2' -> [0.25, 0.5, 1.0, 2.0]."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list: {text!r}")
    return [positive_float(item) for item in items]


def context_mix(text: str) -> list[tuple[int, float]]:
    """'2000:0.5,8000:0.4,16000:0.1' -> [(2000, 0.5), (8000, 0.4), (16000, 0.1)], weights
    normalised to sum to 1."""
    pairs = []
    for item in (part.strip() for part in text.split(",")):
        tokens_text, sep, weight_text = item.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected TOKENS:WEIGHT, got {item!r} in {text!r}")
        pairs.append((positive_int(tokens_text), positive_float(weight_text)))
    total = sum(weight for _, weight in pairs)
    return [(tokens, weight / total) for tokens, weight in pairs]


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    return value


def http_url(text: str) -> str:
    """An http(s) base URL with a host: 'http://127.0.0.1:8000/' -> 'http://127.0.0.1:8000'."""
    import httpx

    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r} ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"expected http://HOST[:PORT], got {text!r}")
    return text.rstrip("/")
