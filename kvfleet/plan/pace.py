"""`kvfleet plan --step-cost`: a plan's streams and tokens/s per worker from a worker's measured
step-cost curve (shared/pace.py) instead of the `--streams` and `--gpu-tokens-per-s` guesses.

The curve comes from a JSON file (what a heartbeat's `step_cost` field holds, e.g. saved with
`redis-cli HGET kvf:worker:<id> step_cost`) or straight from a fleet's Redis: the named worker's
live heartbeat, else the first (by id) of the model's workers with a fitted curve.

A worker at pace decodes n streams and, at steady state, prefills the prompts of the streams that
replace those ending: a stream decodes for O steps (its answer) and needs its prompt's P tokens
prefilled once (only the uncached U = P x (1 - prefix share), the cached opening first), so a
step carries on average n x U / O prefill tokens and n x (U x (P - U) + U (U + 1) / 2) / O
prefill-context pairs. The streams at pace are the most n whose turn keeps the target ITL:

    (base + n x (decode_row + C x context_token + U/O x prefill_token
                 + (U (P - U) + U (U + 1) / 2) / O x prefill_context) + overhead) x margin
        <= target

(C: the context the streams are counted at), at n / turn output tokens/s: the plan sizes the
fleet from those. With P = 0 (or a curve without prefill coefficients) it is the decode-only
`curve.streams_at_pace(target, C)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from redis.exceptions import RedisError

from kvfleet.shared.pace import StepCostCurve, StepFeatures, most_that_fit
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.shared.wire.records import text

REDIS_SCHEMES = ("redis://", "rediss://")
REDIS_TIMEOUT_S = 5.0
STREAMS_LIMIT = 1 << 16  # shared/pace.py's: the most streams counted


class StepCostError(ValueError):
    """The curve cannot be read, or it fits no stream at the target: a usage error."""


@dataclass(frozen=True)
class CurveSource:
    """A curve and where it came from (`target_itl_ms`: the worker's promise, 0 from a file)."""

    curve: StepCostCurve
    source: str  # the file, or the Redis URL and worker id
    target_itl_ms: float = 0.0


@dataclass(frozen=True)
class Prefill:
    """The prompts a worker at pace prefills besides decoding: every stream that ends, after
    `output_tokens` steps, is replaced by one whose prompt of `prompt_tokens` is prefilled, the
    uncached part only (a `prefix_share` of it comes from the prefix cache, its opening)."""

    prompt_tokens: float
    output_tokens: float
    prefix_share: float = 0.0
    source: str = ""  # where the lengths came from, for the report

    @property
    def uncached_tokens(self) -> float:
        """Prompt tokens prefilled a request: the part after the cached opening."""
        return self.prompt_tokens * (1.0 - self.prefix_share)

    @property
    def tokens_per_stream(self) -> float:
        """Prefill tokens a step carries for each stream decoding, on average (U / O)."""
        return self.uncached_tokens / self.output_tokens

    @property
    def context_per_stream(self) -> float:
        """Prefill-context pairs (a prefill token x the positions it attends to) a step carries
        for each stream decoding, on average: a prompt's uncached U tokens after its cached
        P - U, as `StepFeatures.of_prefill(U, P - U)` counts them, over O steps."""
        uncached = self.uncached_tokens
        cached = self.prompt_tokens - uncached
        return (uncached * cached + uncached * (uncached + 1) / 2) / self.output_tokens

    def seconds_per_stream(self, curve: StepCostCurve) -> float:
        """The step time each decoding stream's share of the prefill adds on `curve`."""
        if self.uncached_tokens <= 0:
            return 0.0
        return (curve.prefill_token_s * self.tokens_per_stream
                + curve.prefill_context_s * self.context_per_stream)

    def as_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "prefix_share": self.prefix_share, "uncached_prompt_tokens": self.uncached_tokens,
                "prefill_tokens_per_stream_step": self.tokens_per_stream,
                "prefill_context_per_stream_step": self.context_per_stream,
                "prefill_source": self.source}


NO_PREFILL = Prefill(0, 1, source="not counted")


def turn_seconds(curve: StepCostCurve, streams: int, context_tokens: float,
                 prefill: Prefill = NO_PREFILL) -> float:
    """A turn of `streams` streams of `context_tokens` positions and their share of the prefill
    at steady state, overhead and margin in (with no prefill: `curve.turn_seconds` of the
    decode step, to the last bit)."""
    step = curve.step_seconds(StepFeatures.of_decode(streams, context_tokens))
    return (step + streams * prefill.seconds_per_stream(curve) + curve.overhead_s) * curve.margin


def streams_at_pace(curve: StepCostCurve, target_itl_s: float, context_tokens: float,
                    prefill: Prefill = NO_PREFILL, limit: int = STREAMS_LIMIT) -> int:
    """The most streams whose turn (`turn_seconds`, prefill in) stays within `target_itl_s`:
    0 when not one fits, `limit` when the turn does not grow with streams
    (`StepCostCurve.streams_at_pace`'s search, with the prefill)."""
    def fits(n: int) -> bool:
        return turn_seconds(curve, n, context_tokens, prefill) <= target_itl_s

    return most_that_fit(fits, limit)


