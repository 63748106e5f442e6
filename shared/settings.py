"""Settings of the gateway, the worker and the batch worker: defaults, overridden by KVFLEET_*
environment variables, overridden by command-line flags (the CLI passes flags as constructor
keywords)."""

from __future__ import annotations

import os
import re
import socket
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.models import DEFAULT_MODEL, default_cache_dir
from shared.wire.keys import Keys

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
               "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; plain integers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 2GiB, 512MB or a number of bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVFLEET_", extra="ignore",
                                      protected_namespaces=())

    redis_url: str | None = None  # None: `kvfleet up` starts an embedded Redis
    model: str = DEFAULT_MODEL
    key_prefix: str = "kvf:"
    # Stream shards per model (Keys.queue_shards): 1 on a single Redis; on a cluster about one
    # per primary. Gateways and workers of one fleet must use the same number.
    queue_shards: int = Field(1, ge=1)
    cache_dir: Path = default_cache_dir()  # where the default model is converted to safetensors
    log_level: str = "INFO"

    def keys(self) -> Keys:
        """The fleet's key names (prefix and stream shards)."""
        return Keys(self.key_prefix, queue_shards=self.queue_shards)


class BatchApiSettings(CommonSettings):
    """What the batch API's routes (gateway) and its jobs (batch worker) both need to agree on."""

    batch_max_file_bytes: int = Field(100 * 1024**2, ge=1)  # an upload larger than this is a 413
    batch_max_lines: int = Field(50_000, ge=1)  # OpenAI's limit per batch file
    batch_ttl_s: int = Field(7 * 24 * 3600, ge=60)  # files and batch records expire after this
    # rq's job queue needs a single Redis (rq does not speak cluster): on a Redis Cluster, name a
    # small separate one here. None: the fleet's --redis-url. Batch records stay on the fleet's.
    batch_redis_url: str | None = None


