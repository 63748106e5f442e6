"""Adapters loaded in host memory: at most `capacity` (--max-cpu-loras), least recently used
evicted first, but never one a queued or running request holds (a pin per request): when every
loaded adapter is held, a new one waits for room instead (manager.py)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from kvfleet.worker.engine.core.lora_request import LoraLoadError
from kvfleet.worker.engine.lora.weights import AdapterWeights

Loader = Callable[[str, str], AdapterWeights]  # (name, path) -> weights, or LoraLoadError


class AdapterCache:
    """Loaded adapters by name, least recently used first; pins, loads and evictions counted."""

    def __init__(self, capacity: int, load: Loader):
        self.capacity = capacity
        self._load = load
        self._entries: OrderedDict[str, AdapterWeights] = OrderedDict()  # LRU first
        self._pins: Counter[str] = Counter()  # name -> requests holding it
        self.loads_total: Counter[str] = Counter()
        self.evictions_total: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str, path: str | None = None) -> AdapterWeights | None:
        """The loaded adapter `name` (from `path`, when given), now the most recently used."""
        weights = self._entries.get(name)
        if weights is None or (path is not None and weights.path != path):
            return None
        self._entries.move_to_end(name)
        return weights

    def in_use_elsewhere(self, name: str, path: str) -> bool:
        """`name` is loaded from another path and held by a request."""
        weights = self._entries.get(name)
        return weights is not None and weights.path != path and self._pins[name] > 0

    def loaded(self) -> list[str]:
        """Names, most recently used first."""
        return list(reversed(self._entries))

    def has_room(self) -> bool:
        """A load would succeed without evicting a pinned adapter."""
        return len(self._entries) < self.capacity or any(
            not self._pins[name] for name in self._entries)

    def load(self, name: str, path: str, keep: set[str] = frozenset()) -> AdapterWeights:
        """Load `name` from `path` (replacing an unpinned copy from another path), then evict
        the least recently used unpinned adapters beyond capacity, those not in `keep` (wanted
        soon) first. LoraLoadError: unreadable, or every loaded adapter is pinned (nothing
        changed then)."""
        if name in self._entries and self._pins[name]:
            raise LoraLoadError(f"adapter {name} is in use from {self._entries[name].path}; "
                                f"it cannot be loaded from {path} as well")
        if not self.has_room() and name not in self._entries:
            raise LoraLoadError(f"no room for adapter {name}: all {self.capacity} loaded "
                                "adapters are in use (--max-cpu-loras)")
        weights = self._load(name, path)  # before any eviction: a failed load changes nothing
        self._entries.pop(name, None)
        self._entries[name] = weights
        self.loads_total[name] += 1
        self._evict_beyond_capacity(keep | {name})
        return weights

    def _evict_beyond_capacity(self, keep: set[str]) -> None:
        unpinned = [n for n in self._entries if not self._pins[n]]  # least recently used first
        for victim in [n for n in unpinned if n not in keep] + [n for n in unpinned if n in keep]:
            if len(self._entries) <= self.capacity:
                return
            if victim in self._entries:
                del self._entries[victim]
                self.evictions_total[victim] += 1

    def pin(self, name: str) -> None:
        """A request holds `name` (loaded) until it unpins it."""
        assert name in self._entries, f"pinning {name}, which is not loaded"
        self._pins[name] += 1

    def unpin(self, name: str) -> None:
        self._pins[name] -= 1
        if self._pins[name] <= 0:
            del self._pins[name]