@dataclass(frozen=True)
class MeasuredPace:
    """What the curve says one worker serves at the target: the plan's throughput inputs."""

    source: str
    target_itl_ms: float
    context_tokens: float  # KV positions per stream the streams were counted at
    streams: int
    tokens_per_s: float
    curve: StepCostCurve
    prefill: Prefill = NO_PREFILL
    streams_decode_only: int = 0  # the streams at pace were the prefill not counted

    @property
    def prefill_tokens_per_step(self) -> float:
        """Prefill tokens a step of the streams at pace carries, on average."""
        return self.streams * self.prefill.tokens_per_stream

    @property
    def prefill_share(self) -> float:
        """The share of a turn at pace the prefill takes (0: none counted)."""
        turn = turn_seconds(self.curve, self.streams, self.context_tokens, self.prefill)
        if turn <= 0:
            return 0.0
        return self.streams * self.prefill.seconds_per_stream(self.curve) * self.curve.margin / turn

    def as_json(self) -> dict:
        return {"source": self.source, "target_itl_ms": self.target_itl_ms,
                "context_tokens": self.context_tokens, "streams": self.streams,
                "tokens_per_s": self.tokens_per_s, "curve_steps": self.curve.steps,
                **self.prefill.as_json(),
                "prefill_tokens_per_step": self.prefill_tokens_per_step,
                "prefill_share": self.prefill_share,
                "streams_decode_only": self.streams_decode_only}


def read_curve(source: str, *, model: str | None = None, worker: str | None = None,
               keys: Keys | None = None) -> CurveSource:
    """The curve of `source`: a `redis://` URL (the fleet's heartbeats) or a JSON file."""
    if source.startswith(REDIS_SCHEMES):
        return _read_redis(source, model, worker, keys or Keys())
    if worker is not None:
        raise StepCostError("--worker names a worker of a Redis source (redis://host:port)")
    return _read_file(source)


def measure(found: CurveSource, target_itl_ms: float, context_tokens: float,
            prefill: Prefill = NO_PREFILL) -> MeasuredPace:
    """Streams and tokens/s one worker keeps at `target_itl_ms` with streams of
    `context_tokens` positions and their share of `prefill`; StepCostError when not one stream
    fits."""
    target_s = target_itl_ms / 1000.0
    curve = found.curve
    streams = streams_at_pace(curve, target_s, context_tokens, prefill)
    if streams == 0:
        fastest_ms = turn_seconds(curve, 1, context_tokens, prefill) * 1000
        with_prompts = (f" (with its share of the prefill of {prefill.uncached_tokens:,.0f}-token "
                        f"prompts for {prefill.output_tokens:,.0f}-token answers)"
                        if prefill.seconds_per_stream(curve) > 0 else "")
        raise StepCostError(
            f"a target ITL of {target_itl_ms:g} ms fits not one stream of "
            f"{context_tokens:,.0f} tokens: one stream's turn takes {fastest_ms:.1f} ms"
            f"{with_prompts} on the curve of {found.source}")
    tokens_per_s = streams / turn_seconds(curve, streams, context_tokens, prefill)
    return MeasuredPace(found.source, target_itl_ms, context_tokens, streams, tokens_per_s, curve,
                        prefill, streams_at_pace(curve, target_s, context_tokens))


def _read_file(path: str) -> CurveSource:
    try:
        data = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise StepCostError(f"cannot read {path}: {exc}") from None
    return CurveSource(_parse(data, path), path)


def _parse(data: str | bytes, where: str) -> StepCostCurve:
    try:
        curve = StepCostCurve.from_json(data)
    except ValueError as exc:
        raise StepCostError(f"{where}: {exc}") from None
    if not curve.fitted:
        raise StepCostError(f"{where}: the curve has seen no step yet (steps 0)")
    return curve


def _read_redis(url: str, model: str | None, worker: str | None, keys: Keys) -> CurveSource:
    """The named worker's curve, else the first (by id) of `model`'s live workers with one."""
    try:
        beats = _heartbeats(url, keys)
    except (RedisError, OSError, ValueError) as exc:  # ValueError: a malformed URL
        raise StepCostError(f"cannot read the heartbeats at {url}: {exc}") from None
    if worker is not None:
        beat = beats.get(worker)
        if beat is None:
            raise StepCostError(f"no live worker {worker} at {url} (live: "
                                f"{', '.join(beats) or 'none'})")
        if not beat.step_cost:
            raise StepCostError(f"worker {worker} has no step-cost curve yet (it fits one from "
                                "the steps it runs)")
        return CurveSource(_parse(beat.step_cost, f"worker {worker}"), f"{url} worker {worker}",
                           beat.target_itl_ms)
    for worker_id, beat in beats.items():
        if beat.step_cost and (model is None or beat.model == model):
            return CurveSource(_parse(beat.step_cost, f"worker {worker_id}"),
                               f"{url} worker {worker_id}", beat.target_itl_ms)
    of_model = f" of model {model}" if model else ""
    raise StepCostError(f"no live worker{of_model} at {url} has a step-cost curve yet")


def _heartbeats(url: str, keys: Keys) -> dict[str, Heartbeat]:
    """Every live worker's heartbeat by id, sorted (gateway/fleet/load.py's read, blocking)."""
    client = connect(url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S)
    try:
        names = sorted({text(k) for k in client.scan_iter(match=keys.worker_pattern(),
                                                          count=1000)})
        beats = {}
        for name in names:
            raw = client.hgetall(name)
            if raw:  # expired between SCAN and HGETALL: no worker
                beats[keys.worker_id(name)] = Heartbeat.decode(raw)
        return beats
    finally:
        client.close()
