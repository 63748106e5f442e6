"""The engine's configuration, each field written once: name, type, default, validation and the
text that `kvfleet worker --help` and the README show. The fields are written in groups by concern
(model, parallel, cache, scheduler, pace, lora, and speculative_config), which `EngineConfig` takes
as flat fields: `WorkerSettings` (shared/settings.py) takes those as its own, so a worker's flags
and `KVFLEET_*` variables are these fields; the engine (worker/engine) takes an `EngineConfig`, as
tests and benchmarks build it directly, and reads it through its groups."""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import (AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      model_validator)
from pydantic.dataclasses import dataclass

from kvfleet.shared.byte_size import ByteSize

# The engine's own checks of these names (worker/engine: device.py, kv_format.py, preemption.py,
# cuda_graphs.py) hold the same choices; tests/test_settings.py keeps the two equal.
AttentionBackend = Literal["auto", "sdpa", "cpu", "triton"]
CudaGraphsMode = Literal["auto", "off", "eager"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LoadFormat = Literal["auto", "dummy"]
KvDtype = Literal["auto", "bf16", "fp16", "fp32", "fp8", "int8"]
PreemptionMode = Literal["auto", "swap", "recompute"]

SpeculativeMethod = Literal["ngram", "suffix", "draft_model"]


class SpeculativeConfig(BaseModel):
    """`--speculative-config`, in vLLM's spelling where it has one: which proposer guesses the
    next tokens of a decoding stream and how many; the target model verifies every guess, so the
    answer is the one plain decoding gives (docs/OPERATIONS.md, "Speculative decoding")."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    method: SpeculativeMethod = Field(description=(
        "`ngram` (prompt lookup: the tokens that followed the last match of the stream's final "
        "n-gram in its prompt and output), `suffix` (suffix decoding: suffix trees over the "
        "stream and over recent answers of this worker), `draft_model` (a smaller model with "
        "the same tokenizer, `model`)"))
    num_speculative_tokens: int = Field(5, ge=1, le=32, description=(
        "proposed tokens per stream and step at most (fewer where acceptance or the batch "
        "says so)"))
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: the longest n-gram matched")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: the shortest n-gram matched")
    model: str | None = Field(None, description=(
        "draft_model: a model directory or local HF cache id, sharing the target's tokenizer"))
    suffix_decoding_max_tree_depth: int = Field(24, ge=1, description=(
        "suffix: the longest suffix matched (and depth of the trees)"))
    suffix_decoding_max_cached_requests: int = Field(100, ge=0, description=(
        "suffix: finished answers kept in the worker's tree (pure Python: about 0.5 MB per "
        "500-token answer, and the garbage collector's passes grow with it)"))
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0, description=(
        "suffix: proposals at most this many times the matched length"))
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1, description=(
        "suffix: a proposal stops where its estimated probability falls below this"))
    adaptive: bool = Field(True, description=(
        "propose only where the expected accepted tokens are worth the rows they add, by each "
        "stream's acceptance and the step cost measured as the worker runs; false: always "
        "num_speculative_tokens where the proposer has them, as vLLM does"))
    disable_by_batch_size: int | None = Field(None, ge=1, description=(
        "no speculation while more streams than this decode (the step-cost rule backs off "
        "anyway; this is a hard cap)"))

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError("`model` names a draft model: only with method draft_model")
        return self


def _json_object(value):
    """A JSON text (a flag, an environment variable) as the object it spells; '' is unset."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON object ({exc}): {value!r}") from None
    return value


