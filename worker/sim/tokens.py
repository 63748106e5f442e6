"""What a simulated worker answers: tokens and answer lengths that depend only on the request.

A simulated worker computes no logits. Its token at output position `i` of a request is a function
of the request's prompt tokens, a seed and `i` alone, so any simulated worker continues a stream
another one started with the tokens the first would have written (a resume or a handoff shows
no seam, as between real workers of one numerics). The tokens avoid the model's EOS and the
vocabulary's first ids (special tokens); a request ends at its `max_tokens`, or where `ignore_eos`
is off, at an answer length drawn for it from a seeded distribution (`--sim-answer-tokens`):

- `max`: no EOS; every answer runs to its `max_tokens` (or the model's context);
- `fixed:N`: N tokens;
- `uniform:A-B`: from A to B tokens, each length equally likely;
- `exp:MEAN`: exponential with that mean (at least 1 token), the long tail of chat answers.

The length is drawn from the same seed as the tokens, so every worker draws the same one; a
request's `min_tokens` is a floor.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

MASK64 = (1 << 64) - 1
FIRST_TOKEN = 3  # ids below are special tokens in the served tokenizers (<|endoftext|>, ...)


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit function of x."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def request_key(prompt_token_ids: list[int], seed: int) -> int:
    """A 64-bit key of the prompt and the seed: what every simulated worker derives a request's
    tokens and answer length from."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True), digest_size=8)
    digest.update(b"".join(t.to_bytes(4, "little") for t in prompt_token_ids))
    return int.from_bytes(digest.digest(), "little")


@dataclass(frozen=True)
class AnswerLengths:
    """A `--sim-answer-tokens` spec: kind `max`, `fixed`, `uniform` or `exp`, its numbers."""

    kind: str = "max"
    low: float = 0.0  # fixed: N; uniform: A; exp: the mean
    high: float = 0.0  # uniform: B

    @classmethod
    def parse(cls, spec: str) -> AnswerLengths:
        """ValueError saying the accepted forms for anything else."""
        text = spec.strip().lower()
        forms = "max, fixed:N, uniform:A-B or exp:MEAN (token counts, N and A at least 1)"
        kind, _, numbers = text.partition(":")
        try:
            if kind == "max" and not numbers:
                return cls()
            if kind == "fixed":
                n = int(numbers)
                if n >= 1:
                    return cls("fixed", n)
            if kind == "uniform":
                a, b = (int(x) for x in numbers.split("-"))
                if 1 <= a <= b:
                    return cls("uniform", a, b)
            if kind == "exp":
                mean = float(numbers)
                if mean >= 1 and math.isfinite(mean):
                    return cls("exp", mean)
        except ValueError:
            pass
        raise ValueError(f"--sim-answer-tokens {spec!r}: expected {forms}")

    def draw(self, key: int) -> int | None:
        """The answer length of the request with this key; None: no EOS (runs to max_tokens)."""
        if self.kind == "max":
            return None
        if self.kind == "fixed":
            return int(self.low)
        rng = random.Random(key)
        if self.kind == "uniform":
            return rng.randint(int(self.low), int(self.high))
        return max(1, round(rng.expovariate(1.0 / self.low)))


class AnswerTokens:
    """The tokens of simulated answers, for a vocabulary and its EOS ids."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], lengths: AnswerLengths,
                 seed: int = 0):
        self.eos = sorted(set(eos_token_ids))
        self.eos_token = self.eos[0] if self.eos else None
        self.ordinary = [t for t in range(FIRST_TOKEN, vocab_size) if t not in set(self.eos)] \
            if len(self.eos) > 0 and max(self.eos) >= FIRST_TOKEN else None
        self.low, self.span = FIRST_TOKEN, vocab_size - FIRST_TOKEN
        if self.span < 2:
            raise ValueError(f"a vocabulary of {vocab_size} tokens leaves none to simulate")
        self.lengths = lengths
        self.seed = seed

    def key(self, prompt_token_ids: list[int]) -> int:
        return request_key(prompt_token_ids, self.seed)

    def length(self, key: int, min_tokens: int = 0) -> int | None:
        drawn = self.lengths.draw(key)
        return None if drawn is None else max(drawn, min_tokens, 1)

    def token(self, key: int, position: int, length: int | None, ignore_eos: bool) -> int:
        """The token at output `position` (0-based): EOS at the drawn length's last position
        (unless the request ignores EOS), else an ordinary token."""
        if length is not None and not ignore_eos and position == length - 1 \
                and self.eos_token is not None:
            return self.eos_token
        x = _mix(key ^ _mix(position))
        if self.ordinary is not None:
            return self.ordinary[x % len(self.ordinary)]
        return self.low + x % self.span
