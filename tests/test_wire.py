"""The wire contract without Redis: codecs, records, key names, and each Lua script's use of
KEYS and ARGV against its documented calling convention."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from redis.crc import key_slot

from kvfleet.shared.redis_cluster import slot_range
from kvfleet.shared.wire import (
    DeadLetterEntry,
    GenerationRequest,
    Heartbeat,
    Keys,
    LuaScript,
    QueueEntry,
    RequestRecord,
    RequestStatus,
    SamplingParams,
    TokenEvent,
    Usage,
    batch_scripts,
    decode_checkpoint,
    encode_checkpoint,
    scripts,
)
from kvfleet.shared.wire.keys import NUM_SLOTS, shard_of_slot
from kvfleet.shared.wire.scripts import home_shards

ALL_SCRIPTS = [value for module in (scripts, batch_scripts) for value in vars(module).values()
               if isinstance(value, LuaScript)]


def make_request(prompt=(1, 2, 3)) -> GenerationRequest:
    return GenerationRequest("r-1", "m", list(prompt), SamplingParams(max_tokens=4, seed=7))


def test_checkpoint_is_little_endian_uint32_whatever_the_host():
    assert encode_checkpoint([1, 256, 2**32 - 1]) == bytes.fromhex("01000000" "00010000" "ffffffff")
    assert decode_checkpoint(bytes.fromhex("01000000" "00010000")) == [1, 256]


def test_checkpoint_appends_concatenate_and_a_torn_tail_is_ignored():
    assert decode_checkpoint(encode_checkpoint([1, 2]) + encode_checkpoint([3])) == [1, 2, 3]
    assert decode_checkpoint(encode_checkpoint([7, 8]) + b"\x01\x02") == [7, 8]
    assert decode_checkpoint(None) == [] and decode_checkpoint(b"") == []


def test_queue_entry_carries_the_prompt_length_beside_the_payload():
    request = make_request(prompt=range(11))
    fields = QueueEntry(request).encode()
    assert fields[QueueEntry.PROMPT_LEN] == 11
    stored = {k.encode(): str(v).encode() if isinstance(v, int) else
              (v.encode() if isinstance(v, str) else v) for k, v in fields.items()}
    assert QueueEntry.decode(stored).request == request
    with pytest.raises(ValueError, match="payload"):
        QueueEntry.decode({b"id": b"x"})


def test_request_record_snapshot():
    request = make_request()
    record = RequestRecord.decode_snapshot(request.pack(), b"running", b"3")
    assert (record.request, record.status, record.attempt) == (request, RequestStatus.RUNNING, 3)
    unknown = RequestRecord.decode_snapshot(request.pack(), b"from_the_future", None)
    assert (unknown.status, unknown.attempt) == (RequestStatus.QUEUED, 0)
    assert RequestRecord.decode_snapshot(None, None, None) is None
    encoded = RequestRecord(request, attempt=2, status=RequestStatus.RUNNING, worker="w").encode()
    assert encoded == {"payload": request.pack(), "attempt": 2, "status": "running", "worker": "w"}


@pytest.mark.parametrize("stop_reason, text_after", [("\n\nUser:", 3), (7, 0), (None, 0)])
def test_a_final_events_stop_round_trips(stop_reason, text_after):
    event = TokenEvent(seq=4, attempt=1, token_ids=[9], finish_reason="stop",
                       usage=Usage(3, 5), stop_reason=stop_reason, text_after_stop=text_after)
    back = TokenEvent.unpack(event.pack("r-1"))
    assert (back.stop_reason, back.text_after_stop) == (stop_reason, text_after)
    assert type(back.stop_reason) is type(stop_reason)  # a token id stays an int


def test_an_older_workers_final_event_has_no_stop_fields():
    """The compatibility rule's case: the gateway tells it apart by `text_after_stop` None."""
    old = {"seq": 4, "attempt": 1, "token_ids": [9], "finish_reason": "stop", "req_id": "r-1"}
    event = TokenEvent.from_dict(old)
    assert event.stop_reason is None and event.text_after_stop is None
    # and a plain event packs neither (no bytes added to every token event)
    assert b"stop" not in TokenEvent(seq=0, attempt=0, token_ids=[1]).pack()


def test_dead_letter_entry_round_trips():
    entry = DeadLetterEntry(make_request(), "boom", "w1")
    raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in entry.encode().items()}
    assert DeadLetterEntry.decode(raw) == entry


def test_heartbeat_round_trips_and_survives_a_bad_writer():
    beat = Heartbeat(model="m", ts=12.5, blocks_total=200, blocks_free=50, running=3,
                     tokens_per_s=41.25, metrics_url="http://w:9100/metrics")
    raw = {k.encode(): str(v).encode() for k, v in beat.encode().items()}
    assert Heartbeat.decode(raw) == beat
    assert beat.blocks_used == 150
    assert "metrics_url" not in Heartbeat(model="m", ts=1.0).encode()
    odd = Heartbeat.decode({b"model": b"m", b"running": b"lots", b"waiting": b"inf",
                            b"tokens_per_s": b"", b"blocks_free": b"7.0", b"extra": b"1"})
    assert (odd.model, odd.running, odd.waiting, odd.tokens_per_s, odd.blocks_free) == \
        ("m", 0, 0, 0.0, 7)
    assert Heartbeat.decode({}) == Heartbeat(model="", ts=0.0)


