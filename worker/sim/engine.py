"""A simulated engine: the real engine with its forward pass replaced by a cost model.

`SimEngine` is `worker.engine.engine.Engine` — the same request checks, scheduler, block manager,
prefix cache and its announcements, admission by KV room, pace, stop rules and outputs — built
over parts that hold no weights and no KV tensors:

- the KV pool is block accounting only: as many blocks as the named accelerator's memory holds
  beside the model's weights (`RooflineCost.kv_blocks`), or `--kv-memory` at the model's KV bytes
  per token when the cost is a measured curve;
- the forward (`SimRunner`) holds the step for the time its cost model gives the step's work
  (`shared.pace.StepFeatures`, the pace fit's own units) times the time scale (clock.py);
- the sampler (`SimSampler`) answers each row with the token tokens.py derives from the request
  and the position, so any simulated worker resumes any other's stream seamlessly.

What is not simulated is refused as an engine without it refuses it: LoRA adapters (as without
--enable-lora), output constraints (as an engine built without a tokenizer), speculative decoding
(at start-up); preemption recomputes (no host copy of KV is modelled). KV handoffs move a
stream's tokens and the modelled size of its KV between simulated engines (`SimMoves`), so
`--role prefill` / `decode` and drains work as between real workers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from kvfleet.shared.engine_config import EngineConfig
from kvfleet.shared.wire import RequestStatus
from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.engine.core.handoff import HandoffError, SequenceState, check_layout
from kvfleet.worker.engine.core.lifecycle import Feature, Features
from kvfleet.worker.engine.lora.feature import NoAdapters
from kvfleet.worker.engine.core.model_runner import StepLogits
from kvfleet.worker.engine.model.numerics import Numerics
from kvfleet.worker.engine.core.pace import Pace, step_features
from kvfleet.worker.engine.pacing import Pacing
from kvfleet.worker.engine.reports import EngineStats
from kvfleet.worker.engine.core.scheduler import Scheduler, SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.core.stopping import StopChecker
from kvfleet.worker.structured.requests import ConstrainedRequests
from kvfleet.worker.sim.clock import SimLag, StepClock
from kvfleet.worker.sim.tokens import AnswerLengths, AnswerTokens

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # token positions per block where --block-size is auto (vLLM's on CUDA)


class StepStart(Feature):
    """Marks when the engine starts a step (its first lifecycle hook): a simulated step's
    modelled time runs from there, scheduling included."""

    def __init__(self, clock: StepClock):
        self.clock = clock
        self.started = clock.now()

    def prepare(self) -> list[tuple[str, Exception]]:
        self.started = self.clock.now()
        return []


class AnswerKeys(Feature):
    """Each request's key and drawn answer length, from when it enters until it leaves (the
    sampler finds them by its prompt list, which is the sequence's own)."""

    def __init__(self, tokens: AnswerTokens):
        self.tokens = tokens
        self._by_prompt: dict[int, tuple[list[int], int, int | None]] = {}

    def add(self, seq: Sequence) -> None:
        key = self.tokens.key(seq.prompt_token_ids)
        self._by_prompt[id(seq.prompt_token_ids)] = (
            seq.prompt_token_ids, key, self.tokens.length(key, seq.params.min_tokens))

    def refused(self, seq: Sequence) -> None:
        self.leave(seq)

    def leave(self, seq: Sequence) -> None:
        self._by_prompt.pop(id(seq.prompt_token_ids), None)

    def of(self, prompt_token_ids: list[int], min_tokens: int) -> tuple[int, int | None]:
        entry = self._by_prompt.get(id(prompt_token_ids))
        if entry is not None and entry[0] is prompt_token_ids:
            return entry[1], entry[2]
        key = self.tokens.key(prompt_token_ids)  # not entered here (the pace's warm-up)
        return key, self.tokens.length(key, min_tokens)


