"""`kvfleet plan --step-cost`: a plan's streams and tokens/s per worker from a worker's measured
step-cost curve (shared/pace.py) instead of the `--streams` and `--gpu-tokens-per-s` guesses.

The curve comes from a JSON file (what a heartbeat's `step_cost` field holds, e.g. saved with
`redis-cli HGET kvf:worker:<id> step_cost`) or straight from a fleet's Redis: the named worker's
live heartbeat, else the first (by id) of the model's workers with a fitted curve. A worker
decodes `curve.streams_at_pace(target, context)` streams while every turn stays within the target
ITL, at `curve.tokens_per_s_at_pace(...)` output tokens/s: the plan sizes the fleet from those.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from redis.exceptions import RedisError

from kvfleet.shared.pace import StepCostCurve, StepFeatures
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.shared.wire.records import text

REDIS_SCHEMES = ("redis://", "rediss://")
REDIS_TIMEOUT_S = 5.0


class StepCostError(ValueError):
    """The curve cannot be read, or it fits no stream at the target: a usage error."""


@dataclass(frozen=True)
class CurveSource:
    """A curve and where it came from (`target_itl_ms`: the worker's promise, 0 from a file)."""

    curve: StepCostCurve
    source: str  # the file, or the Redis URL and worker id
    target_itl_ms: float = 0.0


@dataclass(frozen=True)
class MeasuredPace:
    """What the curve says one worker serves at the target: the plan's throughput inputs."""

    source: str
    target_itl_ms: float
    context_tokens: float  # KV positions per stream the streams were counted at
    streams: int
    tokens_per_s: float
    curve: StepCostCurve

    def as_json(self) -> dict:
        return {"source": self.source, "target_itl_ms": self.target_itl_ms,
                "context_tokens": self.context_tokens, "streams": self.streams,
                "tokens_per_s": self.tokens_per_s, "curve_steps": self.curve.steps}


def read_curve(source: str, *, model: str | None = None, worker: str | None = None,
               keys: Keys | None = None) -> CurveSource:
    """The curve of `source`: a `redis://` URL (the fleet's heartbeats) or a JSON file."""
    if source.startswith(REDIS_SCHEMES):
        return _read_redis(source, model, worker, keys or Keys())
    if worker is not None:
        raise StepCostError("--worker names a worker of a Redis source (redis://host:port)")
    return _read_file(source)


def measure(found: CurveSource, target_itl_ms: float, context_tokens: float) -> MeasuredPace:
    """Streams and tokens/s one worker keeps at `target_itl_ms` with streams of
    `context_tokens` positions; StepCostError when not one stream fits."""
    target_s = target_itl_ms / 1000.0
    streams = found.curve.streams_at_pace(target_s, context_tokens)
    if streams == 0:
        fastest_ms = found.curve.turn_seconds(StepFeatures.of_decode(1, context_tokens)) * 1000
        raise StepCostError(
            f"a target ITL of {target_itl_ms:g} ms fits not one stream of "
            f"{context_tokens:,.0f} tokens: one stream's turn takes {fastest_ms:.1f} ms on the "
            f"curve of {found.source}")
    return MeasuredPace(found.source, target_itl_ms, context_tokens, streams,
                        found.curve.tokens_per_s_at_pace(target_s, context_tokens), found.curve)


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
