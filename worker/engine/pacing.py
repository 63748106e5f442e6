"""The promised pace (pace.py) in the engine's step lifecycle (lifecycle.py): every step's work
and time feed its step-cost fit, every stream's new tokens its time between tokens."""

from __future__ import annotations

from kvfleet.worker.engine.core.lifecycle import Feature, Samples
from kvfleet.worker.engine.core.model_runner import StepLogits
from kvfleet.worker.engine.core.pace import Pace, step_features
from kvfleet.worker.engine.core.scheduler import SchedulerOutput, TokenEmission


class Pacing(Feature):
    def __init__(self, pace: Pace):
        self.pace = pace

    def executed(self, sched: SchedulerOutput, step: StepLogits, samples: Samples,
                 start: float, seconds: float) -> None:
        self.pace.observe(step_features(sched), start, seconds)

    def emitted(self, emissions: list[TokenEmission]) -> None:
        for emission in emissions:
            if emission.token_ids:
                self.pace.emitted(emission.seq, len(emission.token_ids))
