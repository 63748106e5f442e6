"""Settings of the gateway, the worker, the batch worker, `kvfleet up` and the CPU kernels:
defaults, overridden by KVFLEET_* environment variables, overridden by command-line flags (the CLI
passes flags as constructor keywords). Each field's description is its `--help` text and its
README row (kvfleet/settings_doc.py); no KVFLEET_* variable is read anywhere else."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import uuid
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import Field, ValidationInfo, create_model, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvfleet.shared.engine_config import ENGINE_ONLY, EngineConfig
from kvfleet.shared.lora import parse_lora_module
from kvfleet.shared.models import DEFAULT_MODEL, default_cache_dir, served_model_id
from kvfleet.shared.wire.keys import Keys


class CommonSettings(BaseSettings):
    """Settings every process of a fleet reads."""

    model_config = SettingsConfigDict(env_prefix="KVFLEET_", extra="ignore",
                                      protected_namespaces=())

    redis_url: str | None = Field(None, description=(
        "Redis of the fleet: a single Redis or any node of a Redis Cluster (detected; "
        "docs/DEPLOY.md); `kvfleet up` starts an embedded one when none is set"))
    model: str = Field(DEFAULT_MODEL, description=(
        "the default model, a transformers model directory, a model id in the local HF cache, or "
        "`random:<shape>`: random weights of a real model's shape for benchmarks "
        "(llama-3.2-1b, llama-3.2-3b, qwen2.5-1.5b, qwen3-moe-30b-a3b-8l32e; "
        "shared/model_shapes.py)"))
    # Not a JSON-decoded variable (NoDecode): the validator reads vLLM's spellings itself.
    served_model_name: Annotated[list[str], NoDecode] = Field(
        default_factory=list, json_schema_extra={
            "default_text": "`--model`'s directory name (an id: the id itself)"}, description=(
            "the names the model is served under, as vLLM's flag: `--served-model-name "
            "HuggingFaceTB/SmolLM2-135M-Instruct smol` (or comma-separated; the variable the "
            "same, or a JSON list). The first is the model's name in /v1/models, in answers, "
            "metrics labels, the fleet's Redis keys and the prefix hash; requests may name any "
            "of them; the tokenizer still loads from --model. Gateways and workers of one model "
            "must give the same first name; `kvfleet up` gives them to --model's workers"))
    key_prefix: str = Field("kvf:", description="prefix of every Redis key")
    queue_shards: int = Field(1, ge=1, description=(
        "stream shards per model: 1 on a single Redis, about one per primary on a cluster; "
        "gateways and workers of one fleet must use the same number"))
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        json_schema_extra={"default_text": "`$XDG_CACHE_HOME/kvfleet/models`, else "
                                           "`~/.cache/kvfleet/models`"},
        description="where the default model is converted to safetensors")
    otlp_traces_endpoint: str = Field("", json_schema_extra={"default_text": "none (off)"},
                                      description=(
        "send OpenTelemetry traces to this OTLP collector, as vLLM's flag: an OTLP/HTTP URL "
        "(`http://collector:4318`; `/v1/traces` is added to a URL without a path), or a gRPC "
        "one with `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc` (needs the "
        "opentelemetry-exporter-otlp-proto-grpc package). The gateway's span of each request, "
        "the workers' spans under it; the standard `OTEL_*` variables apply (service name, "
        "sampler, headers: docs/OPERATIONS.md, \"Traces\"). none: no tracer, nothing exported"))
    log_level: str = Field("INFO", description="logging level: DEBUG, INFO, WARNING, ERROR")
    routing: Literal["affinity", "shared", "random"] = Field("affinity", description=(
        "`affinity`: workers announce the blocks of their prefix cache and gateways send a "
        "request to the own stream of the worker holding most of its prompt (load permitting), "
        "from which any other worker takes it after a bounded wait; `shared`: every request to "
        "the model's shared streams, taken by whichever worker has room; `random`: every "
        "request to the own stream of a uniformly random live worker, blind to caches and "
        "loads (a baseline; idle workers still take entries waiting on busy ones after "
        "`--affinity-steal-after-ms`) (docs/ARCHITECTURE.md, \"Prefix-affinity routing\")"))

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _split_served_model_name(cls, value) -> list[str]:
        return split_served_names(value)

    def keys(self) -> Keys:
        """The fleet's key names (prefix and stream shards)."""
        return Keys(self.key_prefix, queue_shards=self.queue_shards)

    def served_names(self) -> list[str]:
        """The model's names (`--served-model-name`, else its served id): the first is the one
        reported and the one the fleet's keys and prefix hashes are made from."""
        return self.served_model_name or [served_model_id(self.model)]


