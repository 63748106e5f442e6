"""What a simulated worker's step costs: the seconds of a step's work (`shared.pace.StepFeatures`).

Two cost models answer `step_seconds(work)`:

`RooflineCost` (`--sim-device h100`): a roofline from the accelerator's published ceilings
(worker/sim/accelerators.py) and the model's shape (`ModelShape`, from a transformers-style
config). For a step of R decode rows reading C KV positions and P prompt tokens with attention
pairs A (the curve's units):

- FLOPs: 2 x (the decoder layers' active parameters) per token (R + P) in the products, the LM
  head's 2 x vocab x hidden for each decode row and for one prompt token (a chunk's last, the one
  sampled: a step is taken to prefill one chunk), and 4 x layers x heads x head_dim per attention
  pair (QK^T and PV) over C + A. Decode's FLOPs run at the decode efficiency, prefill's at the
  prefill one: compute time = their sum.
- Bytes: every weight read once per step (an MoE's routed experts: those its tokens touch,
  expected under uniform routing, 1 - (1 - k/E)^tokens of them), the KV the decode rows read
  (C positions), the KV a prefill reads (flash attention streams the KV of each tile of 128 query
  tokens once: A / 128 positions; L2 hits ignored), the KV every token writes (R + P positions),
  and the rows of the embedding looked up. Activations are left out (they stay in cache or are
  small beside the weights). Memory time = bytes / (bandwidth x its efficiency).
- step = max(compute, memory) + the accelerator's per-step overhead + the all-reduces of tensor
  parallelism + the KV swap. With N devices (tensor parallel) the FLOPs, weights and KV divide
  over them (KV heads replicate once N exceeds them, as vLLM does); each layer all-reduces the
  step's activations twice (after attention, after the MLP): tokens x hidden x 2 bytes, a ring's
  2(N-1)/N of that over the link per direction, plus the link's latency each. A swapped block is
  a block's KV of one device over its host link, serially (the step waits for the copy).

The KV pool of a simulated worker (`kv_blocks`) follows vLLM's accounting: the device's memory
x `memory_utilization` (vLLM's gpu_memory_utilization, 0.9), less the weights each device holds,
less a reserve for the runtime and the activations of the largest step.

`MeasuredCost` (`--sim-step-cost FILE`): a real worker's fitted curve (shared/pace.py's
`StepCostCurve`, the JSON of a heartbeat's `step_cost`), replayed.

A step with no token costs nothing (but for the copies of the blocks it swaps): the engine runs
none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvfleet.shared.model_shapes import RANDOM_PREFIX, SHAPES, VOCAB_SIZE
from kvfleet.shared.pace import COEFFICIENTS, StepCostCurve, StepFeatures
from kvfleet.shared.wire import Heartbeat
from kvfleet.worker.sim.accelerators import GIB, Accelerator, accelerator

DEFAULT_BLOCK_SIZE = 16  # token positions per KV block, the engine's default
MEMORY_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default
MAX_BATCHED_TOKENS = 8192  # the largest step's tokens the activation reserve is sized for
RUNTIME_RESERVE_BYTES = 1 * GIB  # CUDA context, cuBLAS and NCCL workspaces, CUDA graphs
PREFILL_QUERY_TILE = 128  # query tokens whose attention reads the KV once (flash attention)
ACTIVATION_BYTES = 2  # bf16 activations, what the all-reduces carry


class StepCost(Protocol):
    """What a simulated worker asks of its cost model."""

    def step_seconds(self, work: StepFeatures) -> float: ...

    def describe(self) -> str: ...


# ---- the model's shape -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The facts of a decoder-only transformer a cost model needs, from its config.

    Parameters are counted the way transformers builds the model: embeddings (the LM head apart
    unless tied), per layer q/k/v/o with grouped KV heads (their biases where the model has them,
    Qwen3's q/k norms), the gated MLP (gate, up, down) or for an MoE layer the router, every
    routed expert's gated MLP and a shared expert where there is one, two RMSNorms, and the final
    norm."""

    name: str
    hidden: int
    intermediate: int  # a dense layer's MLP width
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of q and k
    mlp_bias: bool = False  # biases of a dense MLP's gate, up and down (Llama's mlp_bias)
    num_experts: int = 0  # routed experts of an MoE layer (0: dense)
    experts_per_token: int = 0
    moe_intermediate: int = 0  # one routed expert's MLP width
    moe_layers: int = 0  # of the layers, those with experts
    shared_expert_intermediate: int = 0  # an always-on expert of an MoE layer (Qwen2-MoE)

    @classmethod
    def from_config(cls, config: Mapping, name: str = "") -> ModelShape:
        """The shape of a transformers-style config dict (vocabulary SmolLM2's when it has
        none, as the `random:` shapes are served)."""
        hidden, heads, layers = (int(config["hidden_size"]), int(config["num_attention_heads"]),
                                 int(config["num_hidden_layers"]))
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        moe_layers = 0
        if experts:
            step = int(config.get("decoder_sparse_step") or 1)
            dense_only = set(config.get("mlp_only_layers") or ())
            moe_layers = sum(1 for i in range(layers)
                             if i not in dense_only and (i + 1) % step == 0)
        model_type = str(config.get("model_type", ""))
        loaded_from = config.get("_name_or_path") or config.get("name_or_path")
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        return cls(
            name=name or (Path(str(loaded_from)).name if loaded_from else model_type),
            hidden=hidden,
            intermediate=int(config["intermediate_size"]), layers=layers, heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config.get("vocab_size") or VOCAB_SIZE),
            tied_embeddings=bool(config.get("tie_word_embeddings", True)),
            # Qwen2's q/k/v always have biases, its o none; elsewhere `attention_bias` is all four's
            qkv_bias=qwen2 or bool(config.get("attention_bias")),
            o_bias=not qwen2 and bool(config.get("attention_bias")),
            qk_norm=model_type.startswith("qwen3"),
            mlp_bias=not qwen2 and bool(config.get("mlp_bias")),
            num_experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate=int(config.get("moe_intermediate_size")
                                 or config["intermediate_size"]) if experts else 0,
            moe_layers=moe_layers,
            shared_expert_intermediate=int(config.get("shared_expert_intermediate_size") or 0))

    @classmethod
    def named(cls, name: str) -> ModelShape:
        """A shape of shared/model_shapes.py (`random:` prefix or not), at SmolLM2's
        vocabulary; ValueError naming the known ones for another name."""
        key = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
        if key not in SHAPES:
            raise ValueError(f"unknown model shape {name!r}; shapes: {', '.join(SHAPES)}")
        return cls.from_config(SHAPES[key] | {"vocab_size": VOCAB_SIZE}, key)

    # parameters, by part
    @property
    def attention_params(self) -> int:
        """One layer's attention: q, k, v, o (and their biases, norms)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        params = 2 * self.hidden * q + 2 * self.hidden * kv
        if self.qkv_bias:
            params += q + 2 * kv
        if self.o_bias:
            params += self.hidden
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    @property
    def expert_params(self) -> int:
        """One routed expert's gated MLP."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def moe_dense_params(self) -> int:
        """An MoE layer's MLP parameters every token computes with: router, shared expert."""
        shared = 3 * self.hidden * self.shared_expert_intermediate
        return self.hidden * self.num_experts + shared + (self.hidden if shared else 0)

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every layer."""
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def dense_layer_params(self) -> int:
        """The decoder layers' parameters less the routed experts."""
        norms = 2 * self.hidden
        dense_mlp = 3 * self.hidden * self.intermediate
        if self.mlp_bias:
            dense_mlp += 2 * self.intermediate + self.hidden
        return (self.layers * (self.attention_params + norms)
                + (self.layers - self.moe_layers) * dense_mlp
                + self.moe_layers * self.moe_dense_params)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head's product (vocab x hidden), tied to the embeddings or not."""
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        head = 0 if self.tied_embeddings else self.head_params
        return (self.embedding_params + head + self.dense_layer_params
                + self.routed_expert_params + self.hidden)

    @property
    def active_layer_params(self) -> int:
        """The decoder layers' parameters one token computes with (its k experts of each MoE
        layer): what the products cost per token, the LM head apart."""
        active_experts = self.moe_layers * self.experts_per_token * self.expert_params
        return self.dense_layer_params + active_experts

    @property
    def active_params(self) -> int:
        """Parameters one token uses: `total_params` less the experts it is not routed to."""
        skipped = self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params
        return self.total_params - skipped

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one position over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def model_shape(shape: str | Mapping | ModelShape) -> ModelShape:
    """A shape from a shared/model_shapes.py name, a config dict, or itself."""
    if isinstance(shape, ModelShape):
        return shape
    if isinstance(shape, str):
        return ModelShape.named(shape)
    return ModelShape.from_config(shape)


