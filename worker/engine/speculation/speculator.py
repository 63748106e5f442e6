"""Each step: which decoding streams get proposals and how many, the proposals themselves, and
what verification taught (acceptance per stream, the step's cost per row, the counters).

How many: a proposal is worth its row when the tokens it is expected to add are worth more than
the time its row adds. With a step costing `a + b x rows` (fitted online from the engine's own
steps, `StepCost`) and a stream whose proposals are accepted with probability `alpha` each, the
j-th proposal of that stream adds `alpha^j` expected tokens for `b` seconds (and, for a draft
model, its share of one more draft forward); it is taken while that beats the step's rate so far
(tokens / seconds): a bigger step makes every token cheaper in time, and the rule stops proposing
where verification would cost more than it saves. Small batches on weight-bound hardware
(`a >> b`) speculate deeply; large batches (`b x rows ~ a`) back off by themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shared.engine_config import SpeculativeConfig
from worker.engine.scheduler import ScheduledChunk, SchedulerOutput
from worker.engine.sequence import Sequence
from worker.engine.speculation.proposers import Proposer, make_proposer

log = logging.getLogger(__name__)

# Prior acceptance of a stream's proposals until it has its own (weight in trials).
_PRIOR_ACCEPTANCE, _PRIOR_TRIALS = 0.5, 2.0
# A stream's acceptance forgets old steps at this rate (its text changes character).
_ACCEPTANCE_DECAY = 0.9


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


@dataclass
class Acceptance:
    """One stream's proposals: accepted and tried, decayed (a trial is a proposal verified; the
    first rejected one ends a step's trials)."""

    accepted: float = 0.0
    trials: float = 0.0

    def rate(self, prior: float) -> float:
        return (self.accepted + prior * _PRIOR_TRIALS) / (self.trials + _PRIOR_TRIALS)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted = _ACCEPTANCE_DECAY * self.accepted + num_accepted
        self.trials = _ACCEPTANCE_DECAY * self.trials + num_accepted + (num_accepted < num_proposed)


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
        self.global_acceptance = _PRIOR_ACCEPTANCE  # every stream's, a new stream's prior
        self._streams: dict[str, Acceptance] = {}
        self._proposals: dict[str, list[int]] = {}  # this step's, between plan and fill
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
            alpha = self._rate(req_id)
            gains += [(alpha ** j, j, req_id) for j in range(1, k + 1)]
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
        return seconds <= 0 or max(self._rate(r) for r in limits) * seconds > b * num_decoding

    def _rate(self, req_id: str) -> float:
        stream = self._streams.get(req_id)
        return self.global_acceptance if stream is None else stream.rate(self.global_acceptance)

    def fill(self, sched: SchedulerOutput) -> None:
        """Put the proposals into the chunks that reserved slots for them."""
        chunks = [c for c in sched.chunks if c.lookahead]
        if self.draft is not None and chunks:
            for chunk, proposal in zip(chunks, self.draft.propose(chunks)):
                chunk.set_draft(proposal)
            return
        for chunk in chunks:
            chunk.set_draft(self._proposals.get(chunk.seq.req_id, []))

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
        self._streams.setdefault(chunk.seq.req_id, Acceptance()).observe(proposed, num_accepted)
        trials = num_accepted + (num_accepted < proposed)
        self.global_acceptance += 0.05 * (num_accepted / trials - self.global_acceptance)
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