def split_served_names(value) -> list[str]:
    """`--served-model-name`'s names, in order, each once: from a list of entries (the flag's
    words) or a text (the variable), split at spaces and commas; a text starting with `[` is a
    JSON list (what `kvfleet up` passes its children)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith("[") else [value]
    if not isinstance(value, list) or not all(isinstance(entry, str) for entry in value):
        raise ValueError("served_model_name: names expected, as text or a JSON list of text")
    names = [name for entry in value for name in re.split(r"[\s,]+", entry) if name]
    return list(dict.fromkeys(names))


class BatchApiSettings(CommonSettings):
    """What the batch API's routes (gateway) and its jobs (batch worker) both need to agree on."""

    batch_max_file_bytes: int = Field(100 * 1024**2, ge=1, description=(
        "an upload larger than this many bytes is refused (413)"))
    batch_max_lines: int = Field(50_000, ge=1, description="lines of one batch file at most")
    batch_ttl_s: int = Field(7 * 24 * 3600, ge=60, description=(
        "files and batch records expire after this many seconds"))
    batch_redis_url: str | None = Field(None, json_schema_extra={"default_text": "`--redis-url`"},
                                        description=(
        "a single Redis for rq's batch job queue (rq does not speak cluster: needed on a Redis "
        "Cluster); batch records stay on the fleet's Redis"))


