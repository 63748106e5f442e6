"""The rounds of benchmarks/engine_throughput.py: a system's result, every system once a round
alternated (`--repeats N`), the rows of medians and ratios, and the table that prints them."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Result:
    name: str
    output_tokens: int  # useful tokens: each request's own max_tokens
    seconds: float  # a row over rounds: their median
    note: str = ""
    rounds_tokens_per_s: list[float] = field(default_factory=list)  # a row: each round's
    round_ratios: list[float] = field(default_factory=list)  # a row: its reference's ÷ its own

    @property
    def tokens_per_s(self) -> float:
        """A row's median over its rounds; one run's output tokens ÷ seconds."""
        if self.rounds_tokens_per_s:
            return statistics.median(self.rounds_tokens_per_s)
        return self.output_tokens / self.seconds


@dataclass
class System:
    """One row of the table: `run(round_index)` measures it once; `reference` names the kvfleet
    system whose result of the same round it is compared with (None: none)."""
    key: str
    run: Callable[[int], Result]
    reference: str | None


def alternate(systems: list[System], repeats: int) -> dict[str, list[Result]]:
    """Every system once per round, in the order given, `repeats` rounds (kvfleet, vLLM, ...,
    kvfleet, vLLM, ...): each side as many runs, each ratio between runs minutes apart."""
    runs: dict[str, list[Result]] = {s.key: [] for s in systems}
    for round_index in range(repeats):
        if repeats > 1:
            print(f"# round {round_index + 1} of {repeats}; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
        for system in systems:
            runs[system.key].append(system.run(round_index))
    return runs


def combine(systems: list[System], runs: dict[str, list[Result]]) -> list[Result]:
    """One row per system: its median over the rounds (each round's tok/s kept), and each
    round's ratio of its reference's tok/s to its own."""
    rows = []
    for system in systems:
        mine = runs[system.key]
        theirs = runs.get(system.reference, []) if system.reference else []
        rows.append(Result(mine[0].name, mine[0].output_tokens,
                           statistics.median(r.seconds for r in mine), mine[0].note,
                           [r.tokens_per_s for r in mine],
                           [ref.tokens_per_s / r.tokens_per_s for ref, r in zip(theirs, mine)]))
    return rows


def print_table(results: list[Result], auto: str) -> None:
    """Each row beside kvfleet's fastest and kvfleet's default (auto): the ratios of the medians;
    over several rounds also each round's tok/s and the ratio, round by round, of kvfleet at
    the row's dtype (the row it alternated with) to it, and their median."""
    ours = [r for r in results if r.name.startswith("kvfleet")]
    best = max(ours, key=lambda r: r.tokens_per_s)
    default = next((r for r in ours if r.name.endswith("= auto")), best)
    rounds = max(len(r.rounds_tokens_per_s) for r in results)
    several = rounds > 1
    median = "median " if several else ""
    print(f"\n| system | output tokens | {median}seconds | {median}output tok/s | kvfleet fastest "
          f"({best.name}) is | kvfleet default is |"
          + (f" every round's tok/s ({rounds} rounds) | kvfleet at its dtype is, each round "
             f"(median) |" if several else ""))
    print("|---|---:|---:|---:|---:|---:|" + ("---|---|" if several else ""))
    for r in results:
        line = (f"| {r.name} | {r.output_tokens} | {r.seconds:.1f} | {r.tokens_per_s:.1f} | "
                f"{best.tokens_per_s / r.tokens_per_s:.2f}x | "
                f"{default.tokens_per_s / r.tokens_per_s:.2f}x |")
        if several:
            ratios = (" / ".join(f"{x:.2f}" for x in r.round_ratios)
                      + f" ({statistics.median(r.round_ratios):.2f}x)") if r.round_ratios else "-"
            line += f" {' / '.join(f'{t:.1f}' for t in r.rounds_tokens_per_s)} | {ratios} |"
        print(line)


def rounds_note(values: list[float], spec: str) -> str:
    """' (the median of rounds a / b / c)' where there were several rounds, else ''."""
    if len(values) < 2:
        return ""
    return f" (the median of rounds {' / '.join(format(v, spec) for v in values)})"
