"""A draft model's proposals: a smaller model with the target's tokenizer runs ahead greedily.

Its KV lives in a pool of its own with the target pool's block geometry: the draft's KV of a
position sits in the same block id and slot as the target's, so it follows the target's block
tables, lookahead slots and prefix-cache sharing without tables of its own. Per stream it keeps
how many leading positions of its KV are valid (`_computed`): after a step where the target
accepted `a` of `k` proposals, the draft's KV of the accepted ones stays valid, and the next
step starts with the positions it has not computed (a stream new to it, or one whose blocks were
given back, is prefilled in its first step). A block shared through the prefix cache may get its
draft KV written by two streams in one step: both write the KV of the same tokens at the same
positions, and a draft only proposes, so a difference could cost acceptance, never an answer.
"""

from __future__ import annotations

import time

from worker.engine.model_runner import ModelRunner, PlannedChunk, StepPlan
from worker.engine.scheduler import ScheduledChunk
from worker.engine.speculation.speculator import StepCost


class DraftModel:
    def __init__(self, runner: ModelRunner, vocab_size: int):
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: a draft's padding rows are never proposed
        self.block_size = runner.block_size
        self.cost = StepCost()
        self._computed: dict[str, int] = {}  # req_id -> leading positions of valid draft KV

    def step_seconds(self, num_streams: int) -> float:
        """One draft forward over `num_streams` decode rows, as measured so far (0 unknown)."""
        return self.cost.seconds(num_streams) if self.cost.fitted else 0.0

    def propose(self, chunks: list[ScheduledChunk]) -> list[list[int]]:
        """`chunk.lookahead` greedy tokens after each chunk's last known token."""
        proposals: list[list[int]] = [[] for _ in chunks]
        for depth in range(max(c.lookahead for c in chunks)):
            rows = [i for i, c in enumerate(chunks) if c.lookahead > depth]
            planned, token_ids = [], []
            for i in rows:
                chunk = chunks[i]
                seq = chunk.seq
                if depth == 0:  # from the first position without draft KV to the last token
                    start = min(self._computed.get(seq.req_id, 0), seq.num_tokens - 1)
                    tokens = seq.token_ids[start:]
                else:
                    start, tokens = seq.num_tokens - 1 + depth, [proposals[i][-1]]
                end = start + len(tokens)
                planned.append(PlannedChunk(start, len(tokens),
                                            chunk.block_table[:-(-end // self.block_size)], True))
                token_ids.append(tokens)
            # the runner's flattened order: one-token chunks by context length, then the longer
            order = sorted(range(len(rows)), key=lambda n: (planned[n].num_tokens > 1,
                                                           planned[n].end))
            plan = StepPlan([planned[n] for n in order], [t for n in order for t in token_ids[n]])
            started = time.perf_counter()
            logits = self.runner.forward(plan)
            next_ids = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
            if depth > 0:
                self.cost.observe(len(rows), time.perf_counter() - started)
            for n, token in zip(order, next_ids):
                proposals[rows[n]].append(int(token))
        for chunk in chunks:
            # KV of the last token and of the proposals fed back (all but the last one)
            self._computed[chunk.seq.req_id] = chunk.seq.num_tokens + chunk.lookahead - 1
        return proposals

    def accepted(self, chunk: ScheduledChunk, num_accepted: int) -> None:
        """The target accepted the first `num_accepted` proposals: the draft KV after them is
        of rejected tokens."""
        req_id = chunk.seq.req_id
        if req_id in self._computed:
            valid = chunk.start + 1 + num_accepted  # the last known token and the accepted ones
            self._computed[req_id] = min(self._computed[req_id], valid)

    def forget(self, req_id: str) -> None:
        self._computed.pop(req_id, None)