class GatewaySettings(BatchApiSettings):
    host: str = Field("127.0.0.1", description="the gateway's address")
    port: int = Field(8000, description="the gateway's port")
    request_timeout_s: float = Field(600.0, description=(
        "a request's deadline, carried in its stream entry; a request still queued past it is "
        "skipped"))
    first_event_timeout_s: float = Field(600.0, description=(
        "no event at all for a request this long: the client gets an error"))
    stream_reconnect_s: float = Field(15.0, ge=0, description=(
        "a stream whose pub/sub connection broke (Redis restarted, a cluster primary failed "
        "over) subscribes again for this long and goes on with the missed tokens read from the "
        "checkpoint; past it the client gets a retryable 503 error; 0: that error at once"))
    gateway_shard_shares: bool = Field(True, description=(
        "with several stream shards (a cluster): send new requests to this gateway's shares of "
        "the shards, by its place among the live gateways (gateway/fleet/homes.py), so that it "
        "talks to as few primaries as balance allows; balance then follows the gateways' loads. "
        "off: every request to the shard its random id picks (docs/DEPLOY.md)"))
    gateway_inboxes: bool = Field(True, description=(
        "token events come back in this gateway's inboxes (gateway/fleet/inboxes.py): one "
        "message per worker step with the events of all its requests there, one subscription "
        "per inbox. off: one subscription and one message per request on its own channel, only "
        "for a rolling upgrade from workers older than inboxes (docs/DEPLOY.md)"))
    affinity_balance: float = Field(1.5, ge=1.0, description=(
        "`--routing affinity`: a worker is chosen for the prompt blocks it holds only while its "
        "load (requests running, waiting and routed to it) stays within this factor of the "
        "fleet's mean load (or two requests above the least loaded worker); beyond it, load "
        "wins over affinity"))
    affinity_host_tier_weight: float = Field(0.75, ge=0.0, le=1.0, description=(
        "`--routing affinity`: what a prompt block a worker holds in its host tier "
        "(`--kv-offloading-size`) counts for, against 1 for a block on its device (Dynamo's "
        "default): a device holder beats a host-tier holder of the same prefix, which beats a "
        "worker holding none of it; 1 scores the tiers alike, 0 a host-tier block as absent"))
    affinity_min_blocks: int = Field(1, ge=1, description=(
        "`--routing affinity`: a worker holding fewer of a prompt's leading blocks counts as "
        "holding none of it; a request no eligible worker holds goes to the least loaded one"))
    max_body_bytes: int = Field(1_000_000, description=(
        "a request body larger than this many bytes is refused (413), after the gateway has read "
        "and discarded the upload (up to 64 MiB and 10 s: docs/API.md), so that a client that "
        "sends its whole body before reading gets the 413, not a reset connection"))
    default_max_tokens: int | None = Field(None, json_schema_extra={
        "default_text": "none (the rest of the context)"},
        description="max_tokens of a request that gives none")
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description=("the model's tool-call format: `auto` (from its chat template; "
                             "gateway/tools/), `hermes`, `llama3_json`, `mistral`"))
    reasoning_parser: Literal["auto", "think", "none"] = Field("auto", description=(
        "split `<think>...</think>` into reasoning_content: `auto` (when the vocabulary has both "
        "tags as tokens), `think`, `none`"))
    default_temperature: float | None = Field(None, json_schema_extra={
        "default_text": "none (the model's generation config)"}, description=(
        "temperature of requests that give none; none: the model's generation config decides, "
        "as in transformers' generate() (greedy unless it sets do_sample); 1.0 is OpenAI's "
        "default"))
    stream_maxlen: int = Field(100_000, description="cap of each request stream (entries)")
    redis_max_connections: int = Field(256, ge=1, description=(
        "the gateway's Redis connections at most (on a cluster: to each node); a command that "
        "finds them all busy waits for one, up to the command timeout, rather than failing "
        "(redis-py's default: 100, then an error at once)"))
    max_queue_wait_s: float = Field(60.0, description=(
        "backpressure: refuse (429 + Retry-After) when the queue's expected wait is longer; 0: "
        "off (the depth limit still holds)"))
    max_queue_depth: int = Field(1000, description=(
        "backpressure: refuse (429) beyond this many undelivered requests of the model; 0: no "
        "limit"))
    queue_tokens_per_request: int = Field(256, description=(
        "output tokens of work assumed per queued request, in the expected wait"))
    min_fleet_tokens_per_s: float = Field(200.0, description=(
        "the fleet's throughput in the expected wait while live workers report about 0"))
    queue_estimate_cache_s: float = Field(0.5, description=(
        "how long one read of the queue and the heartbeats is reused for the expected wait"))
    api_keys: str = Field("", json_schema_extra={"default_text": "none"}, description=(
        "comma-separated plaintext API keys, besides the keys stored in Redis (`kvfleet keys`)"))
    admin_api_key: str = Field("", json_schema_extra={"default_text": "none"}, description=(
        "the key of the admin routes (`/admin/workers`, `POST /admin/workers/{id}/drain`): "
        "they then need `Authorization: Bearer <this key>` (any other key: 403); none: they "
        "take the API keys as `/v1/*` does (open when there are none)"))
    rate_limit_rpm: int = Field(0, description=(
        "requests per minute per API key, unless the key has its own; 0: unlimited"))
    rate_limit_tpm: int = Field(0, description=(
        "tokens (prompt + max_tokens) per minute per API key, unless the key has its own; 0: "
        "unlimited"))
    dashboard_history_s: float = Field(900.0, description=(
        "how long the dashboard's charts keep their samples (docs/OPERATIONS.md)"))
    dashboard_sample_s: float = Field(5.0, description=(
        "one sample of the fleet for the dashboard's charts per this many seconds; at most "
        "dashboard_history_s"))
    # Not a JSON-decoded variable (NoDecode): the validator reads vLLM's spellings itself.
    lora_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list, json_schema_extra={"default_text": "none"}, description=(
            "LoRA adapters of --model registered at start, in vLLM's spelling: `name=path` "
            "entries after the flag (`--lora-modules sql=/adapters/sql chat=/adapters/chat`) or "
            "JSON objects `{\"name\": ..., \"path\": ..., \"base_model_name\": ...}` (the "
            "base, if given, must be --model); the variable takes the same entries separated by "
            "spaces or commas, or a JSON list of them. Each is checked at start (a bad one stops "
            "the gateway) and kept registered when the gateway restarts; requests name an "
            "adapter in `model`; more come and go at run time (POST /v1/load_lora_adapter). "
            "`kvfleet up` starts its workers with enable_lora when adapters are named here"))
    max_lora_rank: int = Field(16, ge=1, le=512, description=(
        "the largest rank of a LoRA adapter (1..512): the gateway refuses to register a larger "
        "one (400); the workers' setting of the same name, which sizes their adapter slots: "
        "one variable sets both"))

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _split_lora_modules(cls, value) -> list[str]:
        entries = split_lora_modules(value) if isinstance(value, str) else list(value or [])
        for entry in entries:
            parse_lora_module(entry)  # ValueError: the entry's spelling, named
        return entries

    @field_validator("dashboard_sample_s")
    @classmethod
    def _check_dashboard_sample(cls, value: float, info: ValidationInfo) -> float:
        history_s = info.data.get("dashboard_history_s", 900.0)
        if not 0 < value <= history_s:
            raise ValueError(f"must be > 0 and at most dashboard_history_s ({history_s:g})")
        return value


