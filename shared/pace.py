"""The promised pace (`--target-itl-ms`, `--target-ttft-ms`) and a worker's step-cost curve.

A worker fits how long its steps take from the steps it runs (worker/engine/core/pace.py) and
publishes the fit in its heartbeat (`Heartbeat.step_cost`, this record as JSON). The gateways
and `kvfleet plan` read it back with `StepCostCurve.from_json` to tell how many streams a worker
runs at a given pace, without knowing how the fit was made.

A step's seconds are linear in its work:

    base + decode_row x rows + context_token x (KV positions the decode rows read)
         + prefill_token x prompt tokens + prefill_context x (prompt token x KV position pairs)
         + swap_block x KV blocks copied in or out

and a stream's time between two tokens is the loop's turn: `(step + overhead) x margin`, where
`overhead` is the loop's work around a step (publishing, reading Redis) and `margin` the ratio of
measured to predicted turns that the p99 stays under (the host's noise, learned).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepFeatures:
    """The work of one step, in the curve's units."""

    decode_rows: int = 0  # query tokens of decoding streams (a proposal counts as a row)
    context_tokens: int = 0  # KV positions those rows attend to, summed over the rows
    prefill_tokens: int = 0  # prompt (or recomputed) tokens computed
    prefill_context: int = 0  # sum over prefill tokens of the positions each attends to
    swap_blocks: int = 0  # KV blocks copied between host and device for the step

    def plus(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                    dataclasses.astuple(other))))

    def vector(self) -> tuple[float, ...]:
        """(1, rows, context, prefill, prefill context, swap): the regression's inputs."""
        return (1.0, float(self.decode_rows), float(self.context_tokens),
                float(self.prefill_tokens), float(self.prefill_context), float(self.swap_blocks))

    @staticmethod
    def of_decode(num_streams: int, context_per_stream: float) -> StepFeatures:
        """A decode step of `num_streams` streams of `context_per_stream` positions each."""
        return StepFeatures(num_streams, int(num_streams * context_per_stream))

    @staticmethod
    def of_prefill(num_tokens: int, start: int = 0) -> StepFeatures:
        """A prefill chunk of positions [start, start + num_tokens)."""
        return StepFeatures(prefill_tokens=num_tokens,
                            prefill_context=num_tokens * start + num_tokens * (num_tokens + 1) // 2)


COEFFICIENTS = ("base_s", "decode_row_s", "context_token_s", "prefill_token_s",
                "prefill_context_s", "swap_block_s")


def most_that_fit(fits, limit: int = 1 << 16) -> int:
    """The largest n in [1, limit] with fits(n), for a `fits` true up to some n and false after
    (doubling, then bisection): 0 when fits(1) is false, `limit` when fits(limit)."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    if high > limit:
        if fits(limit):
            return limit
        high = limit
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True)
class StepCostCurve:
    """Seconds of a worker's step as a function of its work (see the module's docstring)."""

    base_s: float = 0.0
    decode_row_s: float = 0.0
    context_token_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_context_s: float = 0.0
    swap_block_s: float = 0.0
    overhead_s: float = 0.0  # the loop's time around a step
    margin: float = 1.0  # measured / predicted turn, at the quantile the promise is kept to
    steps: int = 0  # steps the fit has seen

    @property
    def fitted(self) -> bool:
        return self.steps > 0

    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in COEFFICIENTS)

    def step_seconds(self, work: StepFeatures) -> float:
        """The predicted forward-and-sample time of a step doing `work`."""
        return sum(c * x for c, x in zip(self.coefficients(), work.vector()))

    def turn_seconds(self, work: StepFeatures) -> float:
        """The time between two tokens of a stream in steps doing `work`, at the quantile the
        promise is kept to (overhead and margin in)."""
        return (self.step_seconds(work) + self.overhead_s) * self.margin

    def streams_at_pace(self, target_itl_s: float, context_per_stream: float,
                        prefill_reserve_tokens: int = 0, limit: int = 1 << 16) -> int:
        """The most streams of `context_per_stream` positions a step can decode while a turn
        stays within `target_itl_s`, with room left for `prefill_reserve_tokens` of prefill
        (0 when not even one fits; `limit` when the curve does not grow with streams)."""
        reserve = StepFeatures.of_prefill(prefill_reserve_tokens, int(context_per_stream))

        def fits(n: int) -> bool:
            work = StepFeatures.of_decode(n, context_per_stream).plus(reserve)
            return self.turn_seconds(work) <= target_itl_s

        return most_that_fit(fits, limit)

    def tokens_per_s_at_pace(self, target_itl_s: float, context_per_stream: float) -> float:
        """Output tokens/s of a worker decoding `streams_at_pace` streams (0 when none fit)."""
        n = self.streams_at_pace(target_itl_s, context_per_stream)
        if n == 0:
            return 0.0
        return n / self.turn_seconds(StepFeatures.of_decode(n, context_per_stream))

    def to_json(self) -> str:
        return json.dumps({k: (round(v, 12) if isinstance(v, float) else v)
                           for k, v in dataclasses.asdict(self).items()},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes | dict) -> StepCostCurve:
        """The curve from its JSON (a dict too); ValueError when it is not one. Unknown keys are
        ignored (a newer writer), missing ones read as their defaults."""
        try:
            data = text if isinstance(text, dict) else json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a step-cost curve (JSON): {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("not a step-cost curve: a JSON object is expected")
        values = {}
        for spec in dataclasses.fields(cls):
            if spec.name not in data:
                continue
            value = data[spec.name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"step-cost curve: {spec.name} must be a number >= 0, "
                                 f"got {value!r}")
            values[spec.name] = int(value) if spec.type == "int" else float(value)
        if values.get("margin", 1.0) <= 0:
            raise ValueError("step-cost curve: margin must be > 0")
        return cls(**values)
