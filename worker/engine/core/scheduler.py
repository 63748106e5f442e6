"""Continuous batching: which tokens of which sequences run in the next step, and what follows.

Every step the running group is formed again under a token budget: running sequences first, in
admission order, each taking what it still needs (1 token when decoding; a prefill chunk is capped
so that every decoding sequence behind it still gets its token), then waiting sequences in arrival
order while their KV fits. When the pool runs out, the most recently admitted running sequence is
preempted and goes back to the front of the queue, either by recomputation (its blocks are freed;
its generated tokens are prefilled again together with the prompt) or by swapping (its blocks are
copied to host memory before they are freed, and copied back into fresh blocks when it is
readmitted); `PreemptionCostModel` picks one per preemption (`--preemption`).

Speculative decoding (`lookahead`): a decoding sequence may reserve slots for proposed tokens
beyond its last one (the budget counts them; a reservation never preempts anyone: it takes only
blocks beyond one per running stream and the watermark, and without them the sequence decodes
one token). Its step then computes the last token and the proposals, and
`update` appends the tokens verification accepted plus the one sampled after them; the slots of
rejected proposals are released (their KV is garbage but never read: positions are computed
again before anything attends to them, and only blocks of accepted tokens are ever published).

LoRA adapters (`max_loras`): the running group's sequences use at most `max_loras` distinct
adapters (the base model does not count), so every step's adapters fit the device's slots. A
waiting sequence is admitted only when its adapter is loaded for it (`adapter_ready`) and is
already the running group's or a slot is left; one that cannot be admitted keeps its place, and
no later adapter request is admitted before it (so the next slot that frees is its adapter's, and
no stream of requests for the running adapters starves it); base requests behind it still are.

The promised pace (`pace`, pace.py): the decoding streams' rows go first, a prefill chunk gets
only the step time their tightest ITL target leaves, and a waiting sequence is admitted only
while the group with it keeps that target; one that would not waits (and so do those behind it).

Prefix sharing within a step: each prefill chunk's full blocks that the prefix cache lacks are
noted as the step is formed (`_Scheduling.computing`), and a sequence admitted after it in the
same step takes them as cache hits. Its rows read those keys from the pool, which every layer
fills with the whole step's keys and values before any row attends; so prompts arriving together
on one prefix compute it once, not once per step they were spread over. The blocks are published
(and announced) only after the step, as any other.

Only the scheduler changes a sequence's status and progress.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field, replace

from kvfleet.shared.pace import StepFeatures
from kvfleet.shared.wire import RequestStatus, TokenLogprob
from kvfleet.shared.wire.prefix_hash import BlockHash

from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.core.pace import Pace, StepBudget
from kvfleet.worker.engine.core.preemption import RECOMPUTE, SWAP, PreemptionCostModel, SwapSpace
from kvfleet.worker.engine.core.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Attachments:
    """What the engine's features attach to a step's chunks before its output is built
    (lifecycle.py, `Feature.attach`): speculation's proposals for the chunks that reserved
    slots, LoRA's device slot of each chunk's adapter and the adapters put in slots for it."""

    proposals: dict[str, list[int]] = field(default_factory=dict)  # req_id -> proposed tokens
    lora_slots: dict[str, int] = field(default_factory=dict)  # req_id -> its adapter's slot
    lora_loads: tuple[tuple[int, str, str], ...] = ()  # (slot, adapter name, path)

    def merged(self, other: Attachments | None) -> Attachments:
        if other is None:
            return self
        return Attachments({**self.proposals, **other.proposals},
                           {**self.lora_slots, **other.lora_slots},
                           self.lora_loads + other.lora_loads)


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions `[start, start + num_tokens)` of `seq` are computed this step."""

    seq: Sequence
    start: int
    num_tokens: int
    block_table: list[int]  # the sequence's blocks, covering at least start + num_tokens positions
    emits_token: bool = False  # the chunk reaches the last known token: its logits give the next
    # speculation: slots reserved past the last known token, and the proposals that fill them
    # (at most `lookahead`; `num_tokens` is then 1 + len(draft))
    lookahead: int = 0
    draft: list[int] = field(default_factory=list)
    lora_slot: int = -1  # the device slot of its adapter; -1: base

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: known ones, then the proposals."""
        return self.seq.token_ids[self.start:self.end - len(self.draft)] + self.draft

    @property
    def num_logits(self) -> int:
        """Logits rows the chunk needs: the last known token's and one per proposal."""
        return 1 + len(self.draft) if self.emits_token else 0

    def attached(self, extras: Attachments) -> ScheduledChunk:
        """The chunk as it runs: its reserved slots filled with its proposals (fewer leave
        slots unused this step), its adapter's slot."""
        req_id = self.seq.req_id
        slot = extras.lora_slots.get(req_id, -1)
        if not self.lookahead:
            return self if slot < 0 else replace(self, lora_slot=slot)
        draft = list(extras.proposals.get(req_id, [])[:self.lookahead])
        return replace(self, num_tokens=1 + len(draft), draft=draft, lora_slot=slot)

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int, block_table: list[int]) -> ScheduledChunk:
        """A chunk emits when it reaches the last known token, unless no token is wanted
        (`max_tokens` 0: prompt logprobs only; the request ends when its prefill does)."""
        start = seq.num_computed_tokens
        emits = start + num_tokens == seq.num_tokens and seq.params.max_tokens > 0
        return cls(seq, start, num_tokens, block_table, emits)