def split_lora_modules(text: str) -> list[str]:
    """The entries of a `lora_modules` text: a JSON list of entries, or `name=path` entries and
    JSON objects separated by spaces or commas (a path with either needs the JSON form)."""
    text = text.strip()
    if text.startswith("["):
        entries = json.loads(text)
        if not isinstance(entries, list):
            raise ValueError("lora_modules: a JSON list of entries expected")
        return [e if isinstance(e, str) else json.dumps(e) for e in entries]
    entries, decoder, at = [], json.JSONDecoder(), 0
    while True:
        at = re.compile(r"[\s,]*").match(text, at).end()
        if at >= len(text):
            return entries
        if text[at] == "{":
            obj, end = decoder.raw_decode(text, at)
            entries.append(json.dumps(obj))
        else:
            end = re.compile(r"[^\s,]+").match(text, at).end()
            entries.append(text[at:end])
        at = end


class UpSettings(GatewaySettings):
    """`kvfleet up`: the gateway's settings (it starts one) and the embedded Redis."""

    embedded_redis_port: int = Field(0, ge=0, description=(
        "port of the Redis `kvfleet up` starts when no redis_url is set; 0: a free port"))
    worker_models: str = Field("", json_schema_extra={"default_text": "`--model`"}, description=(
        "the models `kvfleet up` starts workers of, comma-separated (each a model directory or "
        "a model id in the local HF cache, as --model), --workers workers of each; the gateway "
        "serves them all, --model being the default of requests"))
    prefill_workers: int = Field(0, ge=0, description=(
        "`kvfleet up`: workers of `--role prefill` of each model, besides the --workers ones "
        "(those of --role, `both` by default; --workers then defaults to 0): they take new "
        "requests and hand each stream to a decode worker after its first token, so they need "
        "--decode-workers"))
    decode_workers: int = Field(0, ge=0, description=(
        "`kvfleet up`: workers of `--role decode` of each model, besides the --workers ones "
        "(--workers then defaults to 0): they take the streams prefill workers hand over and "
        "no new requests, so they need prefill workers (or --workers)"))


def _engine_settings_fields() -> dict[str, tuple]:
    """EngineConfig's fields, less ENGINE_ONLY, as settings fields: the same type, default, checks
    and description. Its keyword aliases (`kv_memory_bytes=`) stay with EngineConfig: an alias
    here would rename the environment variable."""
    fields = {}
    for name, field in EngineConfig.__pydantic_fields__.items():
        if name not in ENGINE_ONLY:
            setting = copy.copy(field)
            setting.validation_alias = None
            fields[name] = (field.annotation, setting)
    return fields


EngineSettings = create_model(
    "EngineSettings", __base__=CommonSettings, __module__=__name__,
    __doc__="The engine's configuration as settings (shared/engine_config.py).",
    **_engine_settings_fields())


