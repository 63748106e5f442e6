"""The engine the worker service drives: add requests, step, abort; plus offline `generate`.

`Engine` composes the parts, each in its own module: the model's preparation (model_prep.py),
the KV budget and the preemption priors (budget.py), the checks and outputs of a request
(request_io.py), scheduling (scheduler.py), the forward (model_runner.py; on tensor-parallel
ranks tp_steps.py), swapped-out KV (swapping.py), sampling (step_sampling.py), output
constraints (worker/structured/requests.py), LoRA adapters (lora/manager.py), reports and
counters (reports.py, numerics.py), a running sequence's move to another engine (handoff.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from shared.wire import RequestStatus, SamplingParams
from worker.engine import reports
from worker.engine.block_manager import BlockManager
from worker.engine.budget import plan_kv_budget, preemption_cost_model
from worker.engine.config import EngineConfig, SpeculativeConfig
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.attention import resolve_attention_backend
from worker.engine.device import (
    is_cuda, resolve_block_size, resolve_device, resolve_dtype, select_device)
from worker.engine.kv_cache import KVCachePool, KVLayout
from worker.engine.handoff import (
    HandoffError, SequenceState, check_layout, host_blocks, pool_layout)
from worker.engine.invariance import invariance_gap
from worker.engine.lora import LoraLoadError, LoraRequest, LoraStats
from worker.engine.lora.manager import LoraManager
from worker.engine.kv_format import resolve_kv_format
from worker.engine.numerics import engine_numerics
from worker.engine.model_prep import (
    PreparedModel, eos_token_ids_of, load_pretrained, max_model_len_of, pack_for_cpu, prepare_model)
from worker.engine.model_runner import ModelRunner, StepLogits
from worker.engine.pace import Pace, PaceReport, step_features
from worker.engine.preemption import SwapSpace
from worker.engine.reports import EngineStats
from worker.engine.request_io import (
    RequestOutput, check_request, emission_output, request_output)
from worker.engine.sampler import Sampler
from worker.engine.scheduler import Scheduler, SchedulerOutput, TokenEmission
from worker.engine.sequence import Sequence
from worker.engine.speculation.draft import DraftModel
from worker.engine.speculation.speculator import Speculator
from worker.engine.step_sampling import (
    Failures, advance_constrained, raise_if_sticky, record_prompt_logprobs, sample_rows)
from worker.engine.stopping import StopChecker
from worker.engine.swapping import SwappedKV
from worker.engine.tp_group import RankGroup
from worker.engine.tp_steps import forward_on_ranks
from worker.structured.compiler import GrammarCompiler
from worker.structured.requests import ConstrainedRequests

__all__ = ["Engine", "EngineConfig", "EngineStats", "LoraLoadError", "LoraRequest", "LoraStats",
           "RequestOutput", "load_pretrained"]

log = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over one model and one KV block pool.

    The model is never changed: the engine runs its own prepared copy (`prepared`; `model` is
    its module), weights shared. A `draft_model` goes through the same preparation (`draft`).
    With tensor parallelism (`ranks`), every rank builds one over its shard of the model and its
    own pool of its KV heads; rank 0's engine schedules, samples and sends each step to the
    others (`tp_rank.follow`). `tp_rank.launch_engine` starts the ranks and makes rank 0's.
    """

    def __init__(self, model, config: EngineConfig, tokenizer=None, ranks: RankGroup | None = None,
                 draft_model: torch.nn.Module | None = None):
        self.config, self.ranks = config, ranks
        self.device = ranks.device if ranks is not None else resolve_device(config.device)
        select_device(self.device)  # cuda:N is the current device from here on
        self.dtype = resolve_dtype(config.dtype, self.device)
        layout = KVLayout.from_model_config(model.config, resolve_kv_format(config.kv_dtype, self.dtype))
        placed = prepare_model(model, self.device, self.dtype, ranks)
        if placed.shard is not None:
            layout = replace(layout, num_kv_heads=placed.shard.num_kv_heads)
        draft_model = self._draft_model(draft_model)
        # placed before the KV budget is planned: on CUDA its weights are memory in use
        placed_draft = None if draft_model is None else prepare_model(
            draft_model, self.device, self.dtype)
        draft_layout = None if draft_model is None else KVLayout.from_model_config(
            draft_model.config, layout.kv_format)
        self.max_model_len = max_model_len_of(placed.module.config)
        self.kv_format = layout.kv_format
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.device, self.dtype, layout.kv_format, layout.head_dim,
            deterministic=config.deterministic)
        # its slots are on the device before the KV budget is planned: memory in use on CUDA
        self.lora = None if not config.enable_lora else LoraManager.for_engine(
            config, model, self.dtype, self.device, self.attention_backend, ranks, placed.shard)
        block_size = resolve_block_size(config.block_size, self.attention_backend.cpu_kernel,
                                        self.dtype, layout.kv_format.storage)
        config = self.config = replace(config, block_size=block_size)
        graphs_mode = self._graphs_mode()
        self.budget = plan_kv_budget(placed, layout, config, self.max_model_len,
                                     self.attention_backend, ranks, draft_layout)
        self.pool = KVCachePool(layout, self.budget.num_blocks, config.block_size, self.device)
        self.draft_pool = None if draft_layout is None else KVCachePool(
            draft_layout, self.budget.num_blocks, config.block_size, self.device)
        # with decode graphs the pool's last block is their padding rows' scratch, never handed out
        num_usable_blocks = self.budget.num_blocks - (graphs_mode is not None)
        if num_usable_blocks < 1:
            raise ValueError("the KV budget holds no block beside the CUDA graphs' scratch block")
        self.block_manager = BlockManager(
            num_usable_blocks, config.block_size, config.enable_prefix_caching)
        self.swap_space = SwapSpace(config.swap_space_bytes // self.pool.block_bytes)
        self.preemption = preemption_cost_model(config.preemption, self.pool, placed.module)
        self.swapped = SwappedKV(self.pool, self.preemption, self.draft_pool)
        self._start_scheduling(placed.module, tokenizer)
        self._start_runner(placed, placed_draft, graphs_mode)
        self.speculator = self._speculator()
        self._seqs: dict[str, Sequence] = {}
        if ranks is None or ranks.is_driver:
            log.info("engine: %s; numerics %s", self.device_report(), self.numerics.describe())
            for line in self.budget_report():
                log.info("KV budget: %s", line)

    def _start_scheduling(self, model: torch.nn.Module, tokenizer) -> None:
        """The scheduler and its stop rules, the sampler, the output constraints."""
        config, eos = self.config, eos_token_ids_of(model)
        lora = self.lora
        self.pace = Pace(config)  # fits the step cost always; binds only with a target
        self.scheduler = Scheduler(
            self.block_manager, StopChecker(eos, self.max_model_len, tokenizer),
            config.max_batched_tokens, config.max_running, config.watermark,
            preemption=self.preemption, swap_space=self.swap_space,
            max_loras=config.max_loras if lora else 0,
            adapter_ready=lora.is_ready if lora else None,
            pace=self.pace if self.pace.enabled else None)
        self.sampler = Sampler(eos)
        # Structured outputs: one grammar matcher per constrained request (needs the tokenizer).
        self.constrained = ConstrainedRequests(
            GrammarCompiler(tokenizer, model.config.vocab_size, eos, config.grammar_cache_size)
            if tokenizer is not None else None)

    def _start_runner(self, placed: PreparedModel, placed_draft: PreparedModel | None,
                      graphs_mode: str | None) -> None:
        """The model (and draft) packed for the device, the runner, its decode graphs."""
        # fused layers where the C++ attention kernel reads this pool
        fuse_layers, invariant = self.attention_backend.cpu_kernel, self.config.deterministic
        self.prepared = pack_for_cpu(placed, fuse_layers, invariant)
        self.draft: PreparedModel | None = None
        if placed_draft is not None:
            self.draft_backend = resolve_attention_backend(
                self.config.attention_backend, self.device, self.dtype,
                self.draft_pool.layout.kv_format, self.draft_pool.layout.head_dim,
                deterministic=invariant)
            self.draft = pack_for_cpu(placed_draft, self.draft_backend.cpu_kernel, invariant)
        # None: every row is computed batch-invariantly (invariance.py); else why not
        self.invariance_gap = invariance_gap(self.prepared, self.attention_backend, invariant)
        if invariant and self.invariance_gap is not None and (self.ranks is None
                                                               or self.ranks.is_driver):
            log.warning("--deterministic: answers may depend on the batch: %s", self.invariance_gap)
        self.model = self.prepared.module
        self.numerics = engine_numerics(  # what decides how this engine rounds
            self.device, self.dtype, self.attention_backend, self.kv_format.name,
            self.config.block_size, self.model, self.invariance_gap, self.ranks)
        if self.lora is not None:  # before any graph is captured: captured without terms
            self.lora.install(self.model)
        self.runner = ModelRunner(self.model, self.pool, attention_backend=self.attention_backend,
                                  decode_graphs=self._decode_graphs(graphs_mode),
                                  num_heads=self.prepared.num_heads, lora=self.lora)
        if graphs_mode == "capture":  # after the runner installed its attention on the model
            started = time.perf_counter()
            self.runner.decode_graphs.capture()
            graphs = self.runner.decode_graphs
            log.info("captured decode CUDA graphs for batch sizes %s x proposals %s in %.1f s",
                     graphs.buckets, graphs.proposal_buckets, time.perf_counter() - started)

    def _draft_model(self, draft_model: torch.nn.Module | None) -> torch.nn.Module | None:
        """The draft model: given, or loaded from `speculative_config.model` (draft_model)."""
        spec = self.config.speculative_config
        if draft_model is None and spec is not None and spec.method == "draft_model":
            if spec.model is None:
                raise ValueError("speculative_config method draft_model needs `model`")
            draft_model = load_pretrained(spec.model, self.config.dtype, self.config.device)
        if draft_model is None:
            return None
        if self.ranks is not None:
            raise ValueError("a draft model is not supported with tensor parallelism "
                             "(speculate with method ngram or suffix)")
        if spec is not None and spec.method != "draft_model":
            raise ValueError(f"a draft model was given but speculative_config method is "
                             f"{spec.method!r}")
        return draft_model

    def _speculator(self) -> Speculator | None:
        """Speculative decoding's planner (`--speculative-config`, or a draft model given with
        its defaults); None without either."""
        spec = self.config.speculative_config
        if spec is None and self.draft is None:
            return None
        spec = spec or SpeculativeConfig(method="draft_model")
        draft = None
        if self.draft is not None:
            runner = ModelRunner(self.draft.module, self.draft_pool,
                                 attention_backend=self.draft_backend,
                                 num_heads=self.draft.num_heads)
            vocab_size = self.model.config.vocab_size
            if self.draft.module.config.vocab_size < vocab_size:
                raise ValueError(f"the draft model's vocabulary ({self.draft.module.config.vocab_size}) "
                                 f"is smaller than the model's ({vocab_size}): not the same tokenizer")
            draft = DraftModel(runner, vocab_size)
        return Speculator(spec, self.max_model_len, draft)

    def _graphs_mode(self) -> str | None:
        """'capture' (CUDA graphs), 'eager' (their static buffers, no capture) or None (off)."""
        mode = self.config.cuda_graphs
        if mode == "off" or (mode == "auto" and not is_cuda(self.device)):
            return None
        if self.ranks is not None:  # a step's collectives are not captured: ranks run eagerly
            if mode == "auto":
                return None
            raise ValueError("cuda_graphs 'eager' is not supported with tensor parallelism")
        if not self.attention_backend.decode_graphs:
            if mode == "auto":
                return None
            raise ValueError("cuda_graphs 'eager' needs the triton attention backend")
        return "capture" if mode == "auto" else "eager"

    def _decode_graphs(self, graphs_mode: str | None) -> DecodeGraphs | None:
        if graphs_mode is None:
            return None
        spec = self.config.speculative_config
        return DecodeGraphs(self.model, self.pool, scratch_block=self.budget.num_blocks - 1,
                            max_batch=self.config.max_running, max_model_len=self.max_model_len,
                            max_proposals=0 if spec is None else spec.num_speculative_tokens)

    @classmethod
    def from_pretrained(cls, model_path: str, config: EngineConfig, tokenizer=None) -> Engine:
        """One rank's engine (several ranks: `tp_rank.launch_engine` with `load_pretrained`)."""
        if config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1: start the ranks with tp_rank.launch_engine")
        model = load_pretrained(model_path, config.dtype, config.device, config.load_format)
        return cls(model.to(resolve_device(config.device)), config, tokenizer=tokenizer)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one)."""
        if self.ranks is not None and self.ranks.is_driver:
            self.ranks.stop()

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] | None = None,
                    lora: LoraRequest | None = None, arrival: float | None = None) -> None:
        """Queue a request; `output_token_ids` resumes one (sampling continues at their count);
        `lora`: the adapter it runs under (LoraLoadError, a ValueError, if it cannot be served);
        `arrival`: its enqueue's unix time (its first token's time is measured from it)."""
        self._enter(req_id, prompt_token_ids, params, output_token_ids or [], lora)
        # resumed past its first output: its prompt logprobs went out with that output
        seq = Sequence(req_id, prompt_token_ids, params, output_token_ids=output_token_ids or [],
                       prompt_logprobs_sent=bool(output_token_ids), lora=lora, arrival=arrival)
        self._seqs[req_id] = seq
        self.scheduler.add(seq)

    def _enter(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
               output_token_ids: list[int], lora: LoraRequest | None) -> None:
        """Check a request and take what it holds here (its adapter, its grammar matcher); a
        ValueError, with nothing taken, when it cannot be served."""
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already in the engine")
        check_request(req_id, prompt_token_ids, params, self.max_model_len, self.block_manager)
        if lora is not None:
            if self.lora is None:
                raise LoraLoadError(f"request {req_id!r} names adapter {lora.name!r}, but this "
                                    "engine serves no LoRA adapters (--enable-lora)")
            self.lora.acquire(req_id, lora)  # loaded (or waiting for room) and held from here
        try:
            # a resumed request replays its tokens through its grammar: same masks as before
            self.constrained.add(req_id, params.constraint, output_token_ids)
        except BaseException:
            if self.lora is not None:
                self.lora.release(req_id)
            raise

    def abort(self, req_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once; None if it is not (or no longer) here."""
        seq = self._seqs.get(req_id)
        if seq is None:
            return None
        self._left(seq)
        self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        self.constrained.discard(req_id)
        return request_output(seq, [], None, self.scheduler.stop_checker)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- prefix cache, as the fleet sees it ---------------------------------------------------

    def set_prefix_root(self, root: bytes) -> None:
        """Hash prefix-cache blocks from `root` (`prefix_hash.root_hash(served model id)`, what
        the gateways' router uses); before the first request. Offline use keeps the default."""
        self.block_manager.set_root(root)

    def num_cached_prefix_blocks(self, token_ids: list[int],
                                 prefix_root: bytes | None = None) -> int:
        """Leading full blocks of `token_ids` in the prefix cache now (hashed from
        `prefix_root`: an adapter's, `LoraRequest.prefix_root`; None: the engine's own)."""
        return self.block_manager.num_cached_leading_blocks(token_ids, prefix_root)

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache now."""
        return self.block_manager.cached_hashes()

    def drain_block_announcements(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) block hashes of the prefix cache since the last call (net change)."""
        return self.block_manager.drain_announcements()

    def can_admit(self, num_prompt_tokens: int) -> bool:
        """Whether free blocks (incl. evictable cached ones) hold this prompt beside the watermark."""
        bm = self.block_manager
        return bm.blocks_for_tokens(num_prompt_tokens) <= bm.num_free_blocks - self.scheduler.watermark_blocks

    def admissible_tokens(self) -> int:
        """The most prompt tokens `can_admit` accepts now (-1: not even an empty prompt): the
        worker's admission budget. `can_admit` grows no easier with more tokens, so a binary
        search finds it."""
        if not self.can_admit(0):
            return -1
        low, high = 0, self.block_manager.num_blocks * self.config.block_size + 1
        while high - low > 1:  # can_admit(low) holds, can_admit(high) does not
            middle = (low + high) // 2
            if self.can_admit(middle):
                low = middle
            else:
                high = middle
        return low

    # ---- handoff: a running sequence and its KV to another engine (handoff.py) ----------------

    def handoff_layout(self) -> dict:
        """What an engine taking this one's sequences must match: the model (its prefix root
        names the served model), the geometry and format of its KV blocks, the draft model's."""
        return {**pool_layout(self.pool), "block_size": self.config.block_size,
                "vocab_size": self.model.config.vocab_size,
                "dtype": str(self.dtype).removeprefix("torch."),
                "prefix_root": self.block_manager.root.hex(),
                "draft": None if self.draft is None else {
                    **pool_layout(self.draft_pool),
                    "vocab_size": self.draft.module.config.vocab_size}}

    def handoff_gap(self) -> str | None:
        """None when this engine can export and import sequences; else why not."""
        if self.ranks is not None:
            return "tensor parallelism (each rank holds a share of the KV heads)"
        return None

    def kv_bytes_of(self, req_id: str) -> int:
        """Bytes `export_sequence` would move now (0: it would not export the sequence)."""
        seq = self._exportable(req_id)
        if seq is None:
            return 0
        if seq.num_swapped_blocks:
            return self.swapped.num_bytes_of(req_id)
        bm, draft_pool = self.block_manager, self.draft_pool
        num_bytes = bm.blocks_for_tokens(seq.num_computed_tokens) * self.pool.block_bytes
        if draft_pool is not None:
            num_bytes += bm.blocks_for_tokens(self._draft_computed(seq)) * draft_pool.block_bytes
        return num_bytes

    def export_sequence(self, req_id: str) -> SequenceState | None:
        """Take a sequence out with a host copy of its KV, to continue in another engine
        (between steps only): a RUNNING one with computed KV (mid-prefill chunks too), or a
        PREEMPTED one whose KV is swapped out (its host copy is the state's). It leaves as an
        aborted one does (blocks freed; its adapter, grammar matcher and speculation released),
        without an output. None when it is not here or holds no KV (queued, or preempted for
        recompute), or while its prompt logprobs are computed (those so far would be lost; from
        its first output on it can go): it then stays."""
        seq = self._exportable(req_id)
        if seq is None:
            return None
        draft_computed = self._draft_computed(seq)
        if seq.num_swapped_blocks:
            host, draft = self.swapped.take(req_id)
        else:
            bm = self.block_manager
            table = bm.block_table(req_id)
            host = self.pool.copy_out(table[:bm.blocks_for_tokens(seq.num_computed_tokens)])
            draft = None if not draft_computed else self.draft_pool.copy_out(
                table[:bm.blocks_for_tokens(draft_computed)])
        state = SequenceState(
            req_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.params,
            seq.num_computed_tokens, seq.num_cached_tokens, seq.lora, self.handoff_layout(),
            host.values, host.scales,
            draft_values=None if draft is None else draft.values,
            draft_scales=None if draft is None else draft.scales,
            draft_num_computed_tokens=0 if draft is None else draft_computed)
        self._left(seq)
        self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        self.constrained.discard(req_id)
        return state

    def import_sequence(self, state: SequenceState) -> None:
        """Add a sequence handed over by another engine (or given back to this one). It waits
        as a swapped-out preempted sequence does (its host copy held here, not limited by
        --swap-space: a handoff is not swap), is swapped into fresh blocks when its whole known
        sequence fits beside the watermark, and continues with nothing computed again. The
        request is checked as `add_request` checks one (its adapter acquired, its grammar
        replayed over its output); its prompt logprobs went out with its first output.
        HandoffError, with nothing changed, when this engine cannot take it."""
        gap = self.handoff_gap()
        if gap is not None:
            raise HandoffError(f"this engine takes no handoff: {gap}")
        check_layout(state, self.handoff_layout())
        host, draft = host_blocks(state, self.pool, self.draft_pool)
        req_id, prompt, output = state.req_id, state.prompt_token_ids, state.output_token_ids
        if state.params.prompt_logprobs is not None and not output:
            raise HandoffError(f"handoff of {req_id!r}: its prompt logprobs are not in it")
        try:
            self._enter(req_id, prompt, state.params, output, state.lora)
        except ValueError as exc:  # LoraLoadError and the grammar's errors too
            raise HandoffError(f"handoff of {req_id!r}: {exc}") from exc
        seq = Sequence(req_id, prompt, state.params, output_token_ids=output,
                       num_cached_tokens=state.num_cached_tokens,
                       prompt_logprobs_sent=bool(output), lora=state.lora)
        self._seqs[req_id] = seq
        self.swapped.hold(req_id, host, draft)
        if draft is not None:
            self._draft_kv_counts()[req_id] = state.draft_num_computed_tokens
        self.scheduler.add_swapped_out(seq, state.num_computed_tokens, host.num_blocks)

    def _exportable(self, req_id: str) -> Sequence | None:
        """The sequence, when `export_sequence` would hand it over now."""
        seq = self._seqs.get(req_id)
        if seq is None or self.handoff_gap() is not None or (
                seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent):
            return None
        if seq.status is RequestStatus.RUNNING and seq.num_computed_tokens > 0:
            return seq
        if seq.status is RequestStatus.PREEMPTED and req_id in self.swapped.held:
            return seq
        return None

    def _draft_computed(self, seq: Sequence) -> int:
        """Leading positions of the sequence whose draft-model KV is valid (0 without one)."""
        counts = self._draft_kv_counts()
        return 0 if counts is None else min(counts.get(seq.req_id, 0), seq.num_computed_tokens)

    def _draft_kv_counts(self) -> dict[str, int] | None:
        """req_id -> leading positions of valid draft-model KV, the draft model's own count
        (None without one). Read and written here because speculation/draft.py has no
        accessor for it: a handed-over sequence's draft KV is used only once that count says so."""
        draft = None if self.speculator is None else self.speculator.draft
        return None if draft is None else draft._computed

    # ---- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; outputs of requests that got a token or finished."""
        outputs = [self._finish_output(seq) for seq in self.scheduler.take_finished_at_add()]
        if self.lora is not None:  # adapters that found room since: their requests may run
            outputs += self._fail([(self._seqs[req_id], exc)
                                   for req_id, exc in self.lora.load_pending()])
        sched = self._schedule()
        if self.ranks is not None:
            ran = forward_on_ranks(self.ranks, self.runner, sched, self.config.block_size,
                                   self.swapped.apply)
            return outputs + ([] if ran is None else self._sample_and_update(sched, *ran))
        self.swapped.apply(sched)
        if sched.is_empty:
            return outputs
        start = time.perf_counter()
        try:
            step = self.runner.execute(sched)
        except Exception as exc:  # the whole batch failed: fail its requests, keep the engine
            raise_if_sticky(exc)
            log.exception("forward failed for %d requests", len(sched.chunks))
            return outputs + self._fail([(c.seq, exc) for c in sched.chunks])
        return outputs + self._sample_and_update(sched, step, start)

    def _schedule(self) -> SchedulerOutput:
        """The step's work; with speculation, the decoding streams' proposals in it; with
        adapters, each chunk's slot (and the adapters loaded into slots for it)."""
        sched = self._schedule_tokens()
        if self.lora is not None:
            sched.lora_loads = self.lora.assign_slots(sched.chunks)
        return sched

    def _schedule_tokens(self) -> SchedulerOutput:
        if self.speculator is None:
            return self.scheduler.schedule()
        scheduler = self.scheduler
        pending = sum(s.num_uncomputed_tokens for s in scheduler.running) + sum(
            s.num_uncomputed_tokens for s in scheduler.waiting)
        lookahead = self.speculator.plan(scheduler.decoding(),
                                         min(pending, self.config.max_batched_tokens))
        sched = scheduler.schedule(lookahead)
        for req_id in sched.preempted_req_ids:
            self.speculator.preempted(req_id)
        self.speculator.fill(sched)
        return sched

    def _sample_and_update(self, sched: SchedulerOutput, step: StepLogits,
                           start: float) -> list[RequestOutput]:
        # waits for the device
        samples, failed = sample_rows(self.sampler, self.constrained, step.emitting, step.logits)
        failed += record_prompt_logprobs(step)
        seconds = time.perf_counter() - start
        prefill_tokens = sum(c.num_tokens - len(c.draft) for c in sched.chunks
                             if c.num_tokens - len(c.draft) > 1)
        self.preemption.observe_step(prefill_tokens, sched.num_batched_tokens, seconds)
        self.pace.observe(step_features(sched), start, seconds)
        if self.speculator is not None:
            self.speculator.observe_step(sched.num_batched_tokens, seconds)
            for chunk in step.emitting:
                if chunk.draft and chunk.seq.req_id in samples:
                    self.speculator.observe(chunk, len(samples[chunk.seq.req_id]) - 1)
        outputs = self._fail(failed)
        emissions = self.scheduler.update(sched, samples)
        for emission in emissions:
            if emission.token_ids:
                self.pace.emitted(emission.seq, len(emission.token_ids))
        outputs += [self._emission_output(e) for e in emissions]
        return outputs + self._fail(advance_constrained(self.constrained, emissions))

    def _fail(self, failures: Failures) -> list[RequestOutput]:
        """Finish each failed request with FINISHED_ERROR; its blocks return at once."""
        outputs = []
        for seq, error in failures:
            if seq.status.is_finished:  # failed twice in one step (sampling, prompt logprobs)
                continue
            self.scheduler.finish(seq, RequestStatus.FINISHED_ERROR, error=f"{type(error).__name__}: {error}")
            outputs.append(self._finish_output(seq))
        return outputs

    def _emission_output(self, emission: TokenEmission) -> RequestOutput:
        if emission.finished:
            self._left(emission.seq)
        return emission_output(emission, self.scheduler.stop_checker)

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        self._left(seq)
        self.constrained.discard(seq.req_id)
        return request_output(seq, [], None, self.scheduler.stop_checker)

    def _left(self, seq: Sequence) -> None:
        """A request left the engine (finished, failed, aborted or handed over)."""
        self._seqs.pop(seq.req_id, None)
        # swapped out (or handed over and not yet in): its host copy goes with it
        if self.swapped.discard(seq.req_id) and self.ranks is not None:
            self.ranks.discard_swapped(seq.req_id)
        if self.speculator is not None:
            self.speculator.finish(seq)
        if self.lora is not None:
            self.lora.release(seq.req_id)

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return reports.engine_stats(self.block_manager, self.scheduler, self.runner,
                                    self.swapped.num_bytes, self.constrained,
                                    None if self.speculator is None else self.speculator.stats)

    def pace_report(self) -> PaceReport:
        """The pace promised and kept, the room left at it, the fitted step cost (pace.py)."""
        scheduler = self.scheduler
        return self.pace.report(scheduler.running, scheduler.waiting, self.config.max_running)

    def lora_stats(self) -> LoraStats:
        """The adapters loaded (most recently used first), in slots, loads and evictions."""
        return LoraStats() if self.lora is None else self.lora.stats()

    def device_report(self) -> str:
        """Device, dtype (and what --dtype said), and on CPU the model and ISA behind `auto`."""
        return reports.device_report(self.device, self.dtype, self.attention_backend,
                                     self.config.dtype, self.config.deterministic,
                                     self.invariance_gap)

    def budget_report(self) -> list[str]:
        lines = reports.budget_report(self.budget, self.pool, self.dtype, self.swap_space,
                                      self.preemption,
                                      None if self.ranks is None else self.ranks.world_size)
        return lines + ([self.lora.report()] if self.lora is not None else [])

    # ---- offline ------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion; the generated token ids of each, in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        req_ids = [f"generate-{id(self)}-{i}" for i in range(len(prompts))]
        for req_id, prompt, p in zip(req_ids, prompts, params_list):
            self.add_request(req_id, prompt, p)
        results: dict[str, list[int]] = {r: [] for r in req_ids}
        while self.has_unfinished():
            for out in self.step():
                if out.req_id in results:
                    results[out.req_id].extend(out.new_token_ids)
        return [results[r] for r in req_ids]