class GatewaySettings(BatchApiSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_s: float = 600.0  # deadline carried in the stream entry
    first_event_timeout_s: float = 600.0  # no event at all for this long -> error to the client
    # A stream whose pub/sub connection broke (Redis restarted, a cluster primary failed over)
    # subscribes again for this long, then goes on with the missed tokens read from the
    # checkpoint; past it the client gets a retryable 503 error. 0: that error at once.
    stream_reconnect_s: float = Field(15.0, ge=0)
    # With several stream shards (a cluster): each gateway sends its new requests to its shares
    # of the shards, by its place among the live gateways (gateway/fleet/homes.py), so that it
    # talks to as few primaries as balance allows. Balance then follows the gateways' loads (the
    # load balancer's spread); off: every request to a shard its random id picks.
    gateway_shard_shares: bool = True
    # Token events come back in this gateway's inboxes (gateway/fleet/inboxes.py): one message per
    # worker step with the events of all its requests there, one subscription per inbox. Off:
    # each request's own channel, subscribed per request (for a rolling upgrade from workers
    # older than inboxes, which publish there only).
    gateway_inboxes: bool = True
    max_body_bytes: int = 1_000_000
    # max_tokens of a request that gives none; None = the rest of the context (as vLLM)
    default_max_tokens: int | None = None
    # Tool calls: the model's call format (auto = from its chat template; see gateway/tools/).
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    # Reasoning: split <think>...</think> into reasoning_content (auto = when the vocabulary has
    # both tags as tokens).
    reasoning_parser: Literal["auto", "think", "none"] = "auto"
    # Temperature of requests that give none. None: the model's generation config decides, as in
    # transformers' generate() (greedy unless it sets do_sample) — sensible answers from small
    # models; set 1.0 for OpenAI's default.
    default_temperature: float | None = None
    stream_maxlen: int = 100_000  # cap of each request stream
    # Backpressure: refuse (429 + Retry-After) when the queue's expected wait is too long.
    max_queue_wait_s: float = 60.0  # expected wait limit; 0 = off (the depth limit still holds)
    max_queue_depth: int = 1000  # undelivered requests of the model; 0 = no limit
    queue_tokens_per_request: int = 256  # work assumed per queued request, output tokens
    min_fleet_tokens_per_s: float = 200.0  # throughput floor while live workers report ~0
    queue_estimate_cache_s: float = 0.5  # one read of queue + heartbeats per period
    # API keys and per-key rate limits (0 = unlimited; a key's own limits override these).
    api_keys: str = ""  # comma-separated plaintext keys (KVFLEET_API_KEYS), besides Redis keys
    rate_limit_rpm: int = 0  # requests per minute per key
    rate_limit_tpm: int = 0  # tokens (prompt + max_tokens) per minute per key
    # The dashboard's charts: one sample of the fleet every dashboard_sample_s, kept this long.
    dashboard_history_s: float = 900.0
    dashboard_sample_s: float = 5.0

    @field_validator("dashboard_sample_s")
    @classmethod
    def _check_dashboard_sample(cls, value: float, info: ValidationInfo) -> float:
        history_s = info.data.get("dashboard_history_s", 900.0)
        if not 0 < value <= history_s:
            raise ValueError(f"must be > 0 and at most dashboard_history_s ({history_s:g})")
        return value


class WorkerSettings(CommonSettings):
    worker_id: str = ""  # default: host-pid-random
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on CUDA and native-bf16 CPUs, else float32) | float32 | bfloat16 | float16
    kv_memory: str = "1GiB"  # KV budget on CPU
    # KV pool storage: auto = the model dtype; fp8 (e4m3) / int8 hold ~1.94x the tokens of bf16
    kv_dtype: Literal["auto", "bf16", "fp16", "fp32", "fp8", "int8"] = "auto"
    # When the pool runs out: swap a stream's KV to host memory, or drop it and recompute later;
    # auto picks per preemption by a cost model (bytes to move vs tokens to recompute).
    preemption: Literal["auto", "swap", "recompute"] = "auto"
    swap_space: str = "4GiB"  # host memory for swapped-out KV
    gpu_memory_utilization: float = 0.9  # on CUDA: share of the card's total memory this worker uses
    # attention: auto = the Triton paged kernel on CUDA, gather + SDPA on CPU
    attention_backend: Literal["auto", "sdpa", "cpu", "triton"] = "auto"
    # decode steps from CUDA graphs at batch-size buckets (auto: on CUDA with the triton backend);
    # eager runs their static buffers without capturing (debugging)
    cuda_graphs: Literal["auto", "off", "eager"] = "auto"
    grammar_cache_size: int = 256  # compiled output constraints (structured outputs) kept, LRU
    # ranks (processes, one device each: cuda:0..N-1, or CPU with gloo) the model is split over;
    # kv_memory, swap_space and gpu_memory_utilization are per rank
    tensor_parallel_size: int = Field(default=1, ge=1)
    block_size: int | None = Field(default=None, ge=1)  # None: 64 for bf16 K/V on the CPU kernel, else 16
    max_batched_tokens: int = 512
    max_running: int = 64
    enable_prefix_caching: bool = True
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    max_deliveries: int = 3
    read_block_ms: int = 200  # blocking XREADGROUP stays below redis-py's socket timeout
    # hold a request's new tokens until this long after its last event, then send them as one
    # event (fewer Redis events on fast accelerators; first and final events go out at once);
    # 0 = an event per request per step
    publish_interval_ms: float = Field(default=0.0, ge=0)
    result_ttl_s: int = 3600  # how long a finished request's hash and checkpoint are kept
    # with several stream shards: read the home shards of this worker's place among the live
    # workers first, the other shards only for entries that waited this long; 0 = every shard alike
    steal_after_ms: int = Field(default=50, ge=0)
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = the CPUs this process may use
    metrics_port: int = 0  # Prometheus /metrics of this worker: 0 = a free port, -1 = off
    metrics_host: str = "0.0.0.0"
    metrics_advertise_host: str = ""  # host put in the heartbeat's metrics_url; "" = hostname
    cost_per_hour: float | None = None  # $ per accelerator-hour, for cost per 1M output tokens

    @field_validator("kv_memory", "swap_space")
    @classmethod
    def _check_size(cls, value: str) -> str:
        parse_bytes(value)
        return value

    @property
    def kv_memory_bytes(self) -> int:
        return parse_bytes(self.kv_memory)

    @property
    def swap_space_bytes(self) -> int:
        return parse_bytes(self.swap_space)

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class BatchSettings(BatchApiSettings):
    """`kvfleet batch-worker` and the rq jobs it runs (a job reads them from the environment)."""

    gateway_url: str = "http://127.0.0.1:8000"  # where batch jobs send their lines
    batch_api_key: str = ""  # sent as `Authorization: Bearer` when the gateway requires keys
    batch_max_in_flight: int = Field(32, ge=1)  # lines of one batch being generated at once
    batch_line_retries: int = Field(5, ge=0)  # 5xx / connection errors before a line fails
    batch_request_timeout_s: float = Field(600.0, gt=0)  # one line's HTTP request
    batch_lease_ttl_s: float = Field(10.0, gt=0)  # a job silent this long has died
    batch_poll_s: float = Field(0.5, gt=0)  # how often a job checks for cancel / lost lease
    batch_max_attempts: int = Field(5, ge=1)  # job runs of one batch before it fails