@dataclass
class _Scheduling:
    """A step's work while the scheduler forms it (`Scheduler.schedule` builds the output)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)
    # full blocks this step's prefill chunks fill that the cache lacks: hash -> block
    computing: dict[BlockHash, int] = field(default_factory=dict)

    def add(self, chunk: ScheduledChunk, block_manager: BlockManager) -> None:
        """Take `chunk` into the step; a prefill chunk's new full blocks become shareable."""
        self.chunks.append(chunk)
        seq = chunk.seq
        if chunk.num_tokens > 1 and not chunk.lookahead and seq.params.uses_prefix_cache:
            for block_hash, block in block_manager.blocks_computed(
                    seq.req_id, seq.token_ids, chunk.end, seq.prefix_root).items():
                self.computing.setdefault(block_hash, block)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work, built once and not changed after. Decoding chunks (1 token) and prefill
    chunks, in scheduling order, with what the features attached (`Attachments`).

    Before the forward, the engine copies `swap_out` blocks to host memory (they were freed this
    step and may be written by it), then `swap_in` host copies into their new blocks.
    """

    chunks: Sequence_[ScheduledChunk] = ()
    preempted_req_ids: Sequence_[str] = ()
    swap_out: Sequence_[tuple[str, list[int]]] = ()  # (req_id, its blocks)
    swap_in: Sequence_[tuple[str, list[int]]] = ()  # (req_id, new blocks)
    # (slot, adapter name, path): adapters put in slots for this step
    lora_loads: Sequence_[tuple[int, str, str]] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class TokenEmission:
    """What one sequence produced in a step: its new tokens (one, or several where speculation
    was accepted; none for a `max_tokens` 0 request whose prefill is done), and/or its end."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    finished: bool


