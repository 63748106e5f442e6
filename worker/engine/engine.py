"""The engine the worker service drives: add requests, step, abort; plus offline `generate`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from shared.wire import RequestStatus, SamplingParams, TokenLogprob
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from shared.cpu_features import cpu_features
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.attention import resolve_attention_backend
from worker.engine.device import (
    DeviceFailure, is_cpu, is_cuda, is_sticky_device_error, place_model, resolve_block_size,
    resolve_device, resolve_dtype, select_device)
from worker.engine.kv_cache import HostBlocks, KVCachePool, KVLayout, format_bytes, plan_budget
from worker.engine.kv_format import resolve_kv_format
from worker.engine.memory_profile import profile_step
from worker.engine.model_runner import ModelRunner, StepLogits, plan_step
from worker.engine.preemption import PreemptionCostModel, SwapSpace
from worker.engine import cpu_linear
from worker.engine.prompt_logprobs import compute_prompt_logprobs
from worker.engine.sampler import Sampler, SamplerInput
from worker.engine.scheduler import Scheduler, SchedulerOutput, TokenEmission
from worker.engine.sequence import Sequence
from worker.engine.stopping import Stop, StopChecker
from worker.engine.tp_group import RankFailure, RankGroup
from worker.engine.tp_shard import shard_model
from worker.structured.compiler import GrammarCompiler
from worker.structured.requests import ConstrainedRequests

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestOutput"]

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    req_id: str
    new_token_ids: list[int]  # tokens produced this step (usually 0 or 1)
    new_logprobs: list[TokenLogprob] | None
    num_output_tokens: int  # total generated, including resumed ones
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    finish_reason: str | None  # RequestStatus.finish_reason when finished
    error: str | None = None  # what went wrong, when finish_reason == "error"
    # prompt token i + 1's logprob at i; in the request's first output only (prompt_logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None
    stop: Stop | None = None  # what stopped it, when finish_reason == "stop"


@dataclass
class EngineStats:
    num_blocks_total: int
    num_blocks_free: int  # incl. evictable prefix-cache blocks
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_cached_blocks: int
    num_generated_tokens: int
    num_prefill_tokens_computed: int
    num_swap_preemptions: int = 0  # of num_preemptions, those that swapped the KV out
    swap_used_bytes: int = 0  # host memory held by swapped-out streams
    num_constrained: int = 0  # requests with an output constraint
    grammar_compiles: int = 0  # constraints compiled (cache misses)
    grammar_cache_hits: int = 0
    num_cuda_graph_steps: int = 0  # decode steps replayed from a captured CUDA graph


def eos_token_ids_of(model) -> list[int]:
    """EOS ids from the generation config (else the model config); an int or a list there."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def max_model_len_of(config) -> int:
    length = getattr(config, "max_position_embeddings", None) or 2048
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < length:
        log.warning("sliding window %d not supported: context capped at %d tokens", window, window)
        length = window
    return length


def load_pretrained(model_path: str, dtype_name: str, device_name: str):
    """The model on the CPU in the engine's dtype (module-level: the ranks' picklable loader)."""
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype_name, resolve_device(device_name))
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map=None)


def _raise_if_sticky(error: Exception) -> None:
    """A device error that poisons every later step is not the requests' fault: leave them
    unfinished and let the worker exit (DeviceFailure), so they resume on another worker."""
    if is_sticky_device_error(error):
        log.critical("device failure: %s", error)
        raise DeviceFailure(f"{type(error).__name__}: {error}") from error


