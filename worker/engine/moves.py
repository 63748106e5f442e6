"""The engine's side of a handoff: a running sequence taken out of one engine with a host copy of
its KV, and taken in by another (`Engine.export_sequence / import_sequence`; the state and its
wire encoding are handoff.py's).

Out: a RUNNING sequence with computed KV (mid-prefill chunks too), or a PREEMPTED one whose KV
is swapped out (its host copy is the state's); it leaves as an aborted one does (blocks freed;
its adapter, grammar matcher and speculation released). Not one that holds no KV (queued, or
preempted for recompute), nor one whose prompt logprobs are being computed (those so far would
be lost; from its first output on it can go): it stays.

In: the request is checked as `add_request` checks one (its adapter acquired, its grammar
replayed over its output; its prompt logprobs went out with its first output). It waits as a
swapped-out preempted sequence does (its host copy held here, not limited by --swap-space: a
handoff is not swap), is swapped into fresh blocks when its whole known sequence fits beside the
watermark, and continues with nothing computed again. The features add their parts through the step lifecycle
(lifecycle.py): a draft model's KV (speculation/), or why no sequence can move (tensor
parallelism)."""

from __future__ import annotations

import torch

from kvfleet.shared.wire import RequestStatus
from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.core.handoff import (
    HandoffError, SequenceState, check_layout, host_blocks, pool_layout)
from kvfleet.worker.engine.memory.kv_cache import HostBlocks, KVCachePool
from kvfleet.worker.engine.core.lifecycle import Features
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.tiers.swapping import SwappedKV


class SequenceMoves:
    """Exports and imports of one engine's sequences."""

    def __init__(self, pool: KVCachePool, block_manager: BlockManager, swapped: SwappedKV,
                 features: Features, vocab_size: int, dtype: torch.dtype):
        self.pool, self.block_manager, self.swapped = pool, block_manager, swapped
        self.features, self.vocab_size, self.dtype = features, vocab_size, dtype

    def layout(self) -> dict:
        """What an engine taking this one's sequences must match: the model (its prefix root
        names the served model), the geometry and format of its KV blocks, the draft model's."""
        return {**pool_layout(self.pool), "block_size": self.pool.block_size,
                "vocab_size": self.vocab_size, "dtype": str(self.dtype).removeprefix("torch."),
                "prefix_root": self.block_manager.root.hex(), "draft": None,
                **self.features.handoff_layout()}

    def gap(self) -> str | None:
        """None when this engine can export and import sequences; else why not."""
        return self.features.handoff_gap()

    def exportable(self, seq: Sequence | None) -> bool:
        """Whether `export` would hand the sequence over now: a RUNNING one with computed KV, or
        a PREEMPTED one swapped out; not while its prompt logprobs are computed."""
        if seq is None or self.gap() is not None or (
                seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent):
            return False
        if seq.status is RequestStatus.RUNNING and seq.num_computed_tokens > 0:
            return True
        return seq.status is RequestStatus.PREEMPTED and seq.req_id in self.swapped.held

    def kv_bytes(self, seq: Sequence) -> int:
        """Bytes `export` would move now."""
        if seq.num_swapped_blocks:
            num_bytes = self.swapped.num_bytes_of(seq.req_id)
        else:
            bm = self.block_manager
            num_bytes = bm.blocks_for_tokens(seq.num_computed_tokens) * self.pool.block_bytes
        return num_bytes + self.features.kv_bytes(seq)

    def export(self, seq: Sequence) -> SequenceState:
        """The exportable sequence's state with host copies of its KV (it then leaves)."""
        if seq.num_swapped_blocks:
            host, table = self.swapped.take(seq.req_id), None
        else:
            bm = self.block_manager
            table = bm.block_table(seq.req_id)
            host = self.pool.copy_out(table[:bm.blocks_for_tokens(seq.num_computed_tokens)])
        return SequenceState(
            seq.req_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.params,
            seq.num_computed_tokens, seq.num_cached_tokens, seq.lora, self.layout(),
            host.values, host.scales, **self.features.export(seq, table))

    def check(self, state: SequenceState) -> HostBlocks:
        """The state's host copy, when this engine can take it (HandoffError, nothing changed)."""
        gap = self.gap()
        if gap is not None:
            raise HandoffError(f"this engine takes no handoff: {gap}")
        check_layout(state, self.layout())
        host = host_blocks(state, self.pool)
        self.features.check_import(state)
        if state.params.prompt_logprobs is not None and not state.output_token_ids:
            raise HandoffError(f"handoff of {state.req_id!r}: its prompt logprobs are not in it")
        return host

    def hold(self, state: SequenceState, host: HostBlocks) -> None:
        """Keep the entered sequence's copies until the scheduler swaps it in."""
        self.swapped.hold(state.req_id, host)
        self.features.take_import(state)