class Scheduler:
    """Owns the waiting queue and the running group; the only writer of sequence state."""

    def __init__(self, block_manager: BlockManager, stop_checker, max_batched_tokens: int = 512,
                 max_running: int = 64, watermark: float = 0.01,
                 preemption: PreemptionCostModel | None = None, swap_space: SwapSpace | None = None,
                 max_loras: int = 0, adapter_ready: Callable[[str], bool] | None = None,
                 pace: Pace | None = None):
        self.block_manager = block_manager
        self.pace = pace  # the promised pace (pace.py); None: only the token budget binds
        self.max_loras = max_loras  # distinct adapters in the running group at most
        # req_id -> its adapter is loaded for it (LoraManager.is_ready); None: always
        self.adapter_ready = adapter_ready or (lambda req_id: True)
        self.preemption = preemption  # None: always recompute
        self.swap_space = swap_space or SwapSpace(0)
        self.stop_checker = stop_checker
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the tail is preempted first
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of which by swapping
        self.num_generated_tokens = 0
        self.num_prefill_tokens_computed = 0  # tokens computed in chunks that emit no token or
        #                                       in prefill chunks (everything but 1-token decodes)
        self._finished_at_add: list[Sequence] = []

    # ---- queue management ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; one already complete (resumed with all its tokens) finishes at once."""
        status = None
        if seq.output_token_ids:
            status = self.stop_checker.check(seq.num_prompt_tokens, seq.output_token_ids, seq.params)
        if status is not None:
            seq.status = status
            self._finished_at_add.append(seq)
            return
        seq.status = RequestStatus.QUEUED
        self.waiting.append(seq)

    def add_swapped_out(self, seq: Sequence, num_computed_tokens: int, num_blocks: int) -> None:
        """Queue a sequence handed over from another engine with the KV of its first
        `num_computed_tokens` positions in `num_blocks` host copies. It waits as a sequence
        preempted by swapping does, at the head of the queue (a stream mid-answer goes before
        requests that have not started), until its whole known sequence fits; its copies are
        not in the swap space (a handoff is not a preemption)."""
        seq.num_computed_tokens = num_computed_tokens
        seq.num_swapped_blocks = num_blocks
        seq.admitted_once = True  # its prefix-cache hit was counted where it was admitted
        seq.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: RequestStatus, error: str | None = None) -> None:
        """End a sequence (abort, error or stop) and release its blocks at once."""
        if seq in self._finished_at_add:  # never ran; no output for it any more
            self._finished_at_add.remove(seq)
            seq.status = status
            return
        if seq.status.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.req_id)
        self.swap_space.release(seq.req_id)
        seq.num_swapped_blocks = 0
        seq.status = status
        seq.error = error

    def take_finished_at_add(self) -> list[Sequence]:
        done, self._finished_at_add = self._finished_at_add, []
        return done

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished_at_add)

    # ---- one step -----------------------------------------------------------------------------

    def decoding(self) -> list[Sequence]:
        """Running sequences whose next step is a decode (speculation proposes for these)."""
        return [s for s in self.running if s.num_uncomputed_tokens == 1]

    def schedule(self, lookahead: dict[str, int] | None = None,
                 attach: Callable[[list[ScheduledChunk]], Attachments] | None = None
                 ) -> SchedulerOutput:
        """The next step; `lookahead`: req_id -> proposal slots a decoding sequence asks for;
        `attach`: what the engine's features attach to the chunks before the output is built."""
        out = _Scheduling()
        step = None if self.pace is None else self.pace.budget(self.running)
        budget = self._schedule_running(out, self.max_batched_tokens, lookahead or {}, step)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget, step)
        extras = Attachments() if attach is None else attach(out.chunks)
        return SchedulerOutput([c.attached(extras) for c in out.chunks], out.preempted_req_ids,
                               out.swap_out, out.swap_in, extras.lora_loads)

    def _schedule_running(self, out: _Scheduling, budget: int,
                          lookahead: dict[str, int], step: StepBudget | None) -> int:
        decodes_behind = sum(1 for s in self.running if s.num_uncomputed_tokens == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            need = seq.num_uncomputed_tokens
            if need == 1:
                decodes_behind -= 1
                extra = min(lookahead.get(seq.req_id, 0), budget - decodes_behind - 1)
                if extra > 0 and step is not None:  # proposals only where the pace has room
                    extra = step.lookahead(seq.num_tokens, extra)
                if extra > 0 and self._reserve_lookahead(seq, extra, out):
                    budget -= 1 + extra
                    i += 1
                    continue
            num_tokens = min(need, budget - decodes_behind) if need > 1 else 1
            if need > 1 and num_tokens > 0 and step is not None:  # the time the decodes leave
                num_tokens = step.prefill_tokens(seq.num_computed_tokens, num_tokens)
            if num_tokens <= 0:
                i += 1
                continue
            table = self.block_manager.allocate_slots(seq.req_id, seq.num_computed_tokens + num_tokens)
            while table is None:
                victim = self.running.pop()
                if victim is not seq and victim.num_uncomputed_tokens == 1:
                    decodes_behind -= 1
                self._preempt(victim, out)
                if victim is seq:
                    break
                table = self.block_manager.allocate_slots(
                    seq.req_id, seq.num_computed_tokens + num_tokens)
            if table is None:
                break  # `seq` itself was the last one running and got preempted
            out.add(ScheduledChunk.of(seq, num_tokens, table), self.block_manager)
            budget -= num_tokens
            i += 1
        return budget

    def _reserve_lookahead(self, seq: Sequence, extra: int, out: _Scheduling) -> bool:
        """Schedule `seq`'s decode with `extra` proposal slots, if free blocks hold them and
        still leave a block for every running stream (and the watermark): the others' next
        tokens come before anyone's proposals."""
        bm = self.block_manager
        lookahead_blocks = (bm.num_blocks_to_take(seq.req_id, seq.num_tokens + extra)
                            - bm.num_blocks_to_take(seq.req_id, seq.num_tokens))
        if lookahead_blocks and (bm.num_free_blocks - lookahead_blocks
                                 < len(self.running) + self.watermark_blocks):
            return False
        table = bm.allocate_slots(seq.req_id, seq.num_tokens + extra)
        if table is None:
            return False
        chunk = ScheduledChunk(seq, seq.num_computed_tokens, 1 + extra, table, emits_token=True,
                               lookahead=extra)
        out.chunks.append(chunk)
        return True

    def _preempt(self, seq: Sequence, out: _Scheduling) -> None:
        bm = self.block_manager
        # the blocks covering the computed tokens: all the sequence holds outside a step
        table = list(bm.block_table(seq.req_id)[:bm.blocks_for_tokens(seq.num_computed_tokens)])
        if table and self._preemption_mode(seq, table) == SWAP:
            self.swap_space.reserve(seq.req_id, len(table))
            seq.num_swapped_blocks = len(table)
            out.swap_out.append((seq.req_id, table))
            self.num_swap_preemptions += 1
            how = f"swapped {len(table)} blocks out"
        else:
            how = f"recompute {seq.num_tokens} tokens later"
            seq.num_computed_tokens = 0
        bm.free(seq.req_id, forget=False)
        seq.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted_req_ids.append(seq.req_id)
        log.info("preempted %s (%s)", seq.req_id, how)

    def _preemption_mode(self, seq: Sequence, table: list[int]) -> str:
        if self.preemption is None:
            return RECOMPUTE
        # leading blocks shared with live sequences stay cached: recomputing skips them
        shared = self.block_manager.num_shared_leading_blocks(seq.req_id)
        to_recompute = max(seq.num_computed_tokens - shared * self.block_manager.block_size, 0)
        return self.preemption.choose(len(table), to_recompute, self.swap_space.can_hold(len(table)))

    def _schedule_waiting(self, out: _Scheduling, budget: int,
                          step: StepBudget | None) -> None:
        adapters = {s.lora.name for s in self.running if s.lora is not None}
        adapter_blocked = False  # an earlier adapter request waits: later ones wait behind it
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[i]
            if seq.lora is not None and (adapter_blocked or not self._adapter_fits(seq, adapters)):
                adapter_blocked = True
                i += 1
                continue
            if self.pace is not None and not self.pace.admits(self.running, seq):
                break  # the group with it would miss the pace: it waits for a stream to end
            admitted = (self._swap_in(i, out, budget, step) if seq.num_swapped_blocks
                        else self._admit(i, out, budget, step))
            if not admitted:
                break
            budget -= out.chunks[-1].num_tokens
            if seq.lora is not None:
                adapters.add(seq.lora.name)

    def _adapter_fits(self, seq: Sequence, adapters: set[str]) -> bool:
        """Its adapter is loaded for it and running already, or a slot is left."""
        return self.adapter_ready(seq.req_id) and (
            seq.lora.name in adapters or len(adapters) < self.max_loras)

    def _admit(self, index: int, out: _Scheduling, budget: int,
               step: StepBudget | None) -> bool:
        """Admit waiting sequence `index` (not swapped out) with its first chunk, if its whole
        known sequence fits (and, under a pace, some of its prompt fits the step's time)."""
        bm = self.block_manager
        seq = self.waiting[index]
        use_cache = bm.enable_prefix_caching and seq.params.uses_prefix_cache
        cached = (bm.find_cached_prefix(seq.req_id, seq.token_ids, seq.prefix_root,
                                        out.computing) if use_cache else [])
        num_cached = len(cached) * bm.block_size
        # Admit only if the whole known sequence fits beside the watermark, so a long prompt
        # is not admitted chunk by chunk into certain preemption.
        reserve = self.watermark_blocks if self.running else 0
        if bm.num_blocks_to_take(seq.req_id, seq.num_tokens, cached) > bm.num_free_blocks - reserve:
            return False
        num_tokens = min(seq.num_tokens - num_cached, budget)
        if step is not None:
            num_tokens = step.prefill_tokens(num_cached, num_tokens)
        table = None if num_tokens <= 0 else bm.allocate_slots(
            seq.req_id, num_cached + num_tokens, cached)
        if table is None:
            return False
        del self.waiting[index]
        if use_cache:
            bm.record_prefix_lookup(seq.num_tokens, num_cached)
        if not seq.admitted_once and self.pace is not None:
            self.pace.admitted(seq)
        if not seq.admitted_once:
            seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            seq.admitted_once = True
        seq.num_computed_tokens = num_cached
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)
        out.add(ScheduledChunk.of(seq, num_tokens, table), bm)
        return True

    def _swap_in(self, index: int, out: _Scheduling, budget: int,
                 step: StepBudget | None) -> bool:
        """Readmit swapped-out waiting sequence `index` into fresh blocks, if its whole KV fits
        (under a pace, its copy-in counts in the step's time)."""
        bm = self.block_manager
        seq = self.waiting[index]
        reserve = self.watermark_blocks if self.running else 0
        if bm.num_blocks_to_take(seq.req_id, seq.num_tokens) > bm.num_free_blocks - reserve:
            return False
        num_tokens = min(seq.num_uncomputed_tokens, budget)
        if step is not None:
            step.add(StepFeatures(swap_blocks=seq.num_swapped_blocks))
            if num_tokens > 1:
                num_tokens = step.prefill_tokens(seq.num_computed_tokens, num_tokens)
            else:  # its next token: a decode row
                step.add(StepFeatures(1, seq.num_tokens))
        table = None if num_tokens <= 0 else bm.allocate_slots(
            seq.req_id, seq.num_computed_tokens + num_tokens)
        if table is None:
            return False
        del self.waiting[index]
        out.swap_in.append((seq.req_id, table[:seq.num_swapped_blocks]))
        self.swap_space.release(seq.req_id)
        seq.num_swapped_blocks = 0
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)
        out.add(ScheduledChunk.of(seq, num_tokens, table), bm)
        return True

    # ---- after the forward --------------------------------------------------------------------

    def update(self, out: SchedulerOutput,
               samples: dict[str, list[tuple[int, TokenLogprob | None]]]) -> list[TokenEmission]:
        """Advance every scheduled sequence; append the sampled tokens; finish stopped ones.

        `samples` maps req_id -> [(token id, logprob)] for every chunk that emits: one token, or
        with proposals the accepted ones and the token sampled after them (the last). A stop
        inside them drops the tokens after it.
        """
        emissions: list[TokenEmission] = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not RequestStatus.RUNNING:
                continue
            if not chunk.emits_token:
                seq.num_computed_tokens = chunk.end
                self.num_prefill_tokens_computed += chunk.num_tokens
                self._publish(seq)
                if seq.params.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                    self.finish(seq, RequestStatus.FINISHED_LENGTH)
                    emissions.append(TokenEmission(seq, [], [], True))
                continue
            if chunk.num_tokens - len(chunk.draft) > 1:
                self.num_prefill_tokens_computed += chunk.num_tokens
            emission, status = TokenEmission(seq, [], [], False), None
            for token_id, logprob in samples[seq.req_id]:
                seq.append_token(token_id, logprob)
                emission.token_ids.append(token_id)
                emission.logprobs.append(logprob)
                self.num_generated_tokens += 1
                status = self.stop_checker.check(seq.num_prompt_tokens, seq.output_token_ids,
                                                 seq.params)
                if status is not None:
                    break
            # every new token but the last was an input of this step (the last known token,
            # then the accepted proposals): their KV is computed
            seq.num_computed_tokens = seq.num_tokens - 1
            if chunk.lookahead and status is None:  # slots of rejected proposals
                self.block_manager.trim(seq.req_id, seq.num_tokens)
            self._publish(seq)
            if status is not None:
                self.finish(seq, status)
                emission.finished = True
            emissions.append(emission)
        return emissions

    def _publish(self, seq: Sequence) -> None:
        if seq.params.uses_prefix_cache:
            self.block_manager.cache_full_blocks(seq.req_id, seq.token_ids,
                                                 seq.num_computed_tokens, seq.prefix_root)
