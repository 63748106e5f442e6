"""The engine the worker service drives: add requests, step, abort; plus offline `generate`.

`Engine` composes the parts, each in its own module: the model's preparation (model_prep.py),
the KV budget and the preemption priors (budget.py), the checks and outputs of a request
(request_io.py), scheduling (scheduler.py), the forward (model_runner.py; on tensor-parallel
ranks tp_steps.py), swapped-out KV (swapping.py), sampling (step_sampling.py), output
constraints (worker/structured/requests.py), LoRA adapters (lora/manager.py) and the operator's
reports and counters (reports.py).
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
from worker.engine.invariance import invariance_gap
from worker.engine.lora import LoraLoadError, LoraRequest, LoraStats
from worker.engine.lora.manager import LoraManager
from worker.engine.kv_format import resolve_kv_format
from worker.engine.model_prep import (
    PreparedModel, eos_token_ids_of, load_pretrained, max_model_len_of, pack_for_cpu, prepare_model)
from worker.engine.model_runner import ModelRunner, StepLogits
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
        self.swapped = SwappedKV(self.pool, self.preemption)
        self._start_scheduling(placed.module, tokenizer)
        self._start_runner(placed, placed_draft, graphs_mode)
        self.speculator = self._speculator()
        self._seqs: dict[str, Sequence] = {}
        if ranks is None or ranks.is_driver:
            log.info("engine: %s", self.device_report())
            for line in self.budget_report():
                log.info("KV budget: %s", line)

    def _start_scheduling(self, model: torch.nn.Module, tokenizer) -> None:
        """The scheduler and its stop rules, the sampler, the output constraints."""
        config, eos = self.config, eos_token_ids_of(model)
        lora = self.lora
        self.scheduler = Scheduler(
            self.block_manager, StopChecker(eos, self.max_model_len, tokenizer),
            config.max_batched_tokens, config.max_running, config.watermark,
            preemption=self.preemption, swap_space=self.swap_space,
            max_loras=config.max_loras if lora else 0,
            adapter_ready=lora.is_ready if lora else None)
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
            log.warning("--deterministic: answers may depend on the batch here: %s",
                        self.invariance_gap)
        self.model = self.prepared.module
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
        model = load_pretrained(model_path, config.dtype, config.device)
        return cls(model.to(resolve_device(config.device)), config, tokenizer=tokenizer)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one)."""
        if self.ranks is not None and self.ranks.is_driver:
            self.ranks.stop()

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] | None = None,
                    lora: LoraRequest | None = None) -> None:
        """Queue a request; `output_token_ids` resumes one (sampling continues at their count);
        `lora`: the adapter it runs under (LoraLoadError, a ValueError, if it cannot be served)."""
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
            self.constrained.add(req_id, params.constraint, output_token_ids or [])
        except BaseException:
            if self.lora is not None:
                self.lora.release(req_id)
            raise
        # resumed past its first output: its prompt logprobs went out with that output
        seq = Sequence(req_id, prompt_token_ids, params, output_token_ids=output_token_ids or [],
                       prompt_logprobs_sent=bool(output_token_ids), lora=lora)
        self._seqs[req_id] = seq
        self.scheduler.add(seq)

    def abort(self, req_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once; None if it is not (or no longer) here."""
        seq = self._seqs.get(req_id)
        if seq is None:
            return None
        self._left(seq)
        self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        if self.swapped.discard(req_id) and self.ranks is not None:
            self.ranks.discard_swapped(req_id)
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
        if self.speculator is not None:
            self.speculator.observe_step(sched.num_batched_tokens, seconds)
            for chunk in step.emitting:
                if chunk.draft and chunk.seq.req_id in samples:
                    self.speculator.observe(chunk, len(samples[chunk.seq.req_id]) - 1)
        outputs = self._fail(failed)
        emissions = self.scheduler.update(sched, samples)
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
        """A request left the engine (finished, failed or aborted)."""
        self._seqs.pop(seq.req_id, None)
        if self.speculator is not None:
            self.speculator.finish(seq)
        if self.lora is not None:
            self.lora.release(seq.req_id)

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return reports.engine_stats(self.block_manager, self.scheduler, self.runner,
                                    self.swapped.num_bytes, self.constrained,
                                    None if self.speculator is None else self.speculator.stats)

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
