"""The profiling step that sizes the KV budget on an accelerator: one dummy forward and sampling at
the largest step shape the scheduler can produce, measuring the peak memory it needs beyond the
weights (as vLLM and nano-vllm do before they allocate their caches)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.attention import AttentionBackend
from kvfleet.worker.engine.memory.device import is_cuda
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
from kvfleet.worker.engine.core.model_runner import ModelRunner
from kvfleet.worker.engine.core.sampler import Sampler, SamplerInput
from kvfleet.worker.engine.core.scheduler import ScheduledChunk, SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence


@dataclass(frozen=True)
class StepProfile:
    num_tokens: int  # tokens in the dummy step (= max_batched_tokens)
    num_logits_rows: int  # rows sampled (every stream's, and its proposals' with speculation)
    peak_bytes: int  # device memory the step needed beyond what was allocated before it (0 on CPU)


def largest_step(max_batched_tokens: int, max_running: int, block_size: int,
                 num_speculative_tokens: int = 0) -> SchedulerOutput:
    """The step with the most tokens and the most logits rows: decodes for all streams but one
    (each verifying `num_speculative_tokens` proposals, with speculation), whose prefill chunk
    takes the rest of the token budget. Block tables are 0, 1, 2, ... (a dummy pool of
    `blocks_for(step)` blocks holds them)."""
    per_stream = 1 + num_speculative_tokens
    num_streams = max(1, min(max_running, max_batched_tokens // per_stream))
    prefill_tokens = max(1, max_batched_tokens - (num_streams - 1) * per_stream)
    chunks, next_block = [], 0
    params = SamplingParams(max_tokens=1)
    for i in range(num_streams):
        length = prefill_tokens if i == num_streams - 1 else per_stream
        num_blocks = -(-length // block_size)
        table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        if i == num_streams - 1 or not num_speculative_tokens:
            seq = Sequence(f"profile-{i}", [0] * length, params)
            chunks.append(ScheduledChunk(seq, 0, length, table, emits_token=True))
        else:  # a stream verifying proposals: its last token, then the proposals
            seq = Sequence(f"profile-{i}", [0], params)
            chunks.append(ScheduledChunk(seq, 0, 1 + num_speculative_tokens, table,
                                         emits_token=True, lookahead=num_speculative_tokens,
                                         draft=[0] * num_speculative_tokens))
    return SchedulerOutput(chunks=chunks)


def blocks_for(step: SchedulerOutput) -> int:
    return sum(len(c.block_table) for c in step.chunks)


def profile_step(model: torch.nn.Module, layout: KVLayout, block_size: int, max_batched_tokens: int,
                 max_running: int, device: torch.device, attention_backend: AttentionBackend,
                 num_heads: int | None = None, num_speculative_tokens: int = 0) -> StepProfile:
    """Run the largest step through a throwaway pool, then sample it the most expensive way
    (top-p's full sort, penalties, logprobs); report the peak memory it took."""
    step = largest_step(max_batched_tokens, max_running, block_size, num_speculative_tokens)
    measuring = is_cuda(device)
    if measuring:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if measuring else 0
    pool = KVCachePool(layout, blocks_for(step), block_size, device)
    runner = ModelRunner(model, pool, attention_backend=attention_backend, num_heads=num_heads)
    emitting, logits = runner.execute(step)
    worst = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50,
                           repetition_penalty=1.1, frequency_penalty=0.1, logprobs=20, seed=0)
    Sampler([]).sample(logits, [SamplerInput(worst, c.seq.prompt_token_ids, [])
                                for c in emitting for _ in range(c.num_logits)])
    peak = 0
    if measuring:
        torch.cuda.synchronize(device)
        peak = max(0, torch.cuda.max_memory_allocated(device) - before - pool.num_bytes)
    num_rows = logits.shape[0]
    del pool, runner, logits
    if measuring:
        torch.cuda.empty_cache()
    return StepProfile(step.num_batched_tokens, num_rows, peak)
