"""The engine the worker service drives: add requests, step, abort; plus offline `generate`.

`Engine` is its parts (assembly.py builds them) and one step loop: schedule, execute, sample,
update. Every feature (speculation, LoRA adapters, tensor parallelism, swapping, the pace) plugs
into it through the step lifecycle (lifecycle.py); the loop names none of them. Beside it: a
request's checks and outputs (request_io.py), sampling (step_sampling.py), output constraints
(worker/structured/), reports (reports.py), a sequence's move to another engine (moves.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from kvfleet.shared.wire import RequestStatus, SamplingParams
from kvfleet.worker.engine import reports
from kvfleet.worker.engine.assembly import EngineParts, assemble
from kvfleet.worker.engine.core.config import EngineConfig
from kvfleet.worker.engine.memory.device import DeviceFailure, resolve_device
from kvfleet.worker.engine.core.handoff import HandoffError, SequenceState
from kvfleet.worker.engine.lora import LoraLoadError, LoraRequest, LoraStats
from kvfleet.worker.engine.model.model_prep import load_pretrained
from kvfleet.worker.engine.core.model_runner import StepLogits
from kvfleet.worker.engine.core.pace import PaceReport
from kvfleet.worker.engine.reports import EngineStats
from kvfleet.worker.engine.core.request_io import (
    RequestOutput, check_request, emission_output, request_output)
from kvfleet.worker.engine.core.scheduler import SchedulerOutput, TokenEmission
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.core.step_sampling import (
    Failures, advance_constrained, raise_if_sticky, record_prompt_logprobs, sample_rows)
from kvfleet.worker.engine.parallel.tp_group import RankGroup

__all__ = ["Engine", "EngineConfig", "EngineStats", "LoraLoadError", "LoraRequest", "LoraStats",
           "RequestOutput", "load_pretrained"]

log = logging.getLogger(__name__)


class Engine(EngineParts):
    """Continuous batching over one model and one KV block pool, on its own prepared copy of the
    model (`prepared`; `model` is its module), weights shared. With tensor parallelism (`ranks`)
    each rank has one over its shard; rank 0's sends each step to the others (tp_rank.py)."""

    def __init__(self, model, config: EngineConfig, tokenizer=None, ranks: RankGroup | None = None,
                 draft_model: torch.nn.Module | None = None):
        super().__init__(**vars(assemble(model, config, tokenizer, ranks, draft_model)))
        self._seqs: dict[str, Sequence] = {}
        if ranks is None or ranks.is_driver:
            log.info("engine: %s; numerics %s", self.device_report(), self.numerics.describe())
            for line in self.budget_report():
                log.info("KV budget: %s", line)

    @classmethod
    def from_pretrained(cls, model_path: str, config: EngineConfig, tokenizer=None) -> Engine:
        """One rank's engine (several ranks: `tp_rank.launch_engine` with `load_pretrained`)."""
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1: start the ranks with tp_rank.launch_engine")
        m = config.model
        model = load_pretrained(model_path, m.dtype, m.device, m.load_format)
        return cls(model.to(resolve_device(m.device)), config, tokenizer=tokenizer)

    def close(self) -> None:
        """Stop what the features started (the other tensor-parallel ranks)."""
        self.features.close()

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] | None = None,
                    lora: LoraRequest | None = None, arrival: float | None = None) -> None:
        """Queue a request; `output_token_ids` resumes one (sampling continues at their count);
        `lora`: the adapter it runs under (LoraLoadError, a ValueError, if it cannot be served);
        `arrival`: its enqueue's unix time (its first token's time is measured from it)."""
        # resumed past its first output: its prompt logprobs went out with that output
        seq = Sequence(req_id, prompt_token_ids, params, output_token_ids=output_token_ids or [],
                       prompt_logprobs_sent=bool(output_token_ids), lora=lora, arrival=arrival)
        self._enter(seq)
        self.scheduler.add(seq)

    def _enter(self, seq: Sequence) -> None:
        """Check a request and take what it holds here (the features' parts, its grammar
        matcher); a ValueError, with nothing taken, when it cannot be served."""
        if seq.req_id in self._seqs:
            raise ValueError(f"request {seq.req_id!r} is already in the engine")
        check_request(seq.req_id, seq.prompt_token_ids, seq.params, self.max_model_len,
                      self.block_manager)
        self.features.add(seq)
        try:
            # a resumed request replays its tokens through its grammar: same masks as before
            self.constrained.add(seq.req_id, seq.params.constraint, seq.output_token_ids)
        except BaseException:
            self.features.refused(seq)
            raise
        self._seqs[seq.req_id] = seq

    def abort(self, req_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once; None if it is not (or no longer) here."""
        seq = self._seqs.get(req_id)
        if seq is None:
            return None
        self._leave(seq, RequestStatus.FINISHED_ABORTED)
        return request_output(seq, [], None, self.scheduler.stop_checker)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- prefix cache, as the fleet sees it ---------------------------------------------------

    def set_prefix_root(self, root: bytes) -> None:
        """Hash prefix-cache blocks from `root` (the router's: `prefix_hash.root_hash(served
        model id)`) from the first request on; offline use keeps the default."""
        self.block_manager.set_root(root)

    def num_cached_prefix_blocks(self, token_ids: list[int],
                                 prefix_root: bytes | None = None) -> int:
        """Leading full blocks of `token_ids` in the prefix cache now (hashed from
        `prefix_root`: an adapter's, `LoraRequest.prefix_root`; None: the engine's own)."""
        return self.block_manager.num_cached_leading_blocks(token_ids, prefix_root)

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash in the prefix cache now."""
        return self.block_manager.cached_hashes()

    def drain_block_announcements(self):
        """The prefix cache's NetChange since the last call (stored, removed, moved tier)."""
        return self.block_manager.drain_announcements()

    def can_admit(self, num_prompt_tokens: int) -> bool:
        """Whether free blocks (incl. evictable cached ones) hold this prompt beside the watermark."""
        return 0 <= num_prompt_tokens <= self.admissible_tokens()

    def admissible_tokens(self) -> int:
        """The most prompt tokens `can_admit` accepts now (-1: not even an empty prompt): the
        worker's admission budget, whole blocks beside the watermark."""
        room = self.block_manager.num_free_blocks - self.scheduler.watermark_blocks
        return room * self.config.cache.block_size if room >= 0 else -1

    # ---- handoff: a running sequence and its KV to another engine (moves.py) ------------------

    def handoff_layout(self) -> dict:
        """What an engine taking this one's sequences must match."""
        return self.moves.layout()

    def handoff_gap(self) -> str | None:
        """None when this engine can export and import sequences; else why not."""
        return self.moves.gap()

    def kv_bytes_of(self, req_id: str) -> int:
        """Bytes `export_sequence` would move now (0: it would not export the sequence)."""
        seq = self._seqs.get(req_id)
        return self.moves.kv_bytes(seq) if self.moves.exportable(seq) else 0

    def export_sequence(self, req_id: str) -> SequenceState | None:
        """Take a sequence out with a host copy of its KV, to continue in another engine
        (between steps only); it leaves as an aborted one does, without an output. None when
        `moves.exportable` says it stays (moves.py)."""
        seq = self._seqs.get(req_id)
        if not self.moves.exportable(seq):
            return None
        state = self.moves.export(seq)
        self._leave(seq, RequestStatus.FINISHED_ABORTED)
        return state

    def import_sequence(self, state: SequenceState) -> None:
        """Add a sequence handed over by another engine (or given back to this one): checked as
        `add_request` checks one, it waits swapped out until its whole known sequence fits, and
        continues with nothing computed again (moves.py). HandoffError, nothing changed, when
        this engine cannot take it."""
        host = self.moves.check(state)
        output = state.output_token_ids
        seq = Sequence(state.req_id, state.prompt_token_ids, state.params, output_token_ids=output,
                       num_cached_tokens=state.num_cached_tokens,
                       prompt_logprobs_sent=bool(output), lora=state.lora)
        try:
            self._enter(seq)
        except ValueError as exc:  # LoraLoadError and the grammar's errors too
            raise HandoffError(f"handoff of {state.req_id!r}: {exc}") from exc
        self.moves.hold(state, host)
        self.scheduler.add_swapped_out(seq, state.num_computed_tokens, host.num_blocks)

    # ---- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, update; outputs of requests that got a token or
        finished."""
        outputs = [self._finish_output(seq) for seq in self.scheduler.take_finished_at_add()]
        outputs += self._fail([(self._seqs[req_id], exc)
                               for req_id, exc in self.features.prepare()])
        features = self.features
        sched = self.scheduler.schedule(features.lookahead(self.scheduler),
                                        features.attach if features.attaches else None)
        features.scheduled(sched)
        features.before_execute(sched)
        if sched.is_empty:
            return outputs
        start = time.perf_counter()
        try:
            step = features.execute(sched)
            if step is None:  # no feature runs this step's forward itself
                step = self.runner.execute(sched)
        except Exception as exc:  # the whole batch failed: fail its requests, keep the engine
            if isinstance(exc, DeviceFailure):  # a rank or the device: the worker must exit
                raise
            raise_if_sticky(exc)
            log.exception("forward failed for %d requests", len(sched.chunks))
            return outputs + self._fail([(c.seq, exc) for c in sched.chunks])
        return outputs + self._sample_and_update(sched, step, start)

    def _sample_and_update(self, sched: SchedulerOutput, step: StepLogits,
                           start: float) -> list[RequestOutput]:
        # waits for the device
        samples, failed = sample_rows(self.sampler, self.constrained, step.emitting, step.logits)
        failed += record_prompt_logprobs(step)
        self.features.executed(sched, step, samples, start, time.perf_counter() - start)
        outputs = self._fail(failed)
        emissions = self.scheduler.update(sched, samples)
        self.features.emitted(emissions)
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

    def _leave(self, seq: Sequence, status: RequestStatus) -> None:
        """End a request here (aborted, or handed over) and free its blocks at once."""
        self._left(seq)
        self.scheduler.finish(seq, status)
        self.constrained.discard(seq.req_id)

    def _left(self, seq: Sequence) -> None:
        """A request left the engine (finished, failed, aborted or handed over)."""
        self._seqs.pop(seq.req_id, None)
        self.features.leave(seq)

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return replace(reports.engine_stats(self.block_manager, self.scheduler, self.runner,
                                            self.swapped.num_bytes, self.constrained),
                       **self.features.stats())

    def pace_report(self) -> PaceReport:
        """The pace promised and kept, the room left at it, the fitted step cost (pace.py)."""
        return self.pace.report(self.scheduler.running, self.scheduler.waiting,
                                self.config.scheduler.max_running)

    def lora_stats(self) -> LoraStats:
        """The adapters loaded (most recently used first), in slots, loads and evictions."""
        return LoraStats() if self.lora is None else self.lora.stats()

    def device_report(self) -> str:
        """Device, dtype (and what --dtype said), and on CPU the model and ISA behind `auto`."""
        return reports.device_report(self.device, self.dtype, self.attention_backend,
                                     self.config.model.dtype, self.config.model.deterministic,
                                     self.invariance_gap)

    def budget_report(self) -> list[str]:
        lines = reports.budget_report(self.budget, self.pool, self.dtype, self.swap_space,
                                      self.preemption,
                                      None if self.ranks is None else self.ranks.world_size)
        return lines + self.features.report()

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