class WorkerSettings(EngineSettings):
    worker_id: str = Field("", json_schema_extra={"default_text": "`<host>-<pid>-<random>`"},
                           description="the worker's name in heartbeats, metrics and logs")
    num_threads: int = Field(0, json_schema_extra={"default_text": (
        "`0`: torch's default (physical cores) capped by the process's CPU affinity and cgroup "
        "CPU quota; `kvfleet up`: cores ÷ workers")}, description=(
        "torch threads per worker on the CPU, shared by its ranks; `kvfleet up` (and "
        "docker-compose's CPU worker) also starts its workers with `OMP_WAIT_POLICY=PASSIVE "
        "GOMP_SPINCOUNT=10000` unless either is set: OpenMP threads that spin long starve the "
        "gateway and Redis on the same cores, threads that sleep at once slow a decode step; a "
        "short spin keeps them awake within a step only (docs/BENCHMARKS.md)"))
    heartbeat_interval_s: float = Field(1.0, description="seconds between a worker's heartbeats")
    heartbeat_ttl_s: float = Field(5.0, description=(
        "a worker silent this long is dead; its requests resume elsewhere"))
    max_deliveries: int = Field(3, description=(
        "a request delivered more often goes to the dead-letter stream"))
    read_block_ms: int = Field(200, description=(
        "how long one XREADGROUP of new requests blocks; below redis-py's socket timeout"))
    publish_interval_ms: float = Field(0.0, ge=0, description=(
        "coalesce token events: a request's new tokens wait until this long after its last "
        "event and go out as one (its first and final events at once); fewer Redis events where "
        "steps are faster than the interval (docs/DEPLOY.md). 0: an event per request per step"))
    timelines_kept: int = Field(10_000, ge=0, description=(
        "finished requests' timelines kept in the model's timelines stream (queue, admission, "
        "prefill, first token, decode gaps: `kvfleet timelines`, docs/OPERATIONS.md); the "
        "oldest are trimmed. 0: none recorded"))
    result_ttl_s: int = Field(3600, description=(
        "how long a finished request's hash and checkpoint are kept (for re-attach)"))
    steal_after_ms: int = Field(50, ge=0, description=(
        "with several stream shards: read the home shards of this worker's place among the live "
        "workers first, the others only for entries that waited this long (an idle worker takes "
        "any entry at once), so a worker's requests sit on one primary; 0: every shard alike"))
    affinity_steal_after_ms: int = Field(250, ge=0, description=(
        "an idle worker takes an entry routed to another worker's own stream once it has "
        "waited this long, if that worker carries two requests or more (any worker takes it at "
        "once when its worker's heartbeat is gone or its free KV cannot hold the entry): a "
        "request never waits on a busy worker longer than this while an idle one has room"))
    resume_prefer_ms: int = Field(1000, ge=0, description=(
        "a dead worker's request is taken over at once by the live worker holding most of its "
        "prefix (by the announced blocks), by the others only this much later"))
    numerics_prefer_ms: int = Field(3000, ge=0, description=(
        "a stream whose tokens so far were computed on other numerics than this worker's (its "
        "numerics fingerprint: CPU kind, GPU, dtype, product form, kernels; docs/RELIABILITY.md) "
        "is resumed or taken over from a handoff by this worker only this much later than a "
        "live worker of those numerics would (which continues it bit for bit); at once when no "
        "such worker is alive; 0: numerics are not preferred"))
    metrics_port: int = Field(0, description=(
        "port of this worker's Prometheus /metrics: 0 = a free port, -1 = off"))
    metrics_host: str = Field("0.0.0.0", description="address of this worker's /metrics")
    metrics_advertise_host: str = Field("", json_schema_extra={"default_text": "the hostname"},
                                        description=(
        "host put in the heartbeat's metrics_url, where the gateway's dashboard finds /metrics"))
    cost_per_hour: float | None = Field(None, description=(
        "$ per accelerator-hour, for the cost per 1M output tokens"))

    batch_target_itl_ms: float = Field(0.0, ge=0, json_schema_extra={"default_text": "0 (none)"},
                                       description=(
        "the pace of `batch`-priority requests that name none: 0 = none (they take the room the "
        "interactive streams' pace leaves and never shrink the group); else their ITL target"))

    role: Literal["both", "prefill", "decode"] = Field("both", description=(
        "what this worker takes: `both` new requests and streams offered with their KV; "
        "`prefill` new requests only, each offered with its KV to a decode worker after its "
        "first token (it keeps decoding a stream no decode worker takes); `decode` offered "
        "streams (and orphaned requests) only: prefill apart from decode (docs/DEPLOY.md)"))
    drain_timeout_s: float = Field(30.0, ge=0, description=(
        "on SIGTERM (or `POST /admin/workers/{id}/drain`) a worker stops taking work, hands its "
        "running streams with their KV to workers with room, finishes the rest, and exits "
        "within this many seconds; what is left then resumes elsewhere from its checkpoint. "
        "Set the orchestrator's grace period above it (docs/RELIABILITY.md). 0: leave at once"))
    handoff_port: int = Field(0, description=(
        "TCP port of this worker's KV transfer plane (handoffs worker to worker): 0 = a free "
        "port, -1 = off (no handoffs: drain and `--role prefill` fall back to checkpoint "
        "resume)"))
    handoff_host: str = Field("0.0.0.0", description="address the KV transfer plane listens on")
    handoff_advertise_host: str = Field("", json_schema_extra={"default_text": "the hostname"},
                                        description=(
        "host put in the heartbeat and handoff offers, where peers reach the transfer plane"))
    handoff_lease_s: float = Field(10.0, gt=0, description=(
        "how long a source keeps a handed-off stream's KV for its taker: a taker that has not "
        "fenced the stream by then loses it, and the source continues it itself"))
    kv_peer_fetch: bool = Field(True, description=(
        "`--routing affinity`: a request whose prompt opening another live worker of the same "
        "numerics holds beyond this worker's cache (in its pool or host tier) takes those KV "
        "blocks over the transfer plane instead of computing them, when the estimate (bytes "
        "over the measured wire rate against the fitted prefill cost) says fetching is faster; "
        "requests sharing a prefix share one fetch; a failed or late fetch falls back to "
        "computing it (docs/OPERATIONS.md, \"Prefixes fetched from peers\"). Needs the "
        "transfer plane (--handoff-port not -1)"))
    kv_peer_fetch_min_tokens: int = Field(64, ge=1, description=(
        "--kv-peer-fetch: fetch only when a peer holds at least this many more prompt tokens "
        "than this worker's cache"))

    # A simulated worker (worker/sim/): the real worker with the model's forward pass replaced
    # by a cost model (docs/OPERATIONS.md, "A simulated fleet")
    sim_workers: int = Field(0, ge=0, json_schema_extra={"default_text": "0 (real workers)"},
                             description=(
        "simulated workers: `kvfleet up` starts this many (in processes of at most 32, beside "
        "--workers real ones, which then default to 0); `kvfleet worker` runs this many in its "
        "process (1 when --sim-device or --sim-step-cost is given). A simulated worker runs the "
        "real scheduler, KV block accounting, prefix cache, pace, protocol and metrics; its "
        "steps take the time the cost model gives, its tokens come from the request"))
    sim_device: str = Field("", json_schema_extra={"default_text": "none"}, description=(
        "the accelerator a simulated worker models (`h100`, `h200`, `a100`, `l40s`): its steps "
        "cost the roofline of the model's shape on it (--tensor-parallel-size devices), its KV "
        "pool is the device memory (× --gpu-memory-utilization) the weights leave"))
    sim_step_cost: str = Field("", json_schema_extra={"default_text": "none"}, description=(
        "a measured step cost instead of --sim-device: a file with the pace fit's JSON (a live "
        "worker's heartbeat field `step_cost`, `kvfleet plan --step-cost`'s input) or "
        "`worker:<id>` to read it from that worker's heartbeat; the KV pool is --kv-memory"))
    sim_time_scale: float = Field(1.0, gt=0, description=(
        "every modelled duration runs this many times longer (and the pace's targets with "
        "them), for hosts that cannot keep up; divide measured latencies by it. A worker counts "
        "steps that ended late (`kvfleet_sim_lagged_steps_total`); over 5% makes a run invalid"))
    sim_answer_tokens: str = Field("max", description=(
        "a simulated answer's length unless the request ignores EOS: `max` (its max_tokens), "
        "`fixed:N`, `uniform:A-B` or `exp:MEAN`, drawn per request from --sim-seed"))
    sim_seed: int = Field(0, description=(
        "seed of simulated tokens and answer lengths: workers with the same one answer alike"))

    @property
    def simulated(self) -> bool:
        return bool(self.sim_workers or self.sim_device or self.sim_step_cost)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: these settings' engine fields, as they are."""
        names = EngineConfig.__pydantic_fields__.keys() - set(ENGINE_ONLY)
        return EngineConfig(**self.model_dump(include=names))

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class BatchSettings(BatchApiSettings):
    """`kvfleet batch-worker` and the rq jobs it runs (a job reads them from the environment)."""

    gateway_url: str = Field("http://127.0.0.1:8000", description=(
        "where batch jobs send their lines (`kvfleet up`: its gateway)"))
    batch_api_key: str = Field("", json_schema_extra={"default_text": "none"}, description=(
        "sent as `Authorization: Bearer` when the gateway requires API keys"))
    batch_max_in_flight: int = Field(32, ge=1, description=(
        "lines of one batch being generated at once"))
    batch_line_retries: int = Field(5, ge=0, description=(
        "5xx answers or connection errors before a line fails"))
    batch_request_timeout_s: float = Field(600.0, gt=0, description="one line's HTTP request")
    batch_lease_ttl_s: float = Field(10.0, gt=0, description=(
        "a job silent this long has died; its batch is requeued"))
    batch_poll_s: float = Field(0.5, gt=0, description=(
        "how often a job checks for a cancel or a lost lease"))
    batch_max_attempts: int = Field(5, ge=1, description="job runs of one batch before it fails")


