"""Teacher-forced scoring through the paged KV cache: what a KV format costs in quality.

Each sequence is fed the way serving feeds it: a prefill of its first `context_len` tokens, then
one token per step, every step reading the earlier tokens' K/V back from the pool in its storage
format. At each position the next-token log-probabilities are returned, whatever the sampler
would have picked, so two formats are compared on exactly the same contexts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.engine.core.scheduler import ScheduledChunk, SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence


def teacher_forced_logprobs(engine: Engine, sequences: list[list[int]],
                            context_len: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (p, log-probs [B, vocab] of token p + 1 given tokens [0, p]) for
    p = context_len - 1 .. n - 2, where n is the length of the sequences (all equal).

    Uses the engine's pool and runner directly; the engine must be idle. Blocks are returned
    when the generator finishes or is closed.
    """
    lengths = {len(s) for s in sequences}
    if len(lengths) != 1 or not 1 <= context_len < lengths.pop():
        raise ValueError("sequences must have one length, longer than context_len >= 1")
    if engine.has_unfinished():
        raise ValueError("the engine must be idle")
    bm = engine.block_manager
    seqs = [Sequence(f"score-{i}", tokens, SamplingParams(max_tokens=1))
            for i, tokens in enumerate(sequences)]
    try:
        tables = []
        for seq in seqs:
            table = bm.allocate_slots(seq.req_id, seq.num_tokens)
            if table is None:
                raise ValueError(f"the pool cannot hold {len(seqs)} x {seq.num_tokens} tokens")
            tables.append(table)
        chunks = [ScheduledChunk(s, 0, context_len, t, emits_token=True) for s, t in zip(seqs, tables)]
        for position in range(context_len - 1, seqs[0].num_tokens - 1):
            if position >= context_len:
                chunks = [ScheduledChunk(s, position, 1, t, emits_token=True)
                          for s, t in zip(seqs, tables)]
            emitting, logits = engine.runner.execute(SchedulerOutput(chunks=chunks))
            order = {c.seq.req_id: i for i, c in enumerate(emitting)}  # runner may reorder
            rows = torch.tensor([order[s.req_id] for s in seqs], device=logits.device)
            yield position, torch.log_softmax(logits.index_select(0, rows).float(), dim=-1).cpu()
    finally:
        for seq in seqs:
            bm.free(seq.req_id)