class _Group(BaseModel):
    """One concern's fields. Frozen: an engine's parts hold their group for the engine's life,
    so what one part read at start-up is what every other part reads."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class ModelConfig(_Group):
    """How the model is loaded and computed: where, in which dtype, with which kernels."""

    device: str = Field("auto", description=(
        "`auto` (the first CUDA device if there is one, else the CPU), `cpu`, `cuda` (the current "
        "CUDA device), `cuda:N`"))
    dtype: Dtype = Field("auto", description=(
        "weights and activations: `auto` (bf16 on CUDA and on CPUs with native bf16, AMX or "
        "AVX512-BF16; float32 where bf16 is emulated, AVX2 only), `float32`, `bfloat16`, "
        "`float16`"))
    load_format: LoadFormat = Field("auto", description=(
        "how weights load (vLLM's spelling): `auto` (the model directory's safetensors), `dummy` "
        "(the directory's config with seeded random weights, no weight file read: benchmarks "
        "of a model's shape; answers are nonsense). `--model random:<shape>` is a directory of "
        "random weights both kvfleet and a peer can load (shared/model_shapes.py)"))
    attention_backend: AttentionBackend = Field("auto", description=(
        "`auto`: `triton` (the Triton paged-attention kernel) on CUDA where the triton package "
        "imports; on a CPU `cpu` (the C++ paged-attention kernels, built on first use with "
        "`$CXX`, default g++, into KVFLEET_KERNEL_CACHE) where they build; else `sdpa` (gather + "
        "PyTorch SDPA). Or one of `sdpa`, `cpu`, `triton` (docs/GPU.md)"))
    cuda_graphs: CudaGraphsMode = Field("auto", description=(
        "decode steps replayed from CUDA graphs at batch-size buckets: `auto` (on CUDA with the "
        "triton backend and one rank), `off`, `eager` (their static buffers without capture, for "
        "debugging)"))
    deterministic: bool = Field(True, description=(
        "one answer per (prompt, parameters, seed), whatever the batch it ran in, how its prompt "
        "was chunked, prefix-cache hits, preemption, or a resume on another worker of the same "
        "kind (docs/RELIABILITY.md): every query row is computed by batch-invariant kernels. "
        "off: long prompts prefill faster on the CPU (its tiled prefill kernel) and a resumed "
        "bf16 answer may differ from the uninterrupted one"))
    grammar_cache_size: int = Field(256, description=(
        "compiled output constraints (structured outputs, forced tool calls) kept, LRU"))


class ParallelConfig(_Group):
    """How many devices the model is split over."""

    tensor_parallel_size: int = Field(1, ge=1, description=(
        "ranks (one process and device each: `cuda:0..N-1`, from `cuda:K` on `K..K+N-1`; gloo on "
        "the CPU) the model is split over; kv_memory, swap_space and gpu_memory_utilization are "
        "per rank (docs/DEPLOY.md)"))


class CacheConfig(_Group):
    """The KV cache: its blocks and the memory they take, where a preempted stream's KV goes,
    and the prefix cache over it."""

    block_size: int | None = Field(None, ge=1, json_schema_extra={"default_text": "auto"},
                                   description=(
        "tokens per KV block; auto (unset): 64 where the C++ CPU attention kernel reads a bf16 "
        "pool (bf16 weights, kv_dtype auto or bf16), else 16 (worker/engine/memory/device.py); a shared "
        "prefix is reused in whole blocks"))
    num_blocks: int | None = Field(None, ge=1, description=(
        "the pool's size in blocks instead of one from the memory budget"))
    # The byte sizes are also taken as `kv_memory_bytes=` / `swap_space_bytes=` and read as the
    # properties of those names: what the engine and its callers write.
    kv_memory: ByteSize = Field(
        1 << 30, ge=0, validation_alias=AliasChoices("kv_memory", "kv_memory_bytes"),
        description=("KV cache budget on the CPU (`2GiB`, `512MB`, or bytes); on CUDA the pool is "
                     "sized by gpu_memory_utilization instead"))
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description=(
        "on CUDA: the share of the device's total memory this worker may use; the KV cache gets "
        "that share less what is in use when the pool is sized (the weights, the CUDA context, "
        "other processes) and less the peak of a profiled largest step (docs/GPU.md); the CPU "
        "uses kv_memory instead"))
    kv_dtype: KvDtype = Field("auto", description=(
        "KV cache storage: `auto` (the weights' dtype), `bf16`, `fp16`, `fp32`, `fp8` (e4m3), "
        "`int8`; the 8-bit ones hold about twice the tokens of bf16 in the same memory "
        "(docs/OPERATIONS.md)"))
    preemption: PreemptionMode = Field("auto", description=(
        "when the pool runs out: `swap` a stream's KV to host memory, `recompute` it later, or "
        "`auto` (a cost model picks per preemption: bytes to move against tokens to recompute)"))
    swap_space: ByteSize = Field(
        4 << 30, ge=0, validation_alias=AliasChoices("swap_space", "swap_space_bytes"),
        description="host memory for swapped-out KV; when it is full, preemption recomputes")
    kv_offloading_size: float = Field(0.0, ge=0, json_schema_extra={"default_text": "0 (off)"},
                                      description=(
        "GiB of host memory (vLLM's spelling) for a second tier of the prefix cache: blocks "
        "evicted from the KV pool are copied there (least recently used dropped when full) and "
        "a request whose prefix is there gets them back instead of recomputing them (pinned on "
        "CUDA; on the CPU memory beside kv_memory; docs/OPERATIONS.md, \"The host tier\"). "
        "0: off, nothing allocated"))
    kv_offloading_disk: str = Field("", json_schema_extra={"default_text": "none (off)"},
                                    description=(
        "a directory for a third tier of the prefix cache behind the host tier "
        "(kv_offloading_size): blocks the host tier drops for room are kept in a "
        "memory-mapped file there (kv_offloading_disk_size), least recently used dropped when "
        "full, and brought back as the host tier's are; the file is unlinked at once, so "
        "nothing outlives the worker (docs/OPERATIONS.md, \"The disk tier\")"))
    kv_offloading_disk_size: float = Field(0.0, ge=0, json_schema_extra={"default_text": "0"},
                                           description=(
        "GiB of kv_offloading_disk the disk tier takes (needed with kv_offloading_disk)"))
    enable_prefix_caching: bool = Field(True, description=(
        "reuse the KV blocks of identical prompt openings"))
    watermark: float = Field(0.01, ge=0.0, lt=1.0, description=(
        "share of the pool's blocks kept free when admitting new work"))

    @property
    def kv_memory_bytes(self) -> int:
        return self.kv_memory

    @property
    def swap_space_bytes(self) -> int:
        return self.swap_space

    @property
    def kv_offloading_size_bytes(self) -> int:
        return int(self.kv_offloading_size * (1 << 30))

    @property
    def kv_offloading_disk_size_bytes(self) -> int:
        return int(self.kv_offloading_disk_size * (1 << 30))


class SchedulerConfig(_Group):
    """How much work one step takes, whatever the pace."""

    max_batched_tokens: int = Field(512, ge=1, description=(
        "tokens computed per step: the running streams' decode tokens first, then prefill chunks"))
    max_running: int = Field(64, ge=1, description="streams in the running group at most")


class PaceConfig(_Group):
    """The latencies promised to every stream, which size each step within the scheduler's
    limits."""

    target_itl_ms: float = Field(0.0, ge=0, json_schema_extra={"default_text": "0 (off)"},
                                 description=(
        "the pace promised to every stream: the longest time between two of its tokens (p99). "
        "The worker learns its step cost as it runs and keeps each step within this: prefill "
        "chunks are cut to fit, a new stream is taken only while the group with it keeps the "
        "pace, and a request it cannot serve at pace stays queued for another worker "
        "(docs/OPERATIONS.md, \"The promised pace\"). 0: off (max_running and "
        "max_batched_tokens only)"))
    target_ttft_ms: float = Field(0.0, ge=0, json_schema_extra={"default_text": "0 (off)"},
                                  description=(
        "the first token promised within this of the request's enqueue (p99): the worker takes "
        "no new request while the prompts it already holds would keep a new one's first token "
        "later than this (an idle worker takes any). 0: off"))
    min_target_itl_ms: float | None = Field(None, ge=0, json_schema_extra={
        "default_text": "target_itl_ms"}, description=(
        "the tightest pace a request may ask for (its `target_itl_ms`); a tighter one is served "
        "at this one. Unset: target_itl_ms (requests may only loosen the pace); with neither "
        "set, requests' targets are ignored"))
    pace_warmup: bool = Field(True, description=(
        "with a target: at start-up, time a sweep of decode groups and prefill chunks on random "
        "tokens (seconds: 7 s for the default model on 2 AVX2 cores), kept as the step-cost "
        "fit's prior: the first requests are sized from a fitted curve, and what one more "
        "stream costs stays known while the group's size barely varies. false: the fit starts "
        "from the first steps served"))


class LoraConfig(_Group):
    """LoRA adapters: whether they are served, and the device and host room they get."""

    enable_lora: bool = Field(False, description=(
        "serve PEFT LoRA adapters of the model: a request names one (`lora`), and one step "
        "computes requests of several adapters and of the base model together; the device "
        "holds max_loras adapters' weights at max_lora_rank from start-up (docs/OPERATIONS.md, "
        "\"LoRA adapters\")"))
    max_loras: int = Field(4, ge=1, description=(
        "adapters one step computes at most (its device slots, allocated before the KV budget "
        "is sized); a request whose adapter finds no free slot waits, in arrival order"))
    max_cpu_loras: int | None = Field(None, ge=1, json_schema_extra={
        "default_text": "4 × max_loras"}, description=(
        "adapters kept loaded in host memory, least recently used evicted first (never one a "
        "queued or running request uses: a request whose adapter finds no room waits); at "
        "least max_loras"))
    max_lora_rank: int = Field(16, ge=1, le=512, description=(
        "the largest adapter rank served (1..512): adapters of a higher rank are refused, and "
        "every device slot is this wide"))

    @model_validator(mode="after")
    def _check_loras(self) -> LoraConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}): a step's adapters are all loaded")
        return self

    @property
    def lora_cache_size(self) -> int:
        """Adapters kept loaded in host memory: max_cpu_loras, else 4 x max_loras."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras


# EngineConfig's groups by the attribute that holds each, in the order the README shows them.
GROUPS: dict[str, type[_Group]] = {
    "model": ModelConfig, "parallel": ParallelConfig, "cache": CacheConfig,
    "scheduler": SchedulerConfig, "pace": PaceConfig, "lora": LoraConfig}
# `speculative_config` is a group and a flat keyword at once: its flag is vLLM's JSON of the
# whole group, so its fields are not flat keywords of their own.
WHOLE_GROUPS = ("speculative_config",)

# Fields a worker does not take from its settings: tests and benchmarks set them.
ENGINE_ONLY = ("num_blocks", "watermark")


def field_groups(fields, groups: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Each flat field's group, given each group's fields. A field in no group would be read
    nowhere grouped, a field in two would be one value read under two names: both refused."""
    found: dict[str, list[str]] = {name: [] for name in fields}
    for group, names in groups.items():
        for name in names:
            if name not in found:
                raise ValueError(f"{group}.{name} is not a flat field")
            found[name].append(group)
    for name, where in found.items():
        if len(where) != 1:
            raise ValueError(f"the flat field {name} is in {len(where)} groups {where}: "
                             "each belongs to exactly one")
    return {name: where[0] for name, where in found.items()}


def _with_group_fields(cls):
    """Gives the class every group's fields as its own flat fields (the same type, default,
    checks and description: written once, in the group), before the class's own fields."""
    own = cls.__dict__.get("__annotations__", {})
    annotations = {}
    for group in GROUPS.values():
        for name, field in group.model_fields.items():
            if name in own or name in annotations:
                raise TypeError(f"{cls.__name__}.{name} is written twice")
            annotations[name] = field.annotation
            setattr(cls, name, copy.copy(field))
    cls.__annotations__ = {**annotations, **own}
    return cls


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
@_with_group_fields
class EngineConfig:
    """What an `Engine` is built with; checked whenever one is made (`dataclasses.replace` too).
    Flat, as a user types it (flags, `KVFLEET_*` variables, keywords), like vLLM's EngineArgs;
    read grouped by concern (`config.cache.block_size`), like vLLM's VllmConfig, so that a part
    of the engine is handed the group it needs. Frozen, so the two can never disagree."""

    speculative_config: Annotated[SpeculativeConfig | None, BeforeValidator(_json_object)] = Field(
        None, json_schema_extra={"default_text": "off"}, description=(
            "speculative decoding, as JSON in vLLM's spelling: `{\"method\": \"ngram\", "
            "\"num_speculative_tokens\": 5}`; methods `ngram`, `suffix`, `draft_model` (with "
            "`model`); the answers stay token for token those of plain decoding "
            "(docs/OPERATIONS.md, \"Speculative decoding\")"))
    if TYPE_CHECKING:  # set from the flat fields once they are checked (_group)
        model: ModelConfig
        parallel: ParallelConfig
        cache: CacheConfig
        scheduler: SchedulerConfig
        pace: PaceConfig
        lora: LoraConfig

    @model_validator(mode="after")
    def _group(self) -> EngineConfig:
        for attribute, group in GROUPS.items():
            values = {name: getattr(self, name) for name in group.model_fields}
            try:
                object.__setattr__(self, attribute, group(**values))
            except ValidationError as exc:  # only a check across the group's fields is left
                raise ValueError("; ".join(str(error.get("ctx", {}).get("error", error["msg"]))
                                           for error in exc.errors())) from None
        return self

    @model_validator(mode="after")
    def _check_offloading(self) -> EngineConfig:
        # the tier's restores are copied into rank 0's pool only, and into the target's pool,
        # not a draft model's: refused rather than served wrong
        cache = self.cache
        if cache.kv_offloading_disk and not (cache.kv_offloading_size
                                             and cache.kv_offloading_disk_size):
            raise ValueError("kv_offloading_disk needs kv_offloading_size (the host tier it "
                             "sits behind) and kv_offloading_disk_size")
        if cache.kv_offloading_disk_size and not cache.kv_offloading_disk:
            raise ValueError("kv_offloading_disk_size needs kv_offloading_disk (a directory)")
        if self.cache.kv_offloading_size and self.parallel.tensor_parallel_size > 1:
            raise ValueError("kv_offloading_size is not supported with tensor parallelism yet")
        spec = self.speculative_config
        if self.cache.kv_offloading_size and spec is not None and spec.method == "draft_model":
            raise ValueError("kv_offloading_size is not supported with a draft model yet")
        return self

    # the keywords' other spellings (`kv_memory_bytes=`), read back by the same names

    @property
    def kv_memory_bytes(self) -> int:
        return self.cache.kv_memory_bytes

    @property
    def swap_space_bytes(self) -> int:
        return self.cache.swap_space_bytes


# Checked on import: a field added to no group, or to two, stops everything that uses the engine.
FIELD_GROUPS = field_groups(
    EngineConfig.__pydantic_fields__,
    {name: tuple(group.model_fields) for name, group in GROUPS.items()}
    | {name: (name,) for name in WHOLE_GROUPS})
