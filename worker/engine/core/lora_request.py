"""What a request says about its adapter, the error a refused one raises, and the counters the
service reports (torch-free: the sequence and the scheduler import it)."""

from __future__ import annotations

from dataclasses import dataclass, field


class LoraLoadError(ValueError):
    """An adapter this engine will not serve (missing, malformed, of another base model, over
    max_lora_rank, or LoRA not enabled): raised by `Engine.add_request` before the request is
    queued; the message says why."""


@dataclass(frozen=True)
class LoraRequest:
    """The adapter a request runs under."""

    name: str  # what the fleet calls it (the request's `model`); the engine's cache key
    path: str  # the PEFT adapter directory on this worker
    # parent of the request's first block hash: `prefix_hash.lora_root(model, name, path)`, computed
    # by the caller, so a prompt's blocks under this adapter never match the base model's. It
    # names the weights: a name served again from another directory needs another root, or its
    # prompts reuse KV the old weights computed
    prefix_root: bytes


@dataclass
class LoraStats:
    """The engine's adapters, for the service's heartbeat and metrics."""

    loaded: list[str] = field(default_factory=list)  # in host memory, most recently used first
    in_slots: list[str] = field(default_factory=list)  # on the device now (a step's at most)
    loads_total: dict[str, int] = field(default_factory=dict)  # adapter name -> loads
    evictions_total: dict[str, int] = field(default_factory=dict)  # adapter name -> evictions
    num_waiting_for_load: int = 0  # requests queued until their adapter finds room
