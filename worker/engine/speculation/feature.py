"""Speculative decoding in the engine's step lifecycle (lifecycle.py): the speculator's plan is
the step's lookahead, its proposals are attached to the chunks that reserved slots for them,
verification teaches it. With a draft model, everything of the draft lives here: the model's
prepared copy (placed before the KV budget is planned: on CUDA its weights are memory in use),
its KV layout (the budget shares the KV bytes out with it), its pool (the target's block ids),
runner and KV accounting (draft.py), and its part of a handoff."""

from __future__ import annotations

import torch

from kvfleet.worker.engine.attention import resolve_attention_backend
from kvfleet.worker.engine.core.config import EngineConfig, ModelConfig, SpeculativeConfig
from kvfleet.worker.engine.core.handoff import HandoffError, SequenceState, pool_layout, state_blocks
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
from kvfleet.worker.engine.memory.kv_format import KVFormat
from kvfleet.worker.engine.core.lifecycle import Feature, Samples
from kvfleet.worker.engine.model.model_prep import PreparedModel, load_pretrained, pack_for_cpu, prepare_model
from kvfleet.worker.engine.core.model_runner import ModelRunner, StepLogits
from kvfleet.worker.engine.core.scheduler import Attachments, ScheduledChunk, Scheduler, SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.speculation.draft import DraftModel
from kvfleet.worker.engine.speculation.speculator import Speculator


def draft_model_of(config: EngineConfig, draft_model: torch.nn.Module | None,
                   tensor_parallel: bool) -> torch.nn.Module | None:
    """The draft model: given, or loaded from `speculative_config.model` (draft_model)."""
    spec = config.speculative_config
    if draft_model is None and spec is not None and spec.method == "draft_model":
        if spec.model is None:
            raise ValueError("speculative_config method draft_model needs `model`")
        draft_model = load_pretrained(spec.model, config.model.dtype, config.model.device)
    if draft_model is None:
        return None
    if tensor_parallel:
        raise ValueError("a draft model is not supported with tensor parallelism "
                         "(speculate with method ngram or suffix)")
    if spec is not None and spec.method != "draft_model":
        raise ValueError(f"a draft model was given but speculative_config method is "
                         f"{spec.method!r}")
    return draft_model


class Speculation(Feature):
    """Speculative decoding of one engine (`--speculative-config`, or a draft model given with
    its defaults)."""

    def __init__(self, config: SpeculativeConfig, max_batched_tokens: int,
                 placed: PreparedModel | None = None, kv_layout: KVLayout | None = None):
        self.config, self.max_batched_tokens = config, max_batched_tokens
        self.placed, self.kv_layout = placed, kv_layout  # the draft model's, until `start`
        self.prepared: PreparedModel | None = None  # the draft model as it runs
        self.pool: KVCachePool | None = None  # the draft model's KV
        self.draft: DraftModel | None = None
        self.speculator: Speculator | None = None

    @classmethod
    def load(cls, config: EngineConfig, draft_model: torch.nn.Module | None, tensor_parallel: bool,
             device: torch.device, dtype: torch.dtype, kv_format: KVFormat) -> Speculation | None:
        """Before the KV budget: the draft model placed on the device; None without speculation."""
        draft_model = draft_model_of(config, draft_model, tensor_parallel)
        spec = config.speculative_config
        if spec is None and draft_model is None:
            return None
        spec = spec or SpeculativeConfig(method="draft_model")
        max_batched_tokens = config.scheduler.max_batched_tokens
        if draft_model is None:
            return cls(spec, max_batched_tokens)
        return cls(spec, max_batched_tokens, prepare_model(draft_model, device, dtype),
                   KVLayout.from_model_config(draft_model.config, kv_format))

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        """With the target's pool: the draft's, as many blocks of the same size."""
        if self.kv_layout is not None:
            self.pool = KVCachePool(self.kv_layout, num_blocks, block_size, device)

    def start(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
              max_model_len: int, vocab_size: int) -> None:
        """After the target's runner: the draft's packed model and runner; the speculator."""
        draft = None
        if self.placed is not None:
            pool = self.pool
            backend = resolve_attention_backend(
                model_config.attention_backend, device, dtype, pool.layout.kv_format,
                pool.layout.head_dim, deterministic=model_config.deterministic)
            self.prepared = pack_for_cpu(self.placed, backend.cpu_kernel,
                                         model_config.deterministic)
            self.placed = None
            if self.prepared.module.config.vocab_size < vocab_size:
                raise ValueError(f"the draft model's vocabulary "
                                 f"({self.prepared.module.config.vocab_size}) is smaller than the "
                                 f"model's ({vocab_size}): not the same tokenizer")
            runner = ModelRunner(self.prepared.module, pool, attention_backend=backend,
                                 num_heads=self.prepared.num_heads)
            draft = self.draft = DraftModel(runner, vocab_size)
        self.speculator = Speculator(self.config, max_model_len, draft)

    # ---- the step -----------------------------------------------------------------------------

    def lookahead(self, scheduler: Scheduler) -> dict[str, int]:
        pending = sum(s.num_uncomputed_tokens for s in scheduler.running) + sum(
            s.num_uncomputed_tokens for s in scheduler.waiting)
        return self.speculator.plan(scheduler.decoding(), min(pending, self.max_batched_tokens))

    def attach(self, chunks: list[ScheduledChunk]) -> Attachments:
        return Attachments(proposals=self.speculator.proposals(chunks))

    def scheduled(self, sched: SchedulerOutput) -> None:
        for req_id in sched.preempted_req_ids:
            self.speculator.preempted(req_id)

    def executed(self, sched: SchedulerOutput, step: StepLogits, samples: Samples,
                 start: float, seconds: float) -> None:
        speculator = self.speculator
        speculator.observe_step(sched.num_batched_tokens, seconds)
        for chunk in step.emitting:
            if chunk.draft and chunk.seq.req_id in samples:
                speculator.observe(chunk, len(samples[chunk.seq.req_id]) - 1)

    def leave(self, seq: Sequence) -> None:
        self.speculator.finish(seq)

    def stats(self) -> dict:
        spec = self.speculator.stats
        return {"spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_position": tuple(spec.accepted_per_position)}

    # ---- handoff: the draft's KV goes with its stream -----------------------------------------

    def handoff_layout(self) -> dict:
        if self.draft is None:
            return {}
        return {"draft": {**pool_layout(self.draft.pool),
                          "vocab_size": self.prepared.module.config.vocab_size}}

    def kv_bytes(self, seq: Sequence) -> int:
        return 0 if self.draft is None else self.draft.kv_bytes(seq)

    def export(self, seq: Sequence, table: list[int] | None) -> dict:
        if self.draft is None:
            return {}
        host, computed = self.draft.export_kv(seq, table)
        return {} if host is None else {"draft_values": host.values, "draft_scales": host.scales,
                                        "draft_num_computed_tokens": computed}

    def check_import(self, state: SequenceState) -> None:
        self._held_of(state)

    def take_import(self, state: SequenceState) -> None:
        host = self._held_of(state)
        if host is not None:
            self.draft.hold(state.req_id, host, state.draft_num_computed_tokens)

    def _held_of(self, state: SequenceState):
        if state.draft_values is None and state.draft_scales is None:
            return None
        if self.draft is None or not (0 < state.draft_num_computed_tokens
                                      <= state.num_computed_tokens):
            raise HandoffError(f"handoff of {state.req_id!r}: draft KV of "
                               f"{state.draft_num_computed_tokens} positions does not fit here")
        return state_blocks(state, "draft_values", "draft_scales",
                            state.draft_num_computed_tokens, self.draft.pool)