class SimSampler:
    """Every row's token from its request and position (tokens.py); no logprobs."""

    def __init__(self, tokens: AnswerTokens, keys: AnswerKeys):
        self.tokens = tokens
        self.keys = keys

    def sample(self, logits, inputs, logit_mask=None) -> list[tuple[int, None]]:
        out = []
        for inp in inputs:
            key, length = self.keys.of(inp.prompt_token_ids, inp.params.min_tokens)
            out.append((self.tokens.token(key, inp.position, length, inp.params.ignore_eos),
                        None))
        return out


class SimRunner:
    """The forward: holds the step for its modelled time; the rows to sample, no logits."""

    decode_graphs = None

    def __init__(self, cost, clock: StepClock, start: StepStart):
        self.cost = cost
        self.clock = clock
        self.start = start
        self.modelled_s = 0.0  # modelled seconds of every step played, unscaled

    def execute(self, sched: SchedulerOutput) -> StepLogits:
        modelled = max(0.0, self.cost.step_seconds(step_features(sched)))
        self.modelled_s += modelled
        self.clock.play(self.start.started, modelled)
        return StepLogits([c for c in sched.chunks if c.emits_token], None)


@dataclass(frozen=True)
class ModelledKV:
    """A handed-over sequence's KV as a simulated engine takes it: its blocks, no bytes."""

    num_blocks: int


class SimMoves:
    """A running sequence's move to another simulated engine (KV handoffs): its state carries its
    tokens and what its KV would weigh, not the KV (`modelled_bytes` in its layout, a one-byte
    payload); the taking engine swaps it in as a real one swaps in a handed-over copy, so the
    cost model charges the copy over the accelerator's host link (`swap_blocks`): the transfer
    between hosts is taken to run at least as fast (RDMA, NVLink), and not modelled apart.
    Only a simulated engine of the same model, block size and KV size takes it."""

    def __init__(self, block_manager: BlockManager, block_size: int, kv_bytes_per_token: int):
        self.block_manager = block_manager
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token

    def gap(self) -> None:
        return None

    def layout(self) -> dict:
        return {"simulated": True, "block_size": self.block_size,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "prefix_root": self.block_manager.root.hex()}

    def exportable(self, seq) -> bool:
        return (seq is not None and seq.status is RequestStatus.RUNNING
                and seq.num_computed_tokens > 0
                and (seq.params.prompt_logprobs is None or seq.prompt_logprobs_sent))

    def kv_bytes(self, seq) -> int:
        blocks = self.block_manager.blocks_for_tokens(seq.num_computed_tokens)
        return blocks * self.block_size * self.kv_bytes_per_token

    def export(self, seq) -> SequenceState:
        return SequenceState(seq.req_id, seq.prompt_token_ids, list(seq.output_token_ids),
                             seq.params, seq.num_computed_tokens, seq.num_cached_tokens,
                             seq.lora, {**self.layout(), "modelled_bytes": self.kv_bytes(seq)},
                             torch.zeros(1, dtype=torch.uint8), None)  # the wire wants bytes

    def check(self, state: SequenceState) -> ModelledKV:
        """What the state's KV takes here (HandoffError when this engine cannot take it)."""
        theirs = {k: v for k, v in state.layout.items() if k != "modelled_bytes"}
        check_layout(replace(state, layout=theirs), self.layout())
        if not 0 < state.num_computed_tokens < state.num_tokens:
            raise HandoffError(f"handoff of {state.req_id!r}: {state.num_computed_tokens} "
                               f"computed of {state.num_tokens} tokens")
        return ModelledKV(self.block_manager.blocks_for_tokens(state.num_computed_tokens))

    def hold(self, state: SequenceState, kv: ModelledKV) -> None:
        """Nothing to keep: the swap-in the scheduler plans is the copy the cost model charges."""


