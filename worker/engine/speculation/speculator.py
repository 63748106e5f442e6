"""Each step: which decoding streams get proposals and how many, the proposals themselves, and
what verification taught (acceptance per stream, the step's cost per row, the counters).

How many: a proposal is worth its row when the tokens it is expected to add are worth more than
the time its row adds. With a step costing `a + b x rows` (fitted online from the engine's own
steps, `StepCost`), the j-th proposal of a stream is accepted with probability `p_s x c_2 x ... x
c_j`: `p_s` the stream's own rate for a first proposal (it changes as the text goes in and out of
passages that repeat), `c_i` the rate at which a proposal at position i is accepted once the
ones before it were (kept over every stream: acceptance comes in runs, so deep proposals are
likelier than a geometric model says). It adds that many expected tokens for `b` seconds (and,
for a draft model, its share of one more draft forward), and is taken while that beats the
step's rate so far (tokens / seconds): a bigger step makes every token cheaper in time, and the
rule stops proposing where verification would cost more than it saves. Small batches on
weight-bound hardware (`a >> b`) speculate deeply; large batches (`b x rows ~ a`) back off by
themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvfleet.shared.engine_config import SpeculativeConfig
from kvfleet.worker.engine.core.scheduler import ScheduledChunk
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.speculation.proposers import Proposer, make_proposer

log = logging.getLogger(__name__)

# Priors until proposals were verified: a first proposal's acceptance, and a deeper one's once
# the ones before it were accepted (weight: trials).
_PRIOR_FIRST, _PRIOR_DEEPER, _PRIOR_TRIALS = 0.5, 0.7, 2.0
# A stream forgets its old steps at this rate (its text changes character); the positions'
# rates, over every stream, more slowly.
_STREAM_DECAY, _POSITION_DECAY = 0.8, 0.995


class StepCost:
    """Seconds of a step as `a + b x rows`, least squares over recent steps (exponentially
    forgotten). Until the rows have varied, a prior: a step of 64 rows costs twice one of 1 row
    (weight-bound decode), scaled to the steps seen."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w, self._x, self._y = d * self._w + 1, d * self._x + rows, d * self._y + seconds
        self._xx, self._xy = d * self._xx + rows * rows, d * self._xy + rows * seconds

    @property
    def fitted(self) -> bool:
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b): seconds per step and per row; (0, 0) before any step."""
        if self._w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var < 1.0:  # rows have not varied enough to tell a from b
            a = mean_y / (1 + mean_x / 64)
            return a, a / 64
        b = max((self._xy / self._w - mean_x * mean_y) / var, 0.0)
        return max(mean_y - b * mean_x, 0.0), b

    def seconds(self, rows: int) -> float:
        a, b = self.coefficients()
        return a + b * rows


class Rate:
    """A decayed success rate with a prior: (successes + prior x w) / (trials + w)."""

    def __init__(self, prior: float, decay: float):
        self.prior, self.decay = prior, decay
        self.successes = self.trials = 0.0

    def observe(self, success: bool) -> None:
        self.successes = self.decay * self.successes + success
        self.trials = self.decay * self.trials + 1

    def value(self, prior: float | None = None) -> float:
        prior = self.prior if prior is None else prior
        return (self.successes + prior * _PRIOR_TRIALS) / (self.trials + _PRIOR_TRIALS)


@dataclass
class SpeculationStats:
    """Cumulative counters, in vLLM's terms: a draft is one stream's proposals in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: proposal i+1 accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    """Plans, fills and learns from the proposals of one engine (`--speculative-config`)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None):
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft  # draft.DraftModel for method draft_model, else None
        self.proposer: Proposer | None = None if draft is not None else make_proposer(
            config.method, **config.model_dump(exclude={"method", "model"}))
        self.cost = StepCost()
        k = config.num_speculative_tokens
        # [0]: a first proposal's acceptance over every stream (a new stream's prior);
        # [i]: position i + 1's once the ones before it were accepted
        self._positions = [Rate(_PRIOR_FIRST if i == 0 else _PRIOR_DEEPER, _POSITION_DECAY)
                           for i in range(k)]
        self._streams: dict[str, Rate] = {}  # each stream's first-proposal acceptance
        self._proposals: dict[str, list[int]] = {}  # this step's, between plan and proposals
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)

    # ---- before the step ----------------------------------------------------------------------

    def plan(self, decoding: list[Sequence], num_batched: int) -> dict[str, int]:
        """req_id -> proposal slots for this step's decoding streams (none for most steps of a
        large batch). `num_batched`: the step's rows without speculation, roughly."""
        self._proposals = {}
        cap = self.config.disable_by_batch_size
        if not decoding or (cap is not None and len(decoding) > cap):
            return {}
        limits = {s.req_id: self._limit(s) for s in decoding}
        limits = {r: k for r, k in limits.items() if k > 0}
        if limits and self.config.adaptive and not self._may_pay(limits, len(decoding),
                                                                 num_batched):
            return {}  # not even the likeliest stream's first proposal would: do not look
        if self.proposer is not None:
            for seq in decoding:
                if seq.req_id in limits:
                    proposal = self.proposer.propose(seq.req_id, seq.token_ids,
                                                     seq.num_prompt_tokens, limits[seq.req_id])
                    if proposal:
                        self._proposals[seq.req_id] = proposal
            limits = {r: len(p) for r, p in self._proposals.items()}
        return self._choose(limits, len(decoding), num_batched)

    def _limit(self, seq: Sequence) -> int:
        """Proposals this stream may take: its request's wish, the tokens it may still make
        (the token after the proposals counts too) and the context."""
        wanted = seq.params.num_speculative_tokens
        k = self.config.num_speculative_tokens if wanted is None else min(
            wanted, self.config.num_speculative_tokens)
        k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens)
        return max(k, 0)

    def _choose(self, limits: dict[str, int], num_decoding: int, num_batched: int) -> dict[str, int]:
        """The step-cost rule of the module's docstring, greedily over every stream's next
        proposal (every proposal, without `adaptive`)."""
        if not limits or not self.config.adaptive:
            return limits
        a, b = self.cost.coefficients()
        draft_step = self.draft.step_seconds(len(limits)) if self.draft is not None else 0.0
        rows = max(num_batched, num_decoding)
        tokens, seconds = float(num_decoding), a + b * rows
        if seconds <= 0:  # nothing timed yet: one proposal each, to start learning
            return {r: 1 for r in limits}
        gains = []
        for req_id, k in limits.items():
            gain = 1.0
            for j in range(1, k + 1):
                gain *= self._first(req_id) if j == 1 else self._positions[j - 1].value()
                gains.append((gain, j, req_id))
        gains.sort(reverse=True)
        chosen: dict[str, int] = {}
        depth = 0
        for gain, j, req_id in gains:
            if chosen.get(req_id, 0) != j - 1:
                continue  # its earlier proposal was not taken
            cost = b + (draft_step if j > depth else 0.0)
            if gain * seconds <= cost * tokens:
                continue
            chosen[req_id] = j
            depth = max(depth, j)
            tokens, seconds = tokens + gain, seconds + cost
        return chosen

    def _may_pay(self, limits: dict[str, int], num_decoding: int, num_batched: int) -> bool:
        """The rule's first test for the likeliest stream's first proposal (`_choose`)."""
        a, b = self.cost.coefficients()
        seconds = a + b * max(num_batched, num_decoding)
        return seconds <= 0 or max(self._first(r) for r in limits) * seconds > b * num_decoding

    def _first(self, req_id: str) -> float:
        """The stream's chance that its first proposal is accepted."""
        everyone = self._positions[0].value()
        stream = self._streams.get(req_id)
        return everyone if stream is None else stream.value(everyone)

    def proposals(self, chunks: list[ScheduledChunk]) -> dict[str, list[int]]:
        """req_id -> the proposals of each chunk that reserved slots for them."""
        chunks = [c for c in chunks if c.lookahead]
        if self.draft is not None and chunks:
            return {c.seq.req_id: p for c, p in zip(chunks, self.draft.propose(chunks))}
        return {c.seq.req_id: self._proposals.get(c.seq.req_id, []) for c in chunks}

    # ---- after the step -----------------------------------------------------------------------

    def observe(self, chunk: ScheduledChunk, num_accepted: int) -> None:
        """Verification of a chunk's proposals accepted the first `num_accepted` of them."""
        proposed = len(chunk.draft)
        if not proposed:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.accepted_per_position[i] += 1
        self._streams.setdefault(chunk.seq.req_id, Rate(_PRIOR_FIRST, _STREAM_DECAY)).observe(
            num_accepted > 0)
        for i in range(min(num_accepted + 1, proposed)):  # verified: those after an accepted
            self._positions[i].observe(i < num_accepted)
        if self.draft is not None:
            self.draft.accepted(chunk, num_accepted)

    def observe_step(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)

    def preempted(self, req_id: str) -> None:
        """The stream's blocks were given back: a draft model's KV of it is gone."""
        if self.draft is not None:
            self.draft.forget(req_id)

    def finish(self, seq: Sequence) -> None:
        """The stream left the engine."""
        self._streams.pop(seq.req_id, None)
        if self.proposer is not None:
            self.proposer.finish(seq.req_id, seq.token_ids, seq.num_prompt_tokens)
        if self.draft is not None:
            self.draft.forget(seq.req_id)
