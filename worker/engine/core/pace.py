"""The promised pace (`--target-itl-ms`, `--target-ttft-ms`): the largest group that keeps it.

The brief's rule: "the right group size is the largest one that still meets the pace promised to
users". The engine learns what its steps cost as it runs (`StepCostModel`: a linear fit of step
seconds to the step's decode rows, the KV they read, prefill tokens, their attention and swapped
blocks, exponentially forgotten, refit every step) and how far measured turns stray above the
fit's predictions (`QuantileTracker`: the margin that 99 % of turns stay under, the host's noise
learned). With those, every step (`Pace.budget`, used by the scheduler):

- the decoding streams' rows go first (they are the promise);
- a prefill chunk gets only the time left under the tightest ITL target of the decoding streams
  (at least `MIN_PREFILL_TOKENS` for the step's first chunk: a prompt always advances);
- a waiting stream is admitted only while a steady decode step of the group with it, plus that
  much prefill, still keeps every target (`Pace.admits`); an idle engine admits anyone. Prompts
  take what the decodes leave: while they wait, fewer streams decode (streams end, none join),
  so the split between the two finds itself (a tighter --target-ttft-ms keeps more of the
  prompts' work off a busy worker).

A group never grows faster than the fit has seen (`explored_rows`): at most a quarter (or two
streams) beyond the largest decode step measured, so a burst of arrivals cannot be admitted on
an extrapolation. The worker asks `Pace.room` how many more streams to read from Redis: a
request it cannot serve at pace stays in the queue, where another worker with room takes it.
Without targets nothing binds and the engine schedules as before (the fit still runs: the
heartbeat carries it, `kvfleet plan --step-cost` sizes a fleet from it).
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvfleet.shared.engine_config import PaceConfig
from kvfleet.shared.pace import StepCostCurve, StepFeatures
from kvfleet.shared.wire import SamplingParams

MIN_PREFILL_TOKENS = 1  # a step's first prefill chunk gets this much even at full pace
GROWTH_TOKENS = 128  # a stream's context is judged this far ahead (or to its max_tokens)
FIT_DECAY = 0.998  # per step: the fit remembers about the last 500 steps
PRIOR_WEIGHT = 100.0  # the warm-up sweep counts as this many steps, forever
RIDGE = 1e-2  # pins coefficients of work the steps have not varied (scaled units)
# The regression's inputs: (1, tokens, decode rows, context, prefill attention, swap), where
# tokens = decode rows + prefill tokens: a token costs the same in the linears whether it decodes
# or prefills, so the varied sizes of prefill chunks teach the per-token cost that a group's
# slowly changing size alone would not; a decode row adds its own (sampling, per-sequence work).
# Scaled to similar sizes.
SCALE = np.array([1.0, 1 / 256, 1 / 32, 1 / 32768, 1 / (1 << 20), 1 / 32])
MARGIN_QUANTILE = 0.99  # the ITL target is a p99
MARGIN_START = 1.25
LATENCY_WINDOW_S = 60.0
LATENCY_SAMPLES = 4096


def regressors(work: StepFeatures) -> np.ndarray:
    return np.array([1.0, work.decode_rows + work.prefill_tokens, work.decode_rows,
                     work.context_tokens, work.prefill_context, work.swap_blocks], dtype=float)


class StepCostModel:
    """Seconds of a step as a non-negative linear function of its `StepFeatures`: weighted least
    squares over `regressors`, each step's weight decaying by FIT_DECAY per later step, with a
    small ridge; `coefficients` are the curve's (per decode row, per prefill token, ...)."""

    def __init__(self, decay: float = FIT_DECAY, ridge: float = RIDGE):
        self.decay, self.ridge = decay, ridge
        n = len(SCALE)
        self._gram = np.zeros((n, n))
        self._moment = np.zeros(n)
        self.steps = 0
        self.max_decode_rows = 0  # the largest decode step seen: how far the fit has explored
        self._theta: np.ndarray | None = None
        # the warm-up's steps, never forgotten (`keep_as_prior`): where a serving group's size
        # barely varies, they still say what one more stream costs
        self._prior_gram = np.zeros((n, n))
        self._prior_moment = np.zeros(n)

    def keep_as_prior(self, weight: float = PRIOR_WEIGHT) -> None:
        """Keep the steps seen so far as a prior worth `weight` steps that never decays; the
        fit starts afresh on top of it."""
        total = self._gram[0, 0]  # the decayed count of steps (the constant regressor's)
        if total <= 0:
            return
        self._prior_gram = self._gram * (weight / total)
        self._prior_moment = self._moment * (weight / total)
        self._gram = np.zeros_like(self._gram)
        self._moment = np.zeros_like(self._moment)
        self._theta = None

    def observe(self, work: StepFeatures, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        x = regressors(work) * SCALE
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._moment = self.decay * self._moment + x * seconds
        self.steps += 1
        self.max_decode_rows = max(self.max_decode_rows, work.decode_rows)
        self._theta = None

    def coefficients(self) -> np.ndarray:
        """Seconds per unit of each of the curve's features (COEFFICIENTS' order: base, decode
        row, context token, prefill token, prefill context, swap block); non-negative, zeros
        before any step."""
        if self._theta is None:
            base, token, row, context, prefill_context, swap = self._solve() * SCALE
            self._theta = np.array([base, token + row, context, token, prefill_context, swap])
        return self._theta

    def _solve(self) -> np.ndarray:
        """Ridge least squares with every coefficient >= 0: solve, drop the negative ones, solve
        the rest again (six regressors: a few rounds at most)."""
        n = len(SCALE)
        theta = np.zeros(n)
        if self.steps == 0:
            return theta
        active = list(range(n))
        gram_all, moment_all = self._gram + self._prior_gram, self._moment + self._prior_moment
        while active:
            gram = gram_all[np.ix_(active, active)] + self.ridge * np.eye(len(active))
            solution = np.linalg.solve(gram, moment_all[active])
            if (solution >= 0).all():
                theta[active] = solution
                return theta
            active = [i for i, v in zip(active, solution) if v >= 0]
        return theta

    def predict(self, work: StepFeatures) -> float:
        return float(np.dot(self.coefficients(), work.vector()))


class QuantileTracker:
    """A running estimate of a quantile of a stream of ratios (stochastic approximation in log
    space: up by (q) x rate when a sample exceeds it, down by (1 - q) x rate otherwise)."""

    def __init__(self, quantile: float = MARGIN_QUANTILE, start: float = MARGIN_START,
                 rate: float = 0.05, low: float = 1.0, high: float = 8.0):
        self.quantile, self.rate, self.low, self.high = quantile, rate, low, high
        self.value = start

    def observe(self, ratio: float) -> None:
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        step = self.quantile if ratio > self.value else -(1 - self.quantile)
        self.value = min(max(self.value * math.exp(self.rate * step), self.low), self.high)


class LatencyWindow:
    """Latencies of the last LATENCY_WINDOW_S (at most LATENCY_SAMPLES), and their p99."""

    def __init__(self, clock=time.monotonic):
        self._samples: deque[tuple[float, float]] = deque(maxlen=LATENCY_SAMPLES)
        self._clock = clock
        self._p99: tuple[float, float] | None = None  # (computed at, value)

    def add(self, seconds: float) -> None:
        self._samples.append((self._clock(), seconds))

    def p99(self) -> float:
        """0 with no sample in the window; recomputed at most every half second (at once
        when the first samples come)."""
        now = self._clock()
        if self._p99 is not None and now - self._p99[0] < 0.5 and (self._p99[1] or not self._samples):
            return self._p99[1]
        while self._samples and now - self._samples[0][0] > LATENCY_WINDOW_S:
            self._samples.popleft()
        value = 0.0
        if self._samples:  # the sorted values' element at 0.99 n, by a partial sort
            values = np.fromiter((v for _, v in self._samples), float, len(self._samples))
            index = min(int(0.99 * len(values)), len(values) - 1)
            value = float(np.partition(values, index)[index])
        self._p99 = (now, value)
        return value


@dataclass(frozen=True)
class PaceReport:
    """What the heartbeat and the metrics show of the pace (milliseconds; 0: none)."""

    target_itl_ms: float
    target_ttft_ms: float
    itl_p99_ms: float
    ttft_p99_ms: float
    room: int  # more streams taken now at pace; -1: no pace promised
    streams: int  # streams run at pace with the current mix; 0: no promise
    curve: StepCostCurve

    def heartbeat_fields(self) -> dict:
        """The Heartbeat's pace fields (shared/wire/heartbeat.py)."""
        return {"target_itl_ms": self.target_itl_ms, "target_ttft_ms": self.target_ttft_ms,
                "itl_p99_ms": round(self.itl_p99_ms, 2), "ttft_p99_ms": round(self.ttft_p99_ms, 2),
                "pace_room": self.room, "pace_streams": self.streams,
                "step_cost": self.curve.to_json() if self.curve.fitted else ""}


class StepBudget:
    """One step's time under the tightest ITL target of its decoding streams: the scheduler
    adds its chunks' work and asks how much more fits."""

    def __init__(self, curve: StepCostCurve, limit_s: float, work: StepFeatures):
        self.curve, self.limit_s, self.work = curve, limit_s, work
        self.prefilled = False  # a prefill chunk is in the step (MIN_PREFILL_TOKENS given)

    def fits(self, extra: StepFeatures) -> bool:
        return self.curve.turn_seconds(self.work.plus(extra)) <= self.limit_s

    def add(self, extra: StepFeatures) -> None:
        self.work = self.work.plus(extra)

    def prefill_tokens(self, start: int, limit: int) -> int:
        """The most prompt tokens from position `start` (at most `limit`) that fit, taken."""
        def fits(n: int) -> bool:
            return self.fits(StepFeatures.of_prefill(n, start))

        if limit <= 0:
            return 0
        if fits(limit):
            tokens = limit
        else:
            low, high = 0, limit  # fits(low), not fits(high)
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if fits(middle) else (low, middle)
            tokens = low
        if not self.prefilled:
            tokens = max(tokens, min(MIN_PREFILL_TOKENS, limit))
        if tokens:
            self.prefilled = True
            self.add(StepFeatures.of_prefill(tokens, start))
        return tokens

    def lookahead(self, context: int, extra: int) -> int:
        """Proposal rows (at most `extra`) a decoding stream at `context` may add, taken."""
        rows = extra
        while rows > 0 and not self.fits(StepFeatures(rows, rows * (context + rows))):
            rows -= 1
        if rows:
            self.add(StepFeatures(rows, rows * (context + rows)))
        return rows


class Pace:
    """The engine's pace: targets, the step-cost fit, the latencies measured."""

    def __init__(self, config: PaceConfig, max_batched_tokens: int, clock=time.monotonic,
                 wall=time.time):
        self.target_itl_s = config.target_itl_ms / 1000
        self.target_ttft_s = config.target_ttft_ms / 1000
        floor = config.min_target_itl_ms if config.min_target_itl_ms is not None \
            else config.target_itl_ms
        self.floor_s = floor / 1000
        self.honours_requests = config.min_target_itl_ms is not None or config.target_itl_ms > 0
        self.max_batched_tokens = max_batched_tokens
        self.model = StepCostModel()
        self.margin = QuantileTracker()
        self.overhead_s = 0.0  # the loop's time between two steps, smoothed
        self.itl = LatencyWindow(clock)
        self.ttft = LatencyWindow(clock)
        self._clock, self._wall = clock, wall
        self._last_end: float | None = None
        self._prompt_tokens = 256.0  # a new stream's prompt, smoothed over admissions
        self._samples: tuple[list[float], list[float]] = ([], [])  # (itl, ttft) not yet taken
        self.deferred = 0  # admissions put off to keep the pace, since start

    # ---- targets ------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.target_itl_s > 0 or self.target_ttft_s > 0 or self.honours_requests

    def target_of(self, params: SamplingParams) -> float | None:
        """A stream's ITL target in seconds (None: none): its own within the floor, else the
        engine's."""
        asked = params.target_itl_ms
        if asked is None or not self.honours_requests:
            return self.target_itl_s or None
        if asked == 0:
            return None
        return max(asked / 1000, self.floor_s)

    def _tightest(self, seqs) -> float | None:
        targets = [t for t in (self.target_of(s.params) for s in seqs) if t is not None]
        return min(targets) if targets else None

    # ---- the scheduler's questions --------------------------------------------------------

    def curve(self) -> StepCostCurve:
        coefficients = self.model.coefficients()
        return StepCostCurve(*map(float, coefficients), overhead_s=self.overhead_s,
                             margin=self.margin.value, steps=self.model.steps)

    def budget(self, running) -> StepBudget | None:
        """This step's budget: the decoding streams' rows taken, the tightest of their targets
        as the limit; None when no decoding stream has a target (nothing binds)."""
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        limit = self._tightest(decoding) if self.model.steps else None
        if limit is None:
            return None
        work = StepFeatures(len(decoding), sum(s.num_tokens for s in decoding))
        return StepBudget(self.curve(), limit, work)

    def explored_rows(self) -> int:
        """The most decode rows a group may grow to on this fit's word."""
        seen = self.model.max_decode_rows
        return max(seen + 2, math.ceil(seen * 1.25))

    def _steady(self, seqs) -> StepFeatures:
        """A decode step of `seqs`, each judged GROWTH_TOKENS ahead (or to its max_tokens)."""
        context = sum(s.num_tokens + min(GROWTH_TOKENS, max(s.params.max_tokens
                                                             - s.num_output_tokens, 0))
                      for s in seqs)
        return StepFeatures(len(seqs), context)

    def admits(self, running, seq) -> bool:
        """Whether `seq` may join the running group: a steady decode step of the group with it,
        plus a minimal prefill, keeps the tightest target among them (an empty group takes
        anyone; without targets, or before any step is measured, nothing is refused)."""
        if not running:
            return True
        group = [*running, seq]
        limit = self._tightest(group)
        if limit is None or not self.model.steps:
            return True
        curve = self.curve()
        # its prompt's last chunk, the dearest (it attends to the whole prompt), still fits
        last_chunk = StepFeatures.of_prefill(MIN_PREFILL_TOKENS, seq.num_tokens)
        work = self._steady(group).plus(last_chunk)
        ok = len(group) <= self.explored_rows() and curve.turn_seconds(work) <= limit
        if not ok:
            self.deferred += 1
        return ok

    def room(self, running, waiting, max_running: int) -> int:
        """More streams this engine takes now at pace (-1: no pace promised): those a steady
        step of the group and them keeps the tightest target for (a new one judged by the
        engine's target and the prompts seen), none while the prompts held would keep a new
        one's first token past --target-ttft-ms. An empty engine takes at least one."""
        if not self.enabled:
            return -1
        held = [*running, *waiting]
        free = max(max_running - len(held), 0)
        if not self.model.steps:
            return free
        curve = self.curve()
        limit = self._tightest(held)
        if self.target_itl_s:
            limit = min(limit or math.inf, self.target_itl_s)
        room = free
        if limit is not None:
            steady = self._steady(held)
            newcomer = self._prompt_tokens + GROWTH_TOKENS
            cap = self.explored_rows() - len(held)
            n = 0
            while n < min(room, cap):
                work = steady.plus(StepFeatures(n + 1, int((n + 1) * newcomer))).plus(
                    StepFeatures.of_prefill(MIN_PREFILL_TOKENS, int(self._prompt_tokens)))
                if curve.turn_seconds(work) > limit:
                    break
                n += 1
            room = n
        if room and held and self.target_ttft_s and \
                self._first_token_s(curve, held) > self.target_ttft_s:
            room = 0
        return room if held else max(room, 1)

    def _first_token_s(self, curve: StepCostCurve, held) -> float:
        """When a new request's first token would come: the prompt tokens held here and its
        own, at the prefill the current decode load leaves per step."""
        backlog = sum(max(s.num_uncomputed_tokens - 1, 0) for s in held) + self._prompt_tokens
        decoding = [s for s in held if s.num_uncomputed_tokens <= 1]
        base = StepFeatures(len(decoding), sum(s.num_tokens for s in decoding))
        limit = self._tightest(decoding) or self.target_itl_s
        chunk = self.max_batched_tokens - len(decoding)
        if limit and chunk > 0:
            budget = StepBudget(curve, limit, base)
            chunk = budget.prefill_tokens(int(self._prompt_tokens), chunk)
        if chunk <= 0:
            return math.inf
        turn = curve.turn_seconds(base.plus(StepFeatures.of_prefill(chunk)))
        return math.ceil(backlog / chunk) * turn

    # ---- what the engine reports after each step --------------------------------------------

    def observe(self, work: StepFeatures, started: float, seconds: float) -> None:
        """A step that began at `started` (monotonic) took `seconds`: the loop's time since the
        last one, the margin of the turn over the fit's prediction, then the fit."""
        gap = None if self._last_end is None else started - self._last_end
        self._last_end = started + seconds
        if gap is not None and 0 <= gap < 1.0:
            self.overhead_s = gap if self.model.steps <= 1 else 0.9 * self.overhead_s + 0.1 * gap
            predicted = self.model.predict(work) + self.overhead_s
            if self.model.steps >= 8 and predicted > 0:
                self.margin.observe((gap + seconds) / predicted)
        self.model.observe(work, seconds)

    def forget_last_step(self) -> None:
        """The next step's gap from the last one is not the loop's (a warm-up ran between)."""
        self._last_end = None

    def admitted(self, seq) -> None:
        """A new stream joined: its prompt length feeds the guess of the next one's."""
        self._prompt_tokens = 0.9 * self._prompt_tokens + 0.1 * seq.num_prompt_tokens

    def emitted(self, seq, num_tokens: int) -> None:
        """`seq` got `num_tokens` new tokens now: a time between tokens (from its previous
        ones here), or its first token's time from its `arrival` (unix time; None: not
        measured, as for a resumed stream)."""
        now = self._clock()
        last, seq.last_emit_at = seq.last_emit_at, now
        if last is not None:
            self.itl.add(now - last)
            self._samples[0].append(now - last)
        elif seq.arrival is not None and seq.num_output_tokens == num_tokens:
            ttft = max(self._wall() - seq.arrival, 0.0)
            self.ttft.add(ttft)
            self._samples[1].append(ttft)

    def take_samples(self) -> tuple[list[float], list[float]]:
        """(times between tokens, first-token times) measured since the last call."""
        samples, self._samples = self._samples, ([], [])
        return samples

    def report(self, running, waiting, max_running: int) -> PaceReport:
        room = self.room(running, waiting, max_running)
        streams = 0
        if room >= 0 and self.target_itl_s:
            streams = len(running) + len(waiting) + room
        return PaceReport(self.target_itl_s * 1000, self.target_ttft_s * 1000,
                          self.itl.p99() * 1000, self.ttft.p99() * 1000, room, streams,
                          self.curve())


def step_features(sched) -> StepFeatures:
    """The work of a scheduled step (scheduler.SchedulerOutput)."""
    rows = context = prefill = prefill_context = 0
    for chunk in sched.chunks:
        known = chunk.num_tokens - len(chunk.draft)
        if known == 1 and chunk.emits_token:
            rows += chunk.num_tokens
            context += chunk.num_tokens * chunk.end
        else:
            prefill += chunk.num_tokens
            prefill_context += StepFeatures.of_prefill(chunk.num_tokens, chunk.start).prefill_context
    swap = sum(len(blocks) for _, blocks in sched.swap_in) + sum(
        len(blocks) for _, blocks in sched.swap_out)
    return StepFeatures(rows, context, prefill, prefill_context, swap)


def warm_up(engine, seed: int = 0) -> float:
    """--pace-warmup, before the first request: time a sweep of decode groups (1 to
    max_running streams, doubling, on 4-token prompts) and of prefill chunks (a quarter and the
    whole of max_batched_tokens), on random tokens, so the fit starts from measured steps;
    seconds spent. Nothing of it stays in the engine (the prompts skip the prefix cache;
    counters are put back)."""
    started = time.perf_counter()
    vocab_size, config = engine.model.config.vocab_size, engine.config.scheduler
    scheduler = engine.scheduler
    counters = (scheduler.num_generated_tokens, scheduler.num_prefill_tokens_computed)
    paced, scheduler.pace = scheduler.pace, None  # the sweep's groups are its own to choose
    rng = random.Random(seed)
    size, rounds = 1, []
    while size < config.max_running:
        rounds.append([4] * size)
        size *= 2
    rounds.append([4] * config.max_running)
    rounds += [[max(config.max_batched_tokens // 4, 2)], [config.max_batched_tokens]]
    for number, prompts in enumerate(rounds):
        for i, length in enumerate(prompts):
            params = SamplingParams(max_tokens=4 if len(prompts) > 1 else 2, temperature=0.0,
                                    ignore_eos=True, skip_prefix_cache=True)
            length = min(length, engine.max_model_len - params.max_tokens)
            engine.add_request(f"pace-warmup-{number}-{i}",
                               [rng.randrange(vocab_size) for _ in range(length)], params)
        while engine.has_unfinished():
            engine.step()
    scheduler.num_generated_tokens, scheduler.num_prefill_tokens_computed = counters
    scheduler.pace = paced
    engine.pace.forget_last_step()
    engine.pace.model.keep_as_prior()
    return time.perf_counter() - started