class Engine:
    """Continuous-batching engine over one model and one KV block pool.

    With tensor parallelism (`ranks`), every rank builds one over its shard of the model and its
    own pool of its KV heads; rank 0's engine schedules, samples and sends each step to the
    others (`tp_rank.follow`). `tp_rank.launch_engine` starts the ranks and makes rank 0's.
    """

    def __init__(self, model, config: EngineConfig, tokenizer=None, ranks: RankGroup | None = None):
        self.config = config
        self.ranks = ranks
        self.device = ranks.device if ranks is not None else resolve_device(config.device)
        select_device(self.device)  # cuda:N is the current device from here on
        self.dtype = resolve_dtype(config.dtype, self.device)
        layout = KVLayout.from_model_config(model.config, resolve_kv_format(config.kv_dtype, self.dtype))
        num_heads = None
        if ranks is not None:  # keep this rank's shard only, before the model reaches the device
            shard = shard_model(model, ranks.rank, ranks.world_size, ranks.group, ranks.comm_timer)
            layout = replace(layout, num_kv_heads=shard.num_kv_heads)
            num_heads = shard.num_heads
        model = place_model(model, self.device, self.dtype)  # fp32 buffers (RoPE) stay fp32
        self.model = model
        self.max_model_len = max_model_len_of(model.config)
        self.kv_format = layout.kv_format
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.device, self.dtype, layout.kv_format, layout.head_dim)
        block_size = resolve_block_size(config.block_size, self.attention_backend.cpu_kernel,
                                        self.dtype, layout.kv_format.storage)
        config = self.config = replace(config, block_size=block_size)
        graphs_mode = self._graphs_mode()
        step_peak_bytes = 0
        if is_cuda(self.device) and config.num_blocks is None:
            step_peak_bytes = profile_step(
                model, layout, config.block_size, config.max_batched_tokens, config.max_running,
                self.device, self.attention_backend, num_heads=num_heads).peak_bytes
        self.budget = plan_budget(
            model, layout, config.block_size, self.max_model_len, self.device, config.num_blocks,
            config.kv_memory_bytes, config.gpu_memory_utilization,
            activation_reserve_bytes=step_peak_bytes)
        if ranks is not None:  # every rank's pool has the same blocks: the smallest fits all
            num_blocks = ranks.agree_min(self.budget.num_blocks)
            self.budget = replace(self.budget, num_blocks=num_blocks,
                                  kv_bytes=num_blocks * self.budget.bytes_per_token * config.block_size,
                                  source=self.budget.source + f", smallest of {ranks.world_size} ranks")
        self.pool = KVCachePool(layout, self.budget.num_blocks, config.block_size, self.device)
        # with decode graphs the pool's last block is their padding rows' scratch, never handed out
        num_usable_blocks = self.budget.num_blocks - (graphs_mode is not None)
        if num_usable_blocks < 1:
            raise ValueError("the KV budget holds no block beside the CUDA graphs' scratch block")
        self.block_manager = BlockManager(
            num_usable_blocks, config.block_size, config.enable_prefix_caching)
        self.swap_space = SwapSpace(config.swap_space_bytes // self.pool.block_bytes)
        self.preemption = PreemptionCostModel(
            config.preemption, self.pool.block_bytes, self._calibrate_swap_bytes_per_s(),
            self._prior_prefill_s_per_token(model))
        eos = eos_token_ids_of(model)
        self.scheduler = Scheduler(
            self.block_manager, StopChecker(eos, self.max_model_len, tokenizer),
            config.max_batched_tokens, config.max_running, config.watermark,
            preemption=self.preemption, swap_space=self.swap_space)
        self.sampler = Sampler(eos)
        # Structured outputs: one grammar matcher per constrained request (needs the tokenizer).
        self.constrained = ConstrainedRequests(
            GrammarCompiler(tokenizer, model.config.vocab_size, eos, config.grammar_cache_size)
            if tokenizer is not None else None)
        decode_graphs = None
        if graphs_mode is not None:
            decode_graphs = DecodeGraphs(model, self.pool, scratch_block=self.budget.num_blocks - 1,
                                         max_batch=config.max_running,
                                         max_model_len=self.max_model_len)
            if graphs_mode == "capture":
                started = time.perf_counter()
                decode_graphs.capture()
                log.info("captured decode CUDA graphs for batch sizes %s in %.1f s",
                         decode_graphs.buckets, time.perf_counter() - started)
        self.runner = ModelRunner(model, self.pool, attention_backend=self.attention_backend,
                                  decode_graphs=decode_graphs, num_heads=num_heads)
        self._seqs: dict[str, Sequence] = {}
        self._swapped: dict[str, HostBlocks] = {}  # host copies of swapped-out streams' KV
        if ranks is None or ranks.is_driver:
            log.info("engine: %s", self.device_report())
            for line in self.budget_report():
                log.info("KV budget: %s", line)

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

    def _calibrate_swap_bytes_per_s(self) -> float:
        """Time a round trip of a few blocks through host memory (the cost model's prior)."""
        blocks = list(range(min(8, self.pool.num_blocks)))
        start = time.perf_counter()
        self.pool.copy_in(self.pool.copy_out(blocks), blocks)
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)
        seconds = max(time.perf_counter() - start, 1e-6)
        return 2 * len(blocks) * self.pool.block_bytes / seconds

    def _prior_prefill_s_per_token(self, model) -> float:
        """2 FLOPs per weight per token at a modest rate for the device, until steps are timed."""
        num_params = sum(p.numel() for p in model.parameters())
        flops_per_s = 2e13 if is_cuda(self.device) else 5e10
        return 2 * num_params / flops_per_s

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] | None = None) -> None:
        """Queue a request; `output_token_ids` resumes one (sampling continues at their count)."""
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already in the engine")
        if not prompt_token_ids:
            raise ValueError(f"request {req_id!r}: the prompt is empty")
        if params.max_tokens < 0:
            raise ValueError(f"request {req_id!r}: max_tokens must be >= 0")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) = {total} exceeds the model context of {self.max_model_len}")
        # the last sampled token's KV is never computed (max_tokens 0: the prompt's all is)
        blocks = self.block_manager.blocks_for_tokens(max(total - 1, len(prompt_token_ids)))
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"request {req_id!r}: needs {blocks} KV blocks but the pool has only "
                f"{self.block_manager.num_blocks}")
        # a resumed request replays its tokens through its grammar: same masks as before the crash
        self.constrained.add(req_id, params.constraint, output_token_ids or [])
        # resumed past its first output: its prompt logprobs went out with that output
        seq = Sequence(req_id, prompt_token_ids, params, output_token_ids=output_token_ids or [],
                       prompt_logprobs_sent=bool(output_token_ids))
        self._seqs[req_id] = seq
        self.scheduler.add(seq)

    def abort(self, req_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once; None if it is not (or no longer) here."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        if self._swapped.pop(req_id, None) is not None and self.ranks is not None:
            self.ranks.discard_swapped(req_id)
        self.constrained.discard(req_id)
        return self._output(seq, [], None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def can_admit(self, num_prompt_tokens: int) -> bool:
        """Whether free blocks (incl. evictable cached ones) hold this prompt beside the watermark."""
        bm = self.block_manager
        return bm.blocks_for_tokens(num_prompt_tokens) <= bm.num_free_blocks - self.scheduler.watermark_blocks

    # ---- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; outputs of requests that got a token or finished."""
        outputs = [self._finish_output(seq) for seq in self.scheduler.take_finished_at_add()]
        sched = self.scheduler.schedule()
        if self.ranks is not None:
            return outputs + self._step_ranks(sched)
        self._swap(sched)
        if sched.is_empty:
            return outputs
        start = time.perf_counter()
        try:
            step = self.runner.execute(sched)
        except Exception as exc:  # the whole batch failed: fail its requests, keep the engine
            _raise_if_sticky(exc)
            log.exception("forward failed for %d requests", len(sched.chunks))
            return outputs + self._fail([(c.seq, exc) for c in sched.chunks])
        return outputs + self._sample_and_update(sched, step, start)

    def _step_ranks(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """One tensor-parallel step: send it to the other ranks, then do our share. A failure
        here may leave the ranks out of step, so it ends the worker (RankFailure)."""
        plan, rows = plan_step(sched, self.config.block_size)
        self.ranks.send_step(plan, sched.swap_out, sched.swap_in)
        self._swap(sched)
        if sched.is_empty:
            return []
        start = time.perf_counter()
        try:
            logits = self.runner.forward(plan, rows.prompt_indices)  # [K + P, vocab]
        except Exception as exc:
            log.critical("tensor-parallel forward failed on rank 0: %s", exc)
            raise RankFailure(f"{type(exc).__name__}: {exc}") from exc
        k = len(rows.emitting)
        step = StepLogits(rows.emitting, logits[:k], rows.prompt_spans,
                          logits[k:] if rows.prompt_spans else None)
        return self._sample_and_update(sched, step, start)

    def _sample_and_update(self, sched: SchedulerOutput, step: StepLogits,
                           start: float) -> list[RequestOutput]:
        samples, failed = self._sample(step.emitting, step.logits)  # waits for the device
        failed += self._record_prompt_logprobs(step)
        prefill_tokens = sum(c.num_tokens for c in sched.chunks if c.num_tokens > 1)
        self.preemption.observe_step(prefill_tokens, sched.num_batched_tokens,
                                     time.perf_counter() - start)
        outputs = self._fail(failed)
        emissions = self.scheduler.update(sched, samples)
        outputs += [self._emission_output(e) for e in emissions]
        return outputs + self._advance_constrained(emissions)

    def _advance_constrained(self, emissions: list[TokenEmission]) -> list[RequestOutput]:
        """Move each constrained request's grammar past its new token; a token the grammar
        refuses (it cannot be sampled: the mask forbids it) fails the request."""
        if not len(self.constrained):
            return []
        failed = []
        for emission in emissions:
            req_id = emission.seq.req_id
            if emission.token_id is not None and not emission.finished:
                try:
                    self.constrained.advance(req_id, emission.token_id)
                except ValueError as exc:
                    failed.append((emission.seq, exc))
            if emission.finished:
                self.constrained.discard(req_id)
        return self._fail(failed)

    def _swap(self, sched: SchedulerOutput) -> None:
        """Copy preempted streams' blocks out (before this step may overwrite them), then copy
        readmitted streams' blocks back in."""
        if not (sched.swap_out or sched.swap_in):
            return
        start, moved = time.perf_counter(), 0
        for req_id, blocks in sched.swap_out:
            self._swapped[req_id] = host = self.pool.copy_out(blocks)
            moved += host.num_bytes
        for req_id, blocks in sched.swap_in:
            host = self._swapped.pop(req_id)
            self.pool.copy_in(host, blocks)
            moved += host.num_bytes
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)
        self.preemption.observe_swap(moved, time.perf_counter() - start)

    def _sample(self, emitting, logits) -> tuple[dict, list[tuple[Sequence, Exception]]]:
        """Sample every emitting row; if the batch fails, row by row to isolate the culprits."""
        inputs = [SamplerInput(c.seq.params, c.seq.prompt_token_ids, c.seq.output_token_ids)
                  for c in emitting]
        try:
            mask = self.constrained.mask([c.seq.req_id for c in emitting])
            results = self.sampler.sample(logits, inputs, mask)
            return {c.seq.req_id: r for c, r in zip(emitting, results)}, []
        except Exception as exc:
            _raise_if_sticky(exc)
            log.exception("sampling failed for a batch of %d; retrying row by row", len(inputs))
        samples, failed = {}, []
        for i, chunk in enumerate(emitting):
            try:
                mask = self.constrained.mask([chunk.seq.req_id])
                samples[chunk.seq.req_id] = self.sampler.sample(
                    logits[i:i + 1], inputs[i:i + 1], mask)[0]
            except Exception as exc:
                _raise_if_sticky(exc)
                failed.append((chunk.seq, exc))
        return samples, failed

    def _record_prompt_logprobs(self, step: StepLogits) -> list[tuple[Sequence, Exception]]:
        """Append the step's prompt logprobs to their sequences (positions in order: a chunk
        recomputed after a preemption adds none twice)."""
        if not step.prompt_spans:
            return []
        try:
            computed = compute_prompt_logprobs(step.prompt_spans, step.prompt_logits)
        except Exception as exc:
            _raise_if_sticky(exc)
            log.exception("prompt logprobs failed for %d requests", len(step.prompt_spans))
            return [(span.seq, exc) for span in step.prompt_spans]
        for span, (seq, entries) in zip(step.prompt_spans, computed):
            if span.first_position != len(seq.prompt_logprobs):
                raise AssertionError(f"{seq.req_id}: prompt logprobs from position "
                                     f"{span.first_position}, {len(seq.prompt_logprobs)} held")
            seq.prompt_logprobs.extend(entries)
        return []

    def _fail(self, failures: list[tuple[Sequence, Exception]]) -> list[RequestOutput]:
        """Finish each failed request with FINISHED_ERROR; its blocks return at once."""
        outputs = []
        for seq, error in failures:
            if seq.status.is_finished:  # failed twice in one step (sampling, prompt logprobs)
                continue
            self.scheduler.finish(seq, RequestStatus.FINISHED_ERROR, error=f"{type(error).__name__}: {error}")
            outputs.append(self._finish_output(seq))
        return outputs

    def _emission_output(self, emission: TokenEmission) -> RequestOutput:
        seq = emission.seq
        if emission.finished:
            self._seqs.pop(seq.req_id, None)
        logprobs = [emission.logprob] if emission.logprob is not None else None
        output = self._output(seq, [] if emission.token_id is None else [emission.token_id],
                              logprobs)
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs_sent = True  # once, with the first output
            output.prompt_logprobs = list(seq.prompt_logprobs)
        return output

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        self._seqs.pop(seq.req_id, None)
        self.constrained.discard(seq.req_id)
        return self._output(seq, [], None)

    def _output(self, seq: Sequence, new_token_ids: list[int], logprobs) -> RequestOutput:
        stop = None
        if seq.status is RequestStatus.FINISHED_STOPPED:  # described again from the same tokens
            stop = self.scheduler.stop_checker.find_stop(seq.output_token_ids, seq.params)
        return RequestOutput(
            req_id=seq.req_id, new_token_ids=new_token_ids, new_logprobs=logprobs,
            num_output_tokens=seq.num_output_tokens, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, finish_reason=seq.status.finish_reason,
            error=seq.error, stop=stop)

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        bm, sched, graphs = self.block_manager, self.scheduler, self.runner.decode_graphs
        return EngineStats(
            num_blocks_total=bm.num_blocks, num_blocks_free=bm.num_free_blocks,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions, prefix_queried_tokens=bm.prefix_queried_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens, num_cached_blocks=bm.num_cached_blocks,
            num_generated_tokens=sched.num_generated_tokens,
            num_prefill_tokens_computed=sched.num_prefill_tokens_computed,
            num_swap_preemptions=sched.num_swap_preemptions,
            swap_used_bytes=sum(h.num_bytes for h in self._swapped.values()),
            num_constrained=len(self.constrained),
            grammar_compiles=self.constrained.compiler.misses if self.constrained.compiler else 0,
            grammar_cache_hits=self.constrained.compiler.hits if self.constrained.compiler else 0,
            num_cuda_graph_steps=graphs.num_replays if graphs is not None else 0)

    def device_report(self) -> str:
        """Device, dtype (and what --dtype said), and on CPU the model and ISA behind `auto`."""
        line = f"{self.device}, {str(self.dtype).removeprefix('torch.')} (--dtype {self.config.dtype})"
        if is_cpu(self.device):
            line += f"; CPU {cpu_features().describe()}; {torch.get_num_threads()} torch threads"
        line += f"; attention {self.attention_backend.describe()}"
        if is_cpu(self.device):
            line += f"; linears {cpu_linear.products_report(self.dtype)}"
        return line

    def budget_report(self) -> list[str]:
        swap = self.swap_space.capacity_blocks * self.pool.block_bytes
        lines = self.budget.report()
        if self.ranks is not None:
            n = self.ranks.world_size
            lines.insert(0, f"tensor parallel over {n} ranks: weights, KV cache, bytes per token "
                            f"and swap space are rank 0's (each rank holds its own share); "
                            f"blocks and tokens are the worker's")
        return lines + [
            "tokens that fit by --kv-dtype: " + " · ".join(
                f"{name} {tokens:,}" for name, tokens in self._tokens_by_kv_dtype().items()),
            f"preemption: {self.preemption.mode}; host swap space {format_bytes(swap)} = "
            f"{self.swap_space.capacity_blocks} blocks"]

    def _tokens_by_kv_dtype(self) -> dict[str, int]:
        """What the same KV bytes would hold in each storage format."""
        layout = self.pool.layout
        result = {}
        for name in ("fp32", "bf16", "fp8", "int8"):
            per_token = KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                 resolve_kv_format(name, self.dtype)).bytes_per_token
            result[name] = self.budget.kv_bytes // (per_token * self.budget.block_size) * self.budget.block_size
        return result

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
