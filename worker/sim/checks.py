"""The simulation's settings checked before anything loads (`kvfleet up`, `kvfleet worker`):
light, so that `kvfleet up` names a bad flag without importing the engine."""

from __future__ import annotations

from pathlib import Path

from kvfleet.shared.settings import WorkerSettings
from kvfleet.worker.sim.accelerators import accelerator
from kvfleet.worker.sim.tokens import AnswerLengths

WORKERS_PER_PROCESS = 32  # `kvfleet up` puts at most this many simulated workers in a process
HEARTBEAT_SOURCE = "worker:"  # --sim-step-cost worker:<id>: that worker's fitted curve
ONE_BYTE_KV = ("fp8", "int8")


def check_sim_settings(settings: WorkerSettings) -> None:
    """SystemExit naming the setting when the simulation's settings cannot work together
    (checked before anything loads, by `kvfleet up` and `kvfleet worker`)."""
    if not settings.simulated:
        return
    if bool(settings.sim_device) == bool(settings.sim_step_cost):
        raise SystemExit("kvfleet: simulated workers need exactly one cost model: --sim-device "
                         "(an accelerator's roofline) or --sim-step-cost (a measured curve)")
    try:
        if settings.sim_device:
            accelerator(settings.sim_device)
        AnswerLengths.parse(settings.sim_answer_tokens)
    except ValueError as exc:
        raise SystemExit(f"kvfleet: {exc}") from None
    source = settings.sim_step_cost
    if source and not source.startswith(HEARTBEAT_SOURCE) and not Path(source).is_file():
        raise SystemExit(f"kvfleet: --sim-step-cost {source!r}: no such file (or give "
                         f"{HEARTBEAT_SOURCE}<id> for a live worker's curve)")
    if settings.sim_workers > 1 and settings.handoff_port > 0:
        raise SystemExit("kvfleet: simulated workers of one process share its host: "
                         "--handoff-port must be 0 (a free port each) or -1 (off)")
    if settings.speculative_config is not None:
        raise SystemExit("kvfleet: simulated workers do not simulate speculative decoding "
                         "(--speculative-config)")