class SimEngine(Engine):
    """The engine over simulated parts (the module's docstring); built by `build_sim_engine`."""

    def __init__(self, config: EngineConfig, cost, *, vocab_size: int, eos_token_ids: list[int],
                 max_model_len: int, num_blocks: int, answer_lengths: AnswerLengths,
                 clock: StepClock, tokenizer=None, seed: int = 0, pool_note: str = "",
                 kv_bytes_per_token: int = 0):
        # Engine.__init__ assembles real parts; these are the simulated ones, the same names
        if config.speculative_config is not None:
            raise ValueError("a simulated worker does not simulate speculative decoding")
        scale = clock.time_scale  # the pace's targets are real time: modelled time is scaled
        config = replace(config, block_size=config.cache.block_size or DEFAULT_BLOCK_SIZE,
                         target_itl_ms=config.pace.target_itl_ms * scale,
                         target_ttft_ms=config.pace.target_ttft_ms * scale,
                         min_target_itl_ms=None if config.pace.min_target_itl_ms is None
                         else config.pace.min_target_itl_ms * scale)
        self.config, self.ranks, self.max_model_len = config, None, max_model_len
        self.device, self.dtype = torch.device("meta"), torch.bfloat16
        self.cost, self.clock, self.pool_note = cost, clock, pool_note
        cache, scheduling = config.cache, config.scheduler
        self.block_manager = BlockManager(num_blocks, cache.block_size,
                                          cache.enable_prefix_caching)
        self.pace = Pace(config.pace, scheduling.max_batched_tokens)
        self.scheduler = Scheduler(
            self.block_manager, StopChecker(eos_token_ids, max_model_len, tokenizer),
            scheduling.max_batched_tokens, scheduling.max_running, cache.watermark,
            pace=self.pace if self.pace.enabled else None)
        self.constrained = ConstrainedRequests(None)
        self.tokens = AnswerTokens(vocab_size, eos_token_ids, answer_lengths, seed)
        self.keys = AnswerKeys(self.tokens)
        start = StepStart(clock)
        self.features = Features([start, self.keys, NoAdapters(), Pacing(self.pace)])
        self.runner = SimRunner(cost, clock, start)
        self.sampler = SimSampler(self.tokens, self.keys)
        self.moves = SimMoves(self.block_manager, cache.block_size, kv_bytes_per_token)
        self.lora = self.speculation = self.tier = None
        self.invariance_gap = None  # a row's token depends on its request alone
        self.numerics = Numerics({"simulated": "tokens from the request (worker/sim/tokens.py)",
                                  "seed": str(seed), "answers": answer_lengths.kind})
        # what the pace's warm-up reads of the model
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size))
        self._seqs: dict[str, Sequence] = {}
        log.info("engine: %s; numerics %s", self.device_report(), self.numerics.describe())

    def close(self) -> None:
        self.features.close()

    def lag(self) -> SimLag:
        return self.clock.lag()

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        lag = self.clock.lag()
        return EngineStats(
            num_blocks_total=bm.num_blocks, num_blocks_free=bm.num_free_blocks,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions, prefix_queried_tokens=bm.prefix_queried_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens, num_cached_blocks=bm.num_cached_blocks,
            num_generated_tokens=sched.num_generated_tokens,
            num_prefill_tokens_computed=sched.num_prefill_tokens_computed,
            simulated=self.simulation(), sim_steps=lag.steps, sim_lagged_steps=lag.lagged)

    def simulation(self) -> str:
        return f"{self.cost.describe()}; time scale {self.clock.time_scale:g}"

    def device_report(self) -> str:
        return (f"simulated: {self.cost.describe()}; time scale {self.clock.time_scale:g}; "
                f"answers {self.tokens.lengths.kind}")

    def budget_report(self) -> list[str]:
        bm = self.block_manager
        return [f"{bm.num_blocks} blocks of {self.config.cache.block_size} tokens (simulated pool"
                + (f": {self.pool_note}" if self.pool_note else "") + ")"]