CpuProducts = Literal["auto", "onednn", "kvfleet"]
CpuBf16Product = Literal["auto", "dot", "fma", "amx"]


class KernelSettings(BaseSettings):
    """The CPU kernels' variables: environment only, read where a kernel is built or chosen."""

    model_config = SettingsConfigDict(env_prefix="KVFLEET_", extra="ignore", env_ignore_empty=True)

    cpu_products: CpuProducts = Field("auto", description=(
        "what computes a CPU model's linears: `auto` (kvfleet's own product, "
        "worker/engine/kernels/cpu_matmul.cpp, on CPUs with AVX-512 and no AMX: float32, and bf16 with "
        "AVX512-BF16; otherwise oneDNN over weights packed once, float32 everywhere and bf16 with "
        "native bf16), `onednn`, `kvfleet` (the own product wherever it builds, AMX CPUs "
        "included); the start-up log names the choice; another value, or `kvfleet` where the "
        "product cannot build, stops the engine at start-up with an error naming the variable"))
    cpu_bf16_product: CpuBf16Product = Field("auto", description=(
        "how kvfleet's own bf16 product sums (worker/engine/kernels/cpu_matmul.cpp, cpu_amx.cpp): `dot` "
        "(AVX512-BF16's vdpbf16ps, two columns per instruction), `fma` (the bf16 weights widened "
        "to fp32 and summed with fp32 FMAs, one column each), `amx` (AMX tiles: tdpbf16ps over "
        "weights packed once in tile layout; where the CPU has AMX-BF16 and Linux grants the "
        "tile state, else an error at start-up naming the variable), `auto` (by the CPU, never "
        "by a timing: `amx` where it has AMX-BF16 tiles, else `fma` on Intel CPUs, where "
        "vdpbf16ps issues at half the FMA rate, `dot` elsewhere); the "
        "start-up log names the form. Answers differ between the forms by bf16 rounding: workers "
        "that resume each other's streams bit for bit must sum alike (every process of one "
        "machine kind chooses alike; the numerics fingerprint tells)"))
    kernel_cache: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "kvfleet" / "kernels",
        json_schema_extra={"default_text": "`~/.cache/kvfleet/kernels`"}, description=(
            "where the C++ CPU kernels are built (once per source, compiler and CPU)"))
    kernel_sanitize: Literal["address"] | None = Field(None, description=(
        "`address` builds the C++ CPU kernels with AddressSanitizer (`-O1 -g "
        "-fsanitize=address`, their own cache names), for the sanitizer test; needs libasan "
        "preloaded in the process that loads them"))

    @field_validator("cpu_products", "cpu_bf16_product", mode="before")
    @classmethod
    def _name_the_variable(cls, value: str, info: ValidationInfo) -> str:
        # the Literal's own message would not name the variable
        choices = get_args(cls.model_fields[info.field_name].annotation)
        if value not in choices:
            raise ValueError(f"KVFLEET_{info.field_name.upper()}={value!r}: expected one of "
                             f"{', '.join(choices)}")
        return value
