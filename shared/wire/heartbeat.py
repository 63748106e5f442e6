"""A worker's heartbeat (`Keys.worker`): a hash with a TTL, rewritten every heartbeat interval.
While it exists the worker is alive; the dashboard shows it, backpressure sums its tokens/s.

Stored as a flat hash of decimal strings (what HSET makes of numbers). Decoding never fails:
a missing or malformed field reads as its default, so a reader survives a writer of another
version.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvfleet.shared.wire.records import RawFields, text


@dataclass(frozen=True)
class Heartbeat:
    model: str  # the served model id
    ts: float  # unix time of this beat
    blocks_total: int = 0  # KV blocks of the pool
    blocks_free: int = 0  # free KV blocks (cached ones that could be evicted included)
    running: int = 0  # requests decoding
    waiting: int = 0  # requests admitted but not yet running
    preemptions: int = 0  # since start
    swap_preemptions: int = 0  # of which kept their KV in host memory
    generated_tokens: int = 0  # since start
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # ... and found there
    spec_draft_tokens: int = 0  # speculative proposals verified, since start
    spec_accepted_tokens: int = 0  # ... and accepted
    tokens_per_s: float = 0.0  # output tokens per second, recent
    metrics_url: str = ""  # the worker's Prometheus endpoint ("" = none)
    block_size: int = 0  # token positions per KV block (the router hashes prompts by it)
    max_running: int = 0  # the most requests it runs at once (0: unknown)
    own_queue: int = 0  # entries waiting in its own streams (routed to it, not yet taken)
    model_source: str = ""  # what it loaded (--model: a directory or local id): gateways load
    # the model's tokenizer from it when a request first names the model
    loras: str = ""  # LoRA adapters held in its memory, comma-separated, most recent first
    role: str = "both"  # prefill | decode | both (--role): what it takes from the fleet
    draining: int = 0  # 1 while it drains: it takes nothing new; its streams move to peers
    handoff_addr: str = ""  # host:port of its KV transfer plane ("" = it hands nothing off)
    handoffs_out: int = 0  # streams handed to peers with their KV, since start
    handoffs_in: int = 0  # streams taken from peers with their KV, since start
    # The promised pace (--target-itl-ms / --target-ttft-ms; 0: none) and how it is kept:
    target_itl_ms: float = 0.0  # longest time between two tokens of a stream promised (p99)
    target_ttft_ms: float = 0.0  # first token promised within (p99, from the enqueue)
    itl_p99_ms: float = 0.0  # measured here over the recent window (0: no sample yet)
    ttft_p99_ms: float = 0.0  # measured here over the recent window (0: no sample yet)
    pace_room: int = -1  # more streams it takes now and keeps the pace (-1: no pace promised)
    pace_streams: int = 0  # streams it runs at the pace with its current mix (0: no promise)
    step_cost: str = ""  # its fitted step-cost curve, shared/pace.py's StepCostCurve as JSON
    # its numerics fingerprint (worker/engine/model/numerics.py): workers with the same one continue
    # each other's streams bit for bit ("" = unknown: a worker older than the field)
    numerics: str = ""
    # a simulated worker (worker/sim/): its cost model ("" = a real worker), the steps it played
    # and those that ended later than modelled (over 5%: its figures do not hold)
    simulated: str = ""
    sim_steps: int = 0
    sim_lagged_steps: int = 0

    def encode(self) -> dict[str, str | int | float]:
        """The HSET mapping; an empty metrics_url is left out."""
        data = dataclasses.asdict(self)
        if not self.metrics_url:
            del data["metrics_url"]
        return data

    @classmethod
    def decode(cls, raw: RawFields) -> Heartbeat:
        values = {text(k): text(v) for k, v in raw.items()}
        kwargs = {}
        for spec in dataclasses.fields(cls):
            value = values.get(spec.name)
            if value is None or value == "":
                continue
            kwargs[spec.name] = _parse(spec.type, value)
        kwargs.setdefault("model", "")
        kwargs.setdefault("ts", 0.0)
        return cls(**kwargs)

    @property
    def blocks_used(self) -> int:
        return max(self.blocks_total - self.blocks_free, 0)


def _parse(kind: str, value: str) -> str | int | float:
    """`kind` is the field's annotation as written (`from __future__ import annotations`)."""
    if kind == "str":
        return value
    try:
        number = float(value)
        return int(number) if kind == "int" else number
    except (ValueError, OverflowError):  # not a number, or nan/inf for an int
        return 0 if kind == "int" else 0.0