# ---- the roofline ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """A roofline step's seconds, by part: `total` = max(compute, memory) + the rest."""

    compute_s: float
    memory_s: float
    overhead_s: float
    all_reduce_s: float
    swap_s: float

    @property
    def total(self) -> float:
        return (max(self.compute_s, self.memory_s) + self.overhead_s + self.all_reduce_s
                + self.swap_s)

    @property
    def bound(self) -> str:
        """"compute" or "memory": which of the two the step waits for."""
        return "compute" if self.compute_s > self.memory_s else "memory"


class RooflineCost:
    """Step seconds from an accelerator's ceilings and a model's shape (the module's docstring
    gives the model). `weight_bytes` and `kv_bytes` are bytes per element (2: bf16; 1: fp8)."""

    def __init__(self, device: Accelerator | str, shape: str | Mapping | ModelShape,
                 tensor_parallel: int = 1, weight_bytes: int = 2, kv_bytes: int = 2,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.device = accelerator(device) if isinstance(device, str) else device
        self.shape = model_shape(shape)
        n, s = tensor_parallel, self.shape
        if n < 1 or s.heads % n or (s.kv_heads % n and n % s.kv_heads):
            raise ValueError(f"tensor parallel {n} does not split {s.name}'s {s.heads} heads "
                             f"and {s.kv_heads} KV heads evenly")
        if min(weight_bytes, kv_bytes, block_size) < 1:
            raise ValueError("weight_bytes, kv_bytes and block_size must be >= 1")
        self.tensor_parallel, self.weight_bytes, self.kv_bytes = n, weight_bytes, kv_bytes
        self.block_size = block_size

    @property
    def kv_bytes_per_token_per_device(self) -> int:
        """K and V of one position on one device: its share of the KV heads (at least one head:
        past as many devices as KV heads, vLLM replicates them)."""
        s = self.shape
        heads = max(s.kv_heads // self.tensor_parallel, 1)
        return 2 * s.layers * heads * s.head_dim * self.kv_bytes

    def breakdown(self, work: StepFeatures) -> StepTime:
        """The step's seconds by part (all zero for a step with no token, its swap apart)."""
        swap_s = (work.swap_blocks * self.block_size * self.kv_bytes_per_token_per_device
                  / self.device.host_link_bandwidth)
        tokens = work.decode_rows + work.prefill_tokens
        if tokens <= 0:
            return StepTime(0.0, 0.0, 0.0, 0.0, swap_s)
        dev, n = self.device, self.tensor_parallel
        return StepTime(self._compute_s(work), self._bytes(work) / n
                        / (dev.memory_bandwidth * dev.memory_efficiency),
                        dev.step_overhead_s, self._all_reduce_s(tokens), swap_s)

    def step_seconds(self, work: StepFeatures) -> float:
        return self.breakdown(work).total

    def _compute_s(self, work: StepFeatures) -> float:
        s, dev = self.shape, self.device
        attention_per_pair = 4 * s.layers * s.heads * s.head_dim
        decode = (2 * (s.active_layer_params + s.head_params) * work.decode_rows
                  + attention_per_pair * work.context_tokens)
        sampled_prompt_rows = 1 if work.prefill_tokens else 0  # a chunk's last token
        prefill = (2 * s.active_layer_params * work.prefill_tokens
                   + 2 * s.head_params * sampled_prompt_rows
                   + attention_per_pair * work.prefill_context)
        per_device = dev.peak_bf16_flops * self.tensor_parallel
        return (decode / (per_device * dev.decode_efficiency)
                + prefill / (per_device * dev.prefill_efficiency))

    def _bytes(self, work: StepFeatures) -> float:
        """Bytes the whole worker reads and writes in the step (devices share them evenly, KV
        replicated past as many devices as KV heads)."""
        s = self.shape
        tokens = work.decode_rows + work.prefill_tokens
        experts = s.routed_expert_params
        if experts:
            experts *= 1 - (1 - s.experts_per_token / s.num_experts) ** tokens
        weights = (s.dense_layer_params + experts + s.head_params + tokens * s.hidden) \
            * self.weight_bytes
        positions = (work.context_tokens + work.prefill_context / PREFILL_QUERY_TILE + tokens)
        kv = positions * self.kv_bytes_per_token_per_device * self.tensor_parallel
        return weights + kv

    def _all_reduce_s(self, tokens: int) -> float:
        """Two ring all-reduces per layer of the step's activations (none on one device)."""
        n = self.tensor_parallel
        if n == 1:
            return 0.0
        size = tokens * self.shape.hidden * ACTIVATION_BYTES
        one = 2 * (n - 1) / n * size / self.device.link_bandwidth + self.device.link_latency_s
        return 2 * self.shape.layers * one

    # ---- memory ------------------------------------------------------------------------

    @property
    def weight_bytes_per_device(self) -> int:
        return math.ceil(self.shape.total_params * self.weight_bytes / self.tensor_parallel)

    def activation_reserve_bytes(self, max_batched_tokens: int = MAX_BATCHED_TOKENS) -> int:
        """Memory kept from the KV pool on each device: the runtime's, and the activations of a
        step of `max_batched_tokens` (a few hidden-wide tensors, the MLP's gate and up)."""
        s, n = self.shape, self.tensor_parallel
        mlp = max(s.intermediate if s.moe_layers < s.layers else 0,
                  s.experts_per_token * s.moe_intermediate + s.shared_expert_intermediate)
        per_token = (4 * s.hidden + 2 * mlp // n) * ACTIVATION_BYTES
        return RUNTIME_RESERVE_BYTES + max_batched_tokens * per_token

    def kv_pool_bytes(self, memory_utilization: float = MEMORY_UTILIZATION,
                      max_batched_tokens: int = MAX_BATCHED_TOKENS) -> int:
        """Bytes of KV each device holds: its memory x `memory_utilization`, less its weights
        and `activation_reserve_bytes`. ValueError when the weights do not fit, or leave no
        room for KV, saying by how much."""
        if not 0 < memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
        usable = int(self.device.memory_bytes * memory_utilization)
        weights = self.weight_bytes_per_device
        where = (f"{self.shape.name} on {self.device.name} x{self.tensor_parallel} "
                 f"(tensor parallel {self.tensor_parallel})")
        if weights > usable:
            raise ValueError(
                f"the weights of {where} do not fit: {weights / GIB:.1f} GiB per device, "
                f"{usable / GIB:.1f} GiB usable ({memory_utilization:g} of "
                f"{self.device.memory_bytes / GIB:.0f} GiB): {(weights - usable) / GIB:.1f} GiB "
                "short (more tensor parallelism, or a device with more memory)")
        pool = usable - weights - self.activation_reserve_bytes(max_batched_tokens)
        if pool <= 0:
            raise ValueError(f"no memory left for KV with {where}: {weights / GIB:.1f} GiB of "
                             f"weights and the activation reserve leave {pool / GIB:.1f} GiB "
                             f"of {usable / GIB:.1f} GiB usable")
        return pool

    def kv_blocks(self, block_size: int | None = None,
                  memory_utilization: float = MEMORY_UTILIZATION,
                  max_batched_tokens: int = MAX_BATCHED_TOKENS) -> int:
        """KV blocks of `block_size` positions (default the cost's) the worker holds: each
        device holds its heads' share of every block."""
        size = block_size or self.block_size
        return self.kv_pool_bytes(memory_utilization, max_batched_tokens) \
            // (size * self.kv_bytes_per_token_per_device)

    def describe(self) -> str:
        s, dev = self.shape, self.device
        return (f"roofline: {s.name} ({s.total_params / 1e9:.1f}B params, "
                f"{s.active_params / 1e9:.1f}B active) on {dev.describe()} "
                f"x{self.tensor_parallel} (tensor parallel {self.tensor_parallel}), "
                f"weights {self.weight_bytes} B, KV {self.kv_bytes} B per element")


# ---- the measured curve ------------------------------------------------------------------


class MeasuredCost:
    """A real worker's measured step-cost curve, replayed: `step_seconds` is the curve's
    `step_seconds` (the forward and the sampling, as the real worker timed them), never
    negative.

    The curve's `overhead_s` (the loop's time around a step: publishing, reading Redis) is NOT
    added: a simulated worker's own loop runs for real around each simulated step, so its
    overhead is spent for real; adding the measured one would count it twice. Nor is the
    curve's `margin` (the host's noise above the fit): the simulated loop has its own."""

    def __init__(self, curve: StepCostCurve, source: str):
        if not curve.fitted:
            raise ValueError(f"{source}: the step-cost curve has seen no step yet (steps 0)")
        self.curve, self.source = curve, source

    def step_seconds(self, work: StepFeatures) -> float:
        if work == StepFeatures():
            return 0.0
        return max(self.curve.step_seconds(work), 0.0)

    def describe(self) -> str:
        terms = ", ".join(f"{name} {value:.3g}"
                          for name, value in zip(COEFFICIENTS, self.curve.coefficients()))
        return (f"measured curve of {self.source} ({self.curve.steps} steps): {terms} "
                f"(loop overhead {self.curve.overhead_s:.3g} s not added)")


def measured_cost_from_file(path: str | Path) -> MeasuredCost:
    """The curve a file holds: `StepCostCurve.to_json`'s JSON, what a heartbeat's `step_cost`
    field carries and `kvfleet plan --step-cost` reads; ValueError when it cannot be read, is
    not a curve, or has seen no step."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the step-cost curve {path}: {exc}") from None
    try:
        curve = StepCostCurve.from_json(text)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return MeasuredCost(curve, str(path))


def measured_cost_from_heartbeat(heartbeat: Heartbeat, source: str = "") -> MeasuredCost:
    """The curve a worker's heartbeat carries (`Heartbeat.step_cost`); ValueError when it
    carries no fitted curve."""
    source = source or f"a worker of {heartbeat.model or 'an unnamed model'}"
    if not heartbeat.step_cost:
        raise ValueError(f"the heartbeat of {source} carries no fitted step-cost curve (a worker "
                         "fits one from the steps it runs)")
    try:
        curve = StepCostCurve.from_json(heartbeat.step_cost)
    except ValueError as exc:
        raise ValueError(f"the heartbeat of {source}: {exc}") from None
    return MeasuredCost(curve, source)


# ---- the choice --------------------------------------------------------------------------


def step_cost(device: str | None = None, model_shape: str | Mapping | ModelShape | None = None,
              tensor_parallel: int = 1, curve_file: str | None = None,
              block_size: int = DEFAULT_BLOCK_SIZE) -> RooflineCost | MeasuredCost:
    """The cost model of a simulated worker: the roofline of `device` for `model_shape` at
    `tensor_parallel`, or the measured curve of `curve_file` (exactly one of the two; a curve
    already holds its worker's model and tensor parallelism, so those are not used with it)."""
    if (device is None) == (curve_file is None):
        raise ValueError("give exactly one of a device (a roofline) or a curve file (a measured "
                         "step-cost curve)")
    if curve_file is not None:
        return measured_cost_from_file(curve_file)
    if model_shape is None:
        raise ValueError(f"a roofline of {device} needs a model shape")
    return RooflineCost(device, model_shape, tensor_parallel, block_size=block_size)