def test_every_finish_reason_maps_back_to_its_status():
    finished = [s for s in RequestStatus if s.is_finished]
    assert {RequestStatus.for_finish_reason(s.finish_reason) for s in finished} == set(finished)
    with pytest.raises(KeyError):
        RequestStatus.for_finish_reason("tool_calls")


def test_keys():
    keys = Keys("p:")
    assert keys.queues("m") == [keys.queue("m"), keys.queue("m", "batch")] == ["p:{m}:q", "p:{m}:q:batch"]
    assert keys.all_queues("m") == keys.queues("m")
    assert keys.worker_id(keys.worker("gpu-1")) == "gpu-1"
    assert keys.checkpoint("r").startswith(keys.request("r"))


def test_a_requests_keys_share_one_cluster_slot():
    keys = Keys("p:")
    for req_id in ("r-1", "cmpl-0f3a", "x"):
        slots = {key_slot(k.encode()) for k in (keys.request(req_id), keys.checkpoint(req_id),
                                                keys.enqueued(req_id), keys.tokens(req_id))}
        assert len(slots) == 1
    assert key_slot(keys.request("a").encode()) != key_slot(keys.request("b").encode())


def test_stream_shards_fall_in_equal_slot_ranges_one_per_primary():
    keys = Keys("p:", queue_shards=3)
    assert len(keys.all_queues("m")) == 6
    for shard in range(3):
        priority_slots = {key_slot(q.encode()) for q in keys.queues("m", shard)}
        assert len(priority_slots) == 1  # the admission script reads them together
        low, high = slot_range(shard, 3)
        assert low <= priority_slots.pop() <= high
    picked = Counter(keys.shard_of(f"req-{i}") for i in range(3000))
    assert set(picked) == {0, 1, 2} and min(picked.values()) > 900
    assert keys.shard_of("req-7") == keys.shard_of("req-7")
    for shards in (2, 3, 5):  # every slot maps to the shard whose range holds it
        for slot in range(NUM_SLOTS):
            low, high = slot_range(shard_of_slot(slot, shards), shards)
            assert low <= slot <= high
    for i in range(300):  # a request's own keys lie in its shard's range (its primary)
        req_id = f"req-{i}"
        low, high = slot_range(keys.shard_of(req_id), 3)
        for key in (keys.request(req_id), keys.checkpoint(req_id), keys.tokens(req_id)):
            assert low <= key_slot(key.encode()) <= high
    with pytest.raises(ValueError):
        Keys(queue_shards=0)


def indices(source: str, table: str) -> set[int]:
    """The indices of `table` (KEYS or ARGV) a script reads: literal ones, and those of a
    `for i = a, b do` loop that reads `table[i]`."""
    found = {int(i) for i in re.findall(rf"{table}\[(\d+)\]", source)}
    if f"{table}[i]" in source:
        for low, high in re.findall(r"for i = (\d+), (\d+) do", source):
            found |= set(range(int(low), int(high) + 1))
    return found


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda s: s.name)
def test_a_script_uses_exactly_the_keys_and_args_it_documents(script):
    """Every KEYS[i] / ARGV[i] in the source is documented, and every documented one is used."""
    used_keys, used_args = indices(script.source, "KEYS"), indices(script.source, "ARGV")
    if script.variadic_keys:
        assert "ipairs(KEYS)" in script.source and not used_keys
    else:
        assert used_keys == set(range(1, len(script.keys) + 1))
    documented = set(range(1, len(script.argv) + (0 if script.variadic_argv else 1)))
    if script.variadic_argv:  # the trailing arguments are read by a loop from the last index on
        assert re.search(rf"for i = {len(script.argv)}, #ARGV(, \d+)? do", script.source)
    assert used_args == documented
    assert "${" not in script.source  # every field name was filled in


def test_script_names_are_unique():
    assert len({s.name for s in ALL_SCRIPTS}) == len(ALL_SCRIPTS)


def test_a_call_that_does_not_match_the_convention_is_refused():
    with pytest.raises(ValueError, match="keys"):
        scripts.START_ATTEMPT.bind(["only-one"], ["w", "running"])
    with pytest.raises(ValueError, match="args"):
        scripts.START_ATTEMPT.bind(["a", "b"], ["w"])
    with pytest.raises(ValueError, match="keys"):
        scripts.READ_IF_FITS.bind([], ["g", "c", 10, 1])
    with pytest.raises(ValueError, match="args"):
        batch_scripts.TRANSITION.bind(["b"], ["completed", 1])  # no allowed status
    call = scripts.enqueue(Keys(), make_request(), ttl_s=60)
    assert call.keys == [Keys().enqueued("r-1"), Keys().request("r-1")]
    stream, fields = scripts.queue_entry(Keys(queue_shards=4), make_request())
    assert stream == Keys(queue_shards=4).queue("m", "interactive", Keys(queue_shards=4).shard_of("r-1"))
    assert fields[QueueEntry.PROMPT_LEN] == 3


@pytest.mark.parametrize("workers, shards", [(1, 3), (2, 3), (3, 3), (5, 3), (7, 3), (4, 8)])
def test_home_shards_give_every_shard_a_worker_and_spread_workers_evenly(workers, shards):
    homes = [home_shards(i, workers, shards) for i in range(workers)]
    per_shard = Counter(s for h in homes for s in h)
    assert set(per_shard) == set(range(shards))  # every shard has a home worker
    assert max(per_shard.values()) - min(per_shard.values()) <= 1
    assert max(map(len, homes)) - min(map(len, homes)) <= 1
    assert home_shards(-1, workers, shards) == tuple(range(shards))  # not placed yet: all
    assert home_shards(0, workers, 1) == (0,)
