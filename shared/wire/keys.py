"""Every Redis key kvfleet uses, built in one place under one configurable prefix.

Redis Cluster (docs/ARCHITECTURE.md, "Redis Cluster"): a script's KEYS must share a slot; a key's
slot is the CRC16 of its hash tag (the part inside `{...}`). So:
- a request's hash, checkpoint, enqueue marker and token channel carry the tag `{req_id}`: every
  per-request script is single-slot, and requests spread over the cluster by id;
- a model's request streams are split into `queue_shards` shards; the streams of one shard (one
  per priority) carry one tag, `{model#n}`, chosen so that shard s of S falls in the s-th of S
  equal slot ranges: with S primaries owning equal ranges (as `redis-cli --cluster create` and
  shared/redis_cluster.py split them) each primary holds one shard. A request goes to the shard
  whose range holds its own slot (`shard_of`), so its keys and its stream entry share a primary;
  every worker reads every shard.
The same names serve a single Redis, where tags are only part of the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from redis.crc import key_slot

NUM_SLOTS = 16384

PRIORITIES = ("interactive", "batch")  # served in this order


@dataclass(frozen=True)
class Keys:
    """Key names of the fleet protocol (docs/ARCHITECTURE.md, "Keys")."""

    prefix: str = "kvf:"
    group: str = "workers"  # consumer group on every request stream
    queue_shards: int = 1  # stream shards per model; gateways and workers must agree

    def __post_init__(self) -> None:
        if self.queue_shards < 1:
            raise ValueError("queue_shards must be at least 1")

    # A model's request streams.

    def _model(self, model: str) -> str:
        return f"{self.prefix}{model}"

    def queue(self, model: str, priority: str = "interactive", shard: int = 0) -> str:
        """Stream of requests for `model` in one shard (entries: QueueEntry)."""
        name = f"{self.prefix}{{{shard_tag(model, shard, self.queue_shards)}}}:q"
        return name if priority == "interactive" else f"{name}:{priority}"

    def queues(self, model: str, shard: int = 0) -> list[str]:
        """One shard's request streams in the order workers serve them (PRIORITIES): one slot,
        so the admission script reads them together."""
        return [self.queue(model, priority, shard) for priority in PRIORITIES]

    def all_queues(self, model: str) -> list[str]:
        """Every request stream of the model, shard by shard."""
        return [q for shard in range(self.queue_shards) for q in self.queues(model, shard)]

    def shard_of(self, req_id: str) -> int:
        """The stream shard a request is enqueued on, by its id (stable across retries): the
        shard whose range of slots holds the request's own slot (`{req_id}`). The request's
        keys then live on the primary that holds its stream shard, so a worker's admission of
        one shard's entries (READ_IF_FITS, then their START_ATTEMPTs) talks to one node, and a
        step's events of those requests go to that node too. Ids are random, so the shards
        fill evenly."""
        return shard_of_slot(key_slot(req_id.encode()), self.queue_shards)

    def roster(self, model: str) -> str:
        """Sorted set: the model's live workers, scored by when they joined (ROSTER): a worker's
        rank there picks its home stream shards."""
        return f"{self.prefix}{{{model}}}:roster"

    def roster_seen(self, model: str) -> str:
        """Sorted set: the same workers scored by when each was last seen (same slot)."""
        return f"{self.prefix}{{{model}}}:roster:seen"

    def gateway_roster(self) -> str:
        """Sorted set: the live gateways, scored by when they joined (ROSTER): a gateway's rank
        there picks the stream shards its new requests go to (`gateway_shard_shares`)."""
        return f"{self.prefix}{{gateways}}:roster"

    def gateway_roster_seen(self) -> str:
        """Sorted set: the same gateways scored by when each was last seen (same slot)."""
        return f"{self.prefix}{{gateways}}:roster:seen"

    # Prefix-affinity routing (docs/ARCHITECTURE.md, "Prefix-affinity routing"): a model's
    # block announcements share the model's tag (one slot: ANNOUNCE_BLOCKS, PREFIX_SNAPSHOT and
    # PREFIX_MATCH touch them together); each worker's own request streams have a tag of their
    # own, so on a cluster they spread over the primaries.

    def kv_blocks(self, model: str, worker_id: str) -> str:
        """Set: the announce ids (shared/wire/prefix_hash.py) of the blocks in one worker's
        prefix cache. Expires with the worker's announcements (heartbeat TTL)."""
        return f"{self.prefix}{{{model}}}:kv:{worker_id}"

    def kv_host_blocks(self, model: str, worker_id: str) -> str:
        """Set: of `kv_blocks`, the announce ids of the blocks held only in the worker's host
        tier (`--kv-offloading-size`), not on its device. Expires with `kv_blocks`."""
        return f"{self.prefix}{{{model}}}:kvhost:{worker_id}"

    def kv_workers(self, model: str) -> str:
        """Sorted set: the workers announcing blocks for `model`, scored by the time (ms) of
        their last announcement; those older than the heartbeat TTL are dropped."""
        return f"{self.prefix}{{{model}}}:kv:workers"

    def kv_events(self, model: str) -> str:
        """Stream of KvEvent: the block announcements of every worker of `model`, in order (the
        gateways' in-memory index follows it)."""
        return f"{self.prefix}{{{model}}}:kv:events"

    def timelines(self, model: str) -> str:
        """Stream of `RequestTimeline` (shared/wire/timeline.py): where each finished request's
        time went on its worker, capped at `--timelines-kept` entries."""
        return f"{self.prefix}{{{model}}}:timelines"

    def worker_queue(self, model: str, worker_id: str, priority: str = "interactive") -> str:
        """A worker's own request stream (entries: QueueEntry): requests routed to it for its
        prefix cache; it reads them first, any other worker after a bounded wait."""
        name = f"{self.prefix}{{{model}@{worker_id}}}:q"
        return name if priority == "interactive" else f"{name}:{priority}"

    def worker_queues(self, model: str, worker_id: str) -> list[str]:
        """A worker's own streams in the order they are served (one slot, as `queues`)."""
        return [self.worker_queue(model, worker_id, priority) for priority in PRIORITIES]

    def worker_queue_owners(self, model: str) -> str:
        """Set: the workers of `model` that have own streams (created at a worker's start; a
        member is removed once its worker is gone and its streams hold nothing pending)."""
        return f"{self.prefix}{{{model}}}:wq"

    def dead_letter(self, model: str) -> str:
        """Stream of requests delivered too many times (entries: DeadLetterEntry)."""
        return f"{self._model(model)}:dlq"

    # One request's keys: one hash tag, one slot.

    def _request(self, req_id: str) -> str:
        return f"{self.prefix}req:{{{req_id}}}"

    def request(self, req_id: str) -> str:
        """Hash: RequestRecord (payload, attempt = the fencing token, status, worker)."""
        return self._request(req_id)

    def checkpoint(self, req_id: str) -> str:
        """String of the token ids generated so far (shared/wire/checkpoint.py)."""
        return f"{self._request(req_id)}:ckpt"

    def enqueued(self, req_id: str) -> str:
        """Marker that makes enqueue idempotent by request id."""
        return f"{self.prefix}enq:{{{req_id}}}"

    def tokens(self, req_id: str) -> str:
        """A request's own pub/sub channel of token events (TokenEvent), in the request's slot
        (sharded pub/sub on a cluster): its events go here when it names no inbox, and also
        once a reader attached to it by id (RequestRecord.WATCHED)."""
        return f"{self.prefix}tok:{{{req_id}}}"

    def inbox(self, gateway_id: str, part: int = 0) -> str:
        """Pub/sub channel of one gateway's token events (GenerationRequest.reply_to): a worker's
        step sends it one message with the events of every request it enqueued there. On a
        cluster a gateway keeps one per primary, `part` chosen so that the channel's slot
        (`{gateway_id#part}`) lies on that primary: the requests whose keys live there name it,
        and a step's events for them travel to one node in one message."""
        return f"{self.prefix}inbox:{{{gateway_id}#{part}}}"

    def cancel(self) -> str:
        """Pub/sub channel of request ids whose client went away (sharded pub/sub on a cluster:
        one node carries it, every worker subscribes there)."""
        return f"{self.prefix}cancel"

    def worker(self, worker_id: str) -> str:
        """Heartbeat hash of one worker (Heartbeat), with a TTL."""
        return f"{self.prefix}worker:{worker_id}"

    def worker_pattern(self) -> str:
        """SCAN pattern of every heartbeat key."""
        return self.worker("*")

    def worker_id(self, heartbeat_key: str) -> str:
        """The worker id of a heartbeat key (the inverse of `worker`)."""
        return heartbeat_key.removeprefix(self.worker(""))

    def drain(self, worker_id: str) -> str:
        """String, with a TTL: set (by the gateway's admin route) to ask one worker to drain:
        stop taking work, hand its running streams to peers, finish the rest, exit."""
        return f"{self.prefix}drain:{worker_id}"  # not under `worker:*`: that scans heartbeats

    def handoff_offers(self, model: str) -> str:
        """Hash: the model's KV handoff offers, handoff id -> HandoffOffer (msgpack): running
        streams a worker (draining, or a prefill worker) offers to workers with room. A taker
        removes the field it takes (TAKE_OFFER), so one offer goes to one taker."""
        return f"{self.prefix}{{{model}}}:handoffs"

    def handoff_lease(self, req_id: str) -> str:
        """String with a TTL (`{req_id}` tag: one slot with the request's hash and checkpoint):
        `sent:<handoff id>` while the source holds a handed-off stream's KV for its taker,
        `taken:<handoff id>:<taker>` once the taker fenced it (START_HANDOFF). Gone: the lease
        expired or the source took the stream back (RECLAIM_HANDOFF)."""
        return f"{self._request(req_id)}:handoff"

    def loras(self) -> str:
        """Hash: the fleet's LoRA adapters, name -> LoraRecord as JSON (shared/lora.py). Adapter
        names share the `model` namespace with the served models."""
        return f"{self.prefix}loras"

    def api_keys(self) -> str:
        """Hash of API keys: SHA-256 hex of the key -> ApiKeyRecord as JSON. Plaintext keys are
        never stored."""
        return f"{self.prefix}apikeys"

    def rate_limit(self, key_id: str, kind: str) -> str:
        """GCRA state (theoretical arrival time, ms) of one API key; `kind` is `req` or `tok`.
        The `{key_id}` hash tag keeps a key's two limits in one Redis Cluster slot."""
        return f"{self.prefix}rl:{{{key_id}}}:{kind}"

    # Batch API (gateway/openai/batches.py, batch/): uploaded files, batch records and results.
    # A batch's keys share the tag `{batch_id}` (its scripts are single-slot), a file's `{file_id}`.

    def file(self, file_id: str) -> str:
        """Hash: FileRecord (OpenAI's file object) of an uploaded or generated file."""
        return f"{self.prefix}file:{{{file_id}}}"

    def file_content(self, file_id: str) -> str:
        """String: the file's bytes (JSONL)."""
        return f"{self.prefix}file:{{{file_id}}}:content"

    def batch(self, batch_id: str) -> str:
        """Hash: BatchRecord (status, request counts, output file ids)."""
        return f"{self.prefix}batch:{{{batch_id}}}"

    def batch_results(self, batch_id: str) -> str:
        """Hash: line index -> that line's output (JSON), each written once (HSETNX)."""
        return f"{self.prefix}batch:{{{batch_id}}}:results"

    def batch_lease(self, batch_id: str) -> str:
        """String with a TTL: the token of the one job feeding the batch now."""
        return f"{self.prefix}batch:{{{batch_id}}}:lease"

    def batches_active(self) -> str:
        """Set of batch ids not yet in a final state (what the batch workers watch over)."""
        return f"{self.prefix}batches:active"

    def batch_queue(self) -> str:
        """Name of the rq queue of batch jobs (rq keeps it under its own `rq:` keys, on the
        batch queue's Redis: `--batch-redis-url`, a single Redis, when the fleet's is a cluster)."""
        return f"{self.prefix}batch"

    def batch_reaper(self) -> str:
        """Short lock: one batch worker at a time looks for batches whose job died."""
        return f"{self.prefix}batches:reaper"

    def batches_by_time(self) -> str:
        """Sorted set: batch id -> creation time (GET /v1/batches lists it, newest first)."""
        return f"{self.prefix}batches:by-time"


def shard_of_slot(slot: int, num_shards: int) -> int:
    """The shard s whose range of slots, [s * NUM_SLOTS // S, (s + 1) * NUM_SLOTS // S), holds
    `slot`: the ranges `shard_tag` and a cluster of S primaries with equal ranges use."""
    return ((slot + 1) * num_shards - 1) // NUM_SLOTS


@lru_cache(maxsize=4096)
def shard_tag(model: str, shard: int, num_shards: int) -> str:
    """The hash tag of one stream shard: the model name alone for a single shard; else
    `model#n` with the smallest n whose slot lies in the shard's range of slots (the s-th of
    `num_shards` equal ranges)."""
    if num_shards == 1:
        return model
    low = shard * NUM_SLOTS // num_shards
    high = (shard + 1) * NUM_SLOTS // num_shards
    n = 0
    while not low <= key_slot(f"{model}#{n}".encode()) < high:
        n += 1
    return f"{model}#{n}"
