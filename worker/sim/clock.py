"""A simulated worker's step clock: it holds each step for its modelled time, and counts lag.

A step is modelled to take `seconds` (its cost model's figure) times the time scale `k`
(`--sim-time-scale`: where the host cannot keep up with real accelerators, every modelled duration
runs k times longer and whoever reports latencies divides them by k). The step's modelled time
starts when the engine starts scheduling it: the simulator's own scheduling and bookkeeping run
for real inside it, as a real engine's host-side work runs inside its step. The clock then sleeps
until the modelled end.

A step whose real end comes later than its modelled end by more than `LAG_TOLERANCE` of its
modelled time (and at least `LAG_FLOOR_S`) lagged: the host was too slow to play it (its own work,
or a thread that woke late). A run whose lagged steps exceed `INVALID_LAG_SHARE` of all steps does
not show what the modelled hardware would do: its report says it is invalid (`SimLag.valid`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

LAG_TOLERANCE = 0.10  # of a step's modelled (scaled) time
LAG_FLOOR_S = 0.002  # a lag below this is the sleep's own jitter, never counted
INVALID_LAG_SHARE = 0.05  # a run with more lagged steps than this share is not valid


@dataclass(frozen=True)
class SimLag:
    """Steps played and how many lagged, with the worst lag (real seconds)."""

    steps: int = 0
    lagged: int = 0
    max_lag_s: float = 0.0

    @property
    def share(self) -> float:
        return self.lagged / self.steps if self.steps else 0.0

    @property
    def valid(self) -> bool:
        return self.share <= INVALID_LAG_SHARE

    def plus(self, other: SimLag) -> SimLag:
        return SimLag(self.steps + other.steps, self.lagged + other.lagged,
                      max(self.max_lag_s, other.max_lag_s))


class StepClock:
    """Plays steps at their modelled time, scaled by `time_scale`."""

    def __init__(self, time_scale: float = 1.0, clock=time.perf_counter,
                 sleep=time.sleep):
        if not time_scale > 0:
            raise ValueError(f"the simulation's time scale must be > 0; got {time_scale}")
        self.time_scale = time_scale
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()  # the heartbeat thread reads the counts
        self._lag = SimLag()

    def now(self) -> float:
        return self._clock()

    def play(self, started: float, modelled_s: float) -> float:
        """Hold the step that started at `started` (this clock's time) until its modelled end;
        the real seconds it took."""
        end = started + modelled_s * self.time_scale
        now = self._clock()
        if end > now:
            self._sleep(end - now)
            now = self._clock()
        lag = now - end
        late = lag > max(LAG_FLOOR_S, LAG_TOLERANCE * modelled_s * self.time_scale)
        with self._lock:
            self._lag = SimLag(self._lag.steps + 1, self._lag.lagged + late,
                               max(self._lag.max_lag_s, lag))
        return now - started

    def lag(self) -> SimLag:
        with self._lock:
            return self._lag
