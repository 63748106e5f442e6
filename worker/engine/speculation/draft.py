"""A draft model's proposals: a smaller model with the target's tokenizer runs ahead greedily.

Its KV lives in a pool of its own with the target pool's block geometry: the draft's KV of a
position sits in the same block id and slot as the target's, so it follows the target's block
tables, lookahead slots and prefix-cache sharing without tables of its own. Per stream it keeps
how many leading positions of its KV are valid (`computed_of`): after a step where the target
accepted `a` of `k` proposals, the draft's KV of the accepted ones stays valid, and the next
step starts with the positions it has not computed (a stream new to it, or one whose blocks were
given back, is prefilled in its first step). A block shared through the prefix cache may get its
draft KV written by two streams in one step: both write the KV of the same tokens at the same
positions, and a draft only proposes, so a difference could cost acceptance, never an answer.

A stream that moves to another engine (handoff) takes a host copy of its draft KV with it
(`export_kv`); one that arrives with one is held here until the target's KV is swapped in
(`hold`, then `swap_in` beside the target pool's copy-in, swapping.py).
"""

from __future__ import annotations

import time

from kvfleet.worker.engine.memory.kv_cache import HostBlocks, KVCachePool
from kvfleet.worker.engine.core.model_runner import ModelRunner, PlannedChunk, StepPlan
from kvfleet.worker.engine.core.scheduler import ScheduledChunk
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.speculation.speculator import StepCost


class DraftModel:
    def __init__(self, runner: ModelRunner, vocab_size: int):
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: a draft's padding rows are never proposed
        self.block_size = runner.block_size
        self.cost = StepCost()
        self._computed: dict[str, int] = {}  # req_id -> leading positions of valid draft KV
        self.held: dict[str, HostBlocks] = {}  # a handed-over stream's draft KV, until swap-in

    @property
    def pool(self) -> KVCachePool:
        return self.runner.pool

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


    # ---- a stream's draft KV moving between engines -------------------------------------------

    def computed_of(self, seq: Sequence) -> int:
        """Leading positions of the sequence whose draft KV is valid."""
        return min(self._computed.get(seq.req_id, 0), seq.num_computed_tokens)

    def kv_bytes(self, seq: Sequence) -> int:
        """Bytes of its draft KV an export would move now."""
        if seq.num_swapped_blocks:
            held = self.held.get(seq.req_id)
            return 0 if held is None else held.num_bytes
        return -(-self.computed_of(seq) // self.block_size) * self.pool.block_bytes

    def export_kv(self, seq: Sequence, table: list[int] | None) -> tuple[HostBlocks | None, int]:
        """A host copy of its valid draft KV (`table`: its blocks; None: swapped out, the copy
        held here goes) and the positions it covers; (None, 0) without one."""
        computed = self.computed_of(seq)
        if table is None:
            host = self.held.pop(seq.req_id, None)
        else:
            host = None if not computed else self.pool.copy_out(
                table[:-(-computed // self.block_size)])
        return host, 0 if host is None else computed

    def hold(self, req_id: str, host: HostBlocks, num_computed_tokens: int) -> None:
        """An incoming stream's draft KV, valid for its first `num_computed_tokens` positions."""
        self.held[req_id] = host
        self._computed[req_id] = num_computed_tokens

    # ---- beside the target pool's swaps (swapping.SwappedKV's follower) ----------------------

    def swap_in(self, req_id: str, blocks: list[int]) -> int:
        """Copy a held stream's draft KV into its leading new blocks; the bytes moved."""
        host = self.held.pop(req_id, None)
        if host is None:
            return 0
        self.pool.copy_in(host, blocks[:host.num_blocks])
        return host.num_bytes

    def discard(self, req_id: str) -> None:
        self.held.pop(req_id, None)

    @property
    def num_held_bytes(self) -> int:
        return sum(h.num_bytes for h in self.held.values())
