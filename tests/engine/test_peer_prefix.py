"""Prefix blocks copied between engines ("peer fetch", tiers/prefix_copies.py): a prefix one engine
computed, exported, sent as bytes and installed in another engine's prefix cache, gives there the
answers the peer would give, bit for bit (and in float32 HF's greedy tokens); export takes the
leading run held, in the pool or the host tier; install refuses another layout and malformed
copies without changing anything, stops where the cache holds a hash or has no room, and keeps
the prompt's own cached blocks."""

from __future__ import annotations

import pytest
import torch

from kvfleet.shared.wire.messages import pack
from kvfleet.shared.wire.prefix_hash import block_hashes
from kvfleet.worker.engine.core.handoff import HandoffError, pack_tensors
from kvfleet.worker.engine.memory.block_manager import DEVICE, HOST, BlockManager
from kvfleet.worker.engine.tiers.prefix_copies import PrefixState
from kvfleet.worker.handoff.peer_prefixes import PREFIX_ID, parse_prefix_id, prefix_id
from tests.engine.tiny_models import greedy, random_prompt

BS = 4
PREFIX = 32  # 8 blocks
NUM_PREFIX_BLOCKS = PREFIX // BS
CONFIGS = [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8")]


def serve(engine, req_id: str, prompt: list[int], n: int = 6):
    """One request run to completion alone: its tokens, logprobs and num_cached_tokens."""
    engine.add_request(req_id, prompt, greedy(n, logprobs=2))
    tokens, logprobs, cached = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs or []]
            cached = out.num_cached_tokens
    engine.block_manager.check_invariants()
    return tokens, logprobs, cached


def hashes_of(engine, tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, BS, engine.block_manager.root)


def over_the_wire(state: PrefixState) -> PrefixState:
    """The state encoded, its buffers joined as a socket would deliver them, decoded."""
    header, buffers = state.encode()
    return PrefixState.decode(header, b"".join(bytes(v) for v in buffers))


def same_blocks(a: PrefixState, b: PrefixState) -> bool:
    return (a.hashes == b.hashes and torch.equal(a.values, b.values)
            and (a.scales is None) == (b.scales is None)
            and (a.scales is None or torch.equal(a.scales, b.scales)))


def tier_gib(tiny, num_blocks: int, **config) -> float:
    return num_blocks * tiny.engine(num_blocks=4, **config).pool.block_bytes / (1 << 30)


# ---- 1. a prefix computed on one engine, answered from on another -----------------------------

@pytest.mark.parametrize("dtype,kv_dtype", CONFIGS)
def test_an_installed_prefix_gives_the_answers_of_the_peer_that_computed_it(tiny, dtype,
                                                                            kv_dtype):
    config = dict(dtype=dtype, kv_dtype=kv_dtype)
    prefix = random_prompt(PREFIX, seed=1)
    tail_a, tail_b = random_prompt(5, seed=2), random_prompt(5, seed=3)
    holder = tiny.engine(**config)
    serve(holder, "a", prefix + tail_a)
    hashes = hashes_of(holder, prefix)
    assert holder.prefixes.gap() is None
    assert holder.prefixes.num_held(hashes) == NUM_PREFIX_BLOCKS
    state = holder.prefixes.export(hashes)
    assert state is not None and state.hashes == hashes
    assert state.values.shape[3] == NUM_PREFIX_BLOCKS
    assert (state.scales is not None) == (kv_dtype == "int8")
    received = over_the_wire(state)
    assert same_blocks(received, state)
    assert received.layout == holder.prefixes.layout()  # the layout survives msgpack

    asker = tiny.engine(**config)
    assert asker.prefixes.install(received) == NUM_PREFIX_BLOCKS
    asker.block_manager.check_invariants()
    assert asker.prefixes.num_held(hashes) == NUM_PREFIX_BLOCKS
    assert asker.stats().prefix_peer_hit_tokens == 0  # installed, not yet taken
    fetched = serve(asker, "b", prefix + tail_b)
    stats = asker.stats()
    assert fetched[2] == PREFIX
    assert stats.prefix_peer_hit_tokens == stats.prefix_hit_tokens == PREFIX
    assert stats.prefix_host_hit_tokens == 0
    assert stats.num_prefill_tokens_computed == len(tail_b)

    # the peer answering from its own cache: the same bytes, the same answer, bit for bit
    at_the_peer = serve(holder, "b", prefix + tail_b)
    assert at_the_peer[2] == PREFIX
    assert fetched[:2] == at_the_peer[:2]
    # an engine computing everything itself (the negative control: nothing cached there)
    alone = serve(tiny.engine(**config), "b", prefix + tail_b)
    assert alone[2] == 0
    if kv_dtype == "auto":  # batch-invariant attention: a recomputed prefix gives them too
        assert fetched[:2] == alone[:2]
    if dtype == "float32" and kv_dtype == "auto":
        assert fetched[0] == tiny.reference(prefix + tail_b, 6)

    # the installed bytes are what the answer is made of: other bytes, another answer (each
    # vector's elements rotated; a permutation of whole blocks would not do: attention over
    # keys that carry their positions does not depend on where they are stored)
    garbled = PrefixState(received.layout, received.hashes, received.values.roll(1, -1),
                          received.scales)
    other = tiny.engine(**config)
    assert other.prefixes.install(garbled) == NUM_PREFIX_BLOCKS
    wrong = serve(other, "b", prefix + tail_b)
    assert wrong[2] == PREFIX and wrong[1] != fetched[1]

    # the installed blocks, taken and freed again, wait cached as any others
    bm = asker.block_manager
    assert bm.num_held_leading_blocks(hashes) == NUM_PREFIX_BLOCKS
    assert not bm._installed  # every installed block was taken by "b"
    bm.check_invariants()
    again = serve(asker, "c", prefix + tail_b)
    assert again[2] == PREFIX + BS  # its tail's full block too, now
    if kv_dtype == "auto":  # (an 8-bit pool's cached tail block reads its codes: not the same)
        assert again[:2] == fetched[:2]
    assert asker.stats().prefix_peer_hit_tokens == PREFIX  # a pool hit now, not a peer one


# ---- 2. export from the host tier -------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_prefix_evicted_to_the_host_tier_exports_the_same_bytes(tiny_llama, kv_dtype):
    config = dict(kv_dtype=kv_dtype)
    work = [random_prompt(PREFIX, seed=s) for s in range(4)]
    engine = tiny_llama.engine(num_blocks=24, kv_offloading_size=tier_gib(tiny_llama, 64, **config),
                               **config)
    no_tier = tiny_llama.engine(num_blocks=24, **config)
    hashes = hashes_of(engine, work[0])
    serve(engine, "first", work[0] + random_prompt(5, seed=100))
    serve(no_tier, "first", work[0] + random_prompt(5, seed=100))
    in_pool = engine.prefixes.export(hashes)
    assert in_pool is not None and in_pool.num_blocks == NUM_PREFIX_BLOCKS
    assert [engine.block_manager.locate(h)[0] for h in hashes] == [DEVICE] * NUM_PREFIX_BLOCKS

    for i, prefix in enumerate(work[1:], start=1):  # the other tenants push it out of the pool
        serve(engine, f"other{i}", prefix + random_prompt(5, seed=100 + i))
        serve(no_tier, f"other{i}", prefix + random_prompt(5, seed=100 + i))
    assert [engine.block_manager.locate(h)[0] for h in hashes] == [HOST] * NUM_PREFIX_BLOCKS
    assert engine.prefixes.num_held(hashes) == NUM_PREFIX_BLOCKS
    from_tier = engine.prefixes.export(hashes)
    assert from_tier is not None and same_blocks(from_tier, in_pool)
    # without the tier it is gone (the negative control)
    assert no_tier.prefixes.num_held(hashes) == 0 and no_tier.prefixes.export(hashes) is None

    # half of it brought back into the pool by a request: a copy from both places, in order
    serve(engine, "half", work[0][:PREFIX // 2] + random_prompt(5, seed=200))
    places = [engine.block_manager.locate(h)[0] for h in hashes]
    assert places == [DEVICE] * 4 + [HOST] * 4
    mixed = engine.prefixes.export(hashes)
    assert mixed is not None and same_blocks(mixed, in_pool)

    # and it answers on another engine as where it was computed
    asker = tiny_llama.engine(**config)
    assert asker.prefixes.install(over_the_wire(from_tier)) == NUM_PREFIX_BLOCKS
    tail = random_prompt(5, seed=300)
    fetched = serve(asker, "b", work[0] + tail)
    at_the_peer = serve(engine, "b", work[0] + tail)
    assert fetched[2] == at_the_peer[2] == PREFIX
    assert fetched[:2] == at_the_peer[:2]


# ---- 3. the leading run held --------------------------------------------------------------------

def test_export_takes_the_leading_run_held_and_nothing_when_the_first_is_missing(tiny_llama):
    engine = tiny_llama.engine()
    prefix = random_prompt(PREFIX, seed=1)
    serve(engine, "a", prefix + random_prompt(5, seed=2))
    hashes = hashes_of(engine, prefix)
    whole = engine.prefixes.export(hashes)
    unknown = hashes_of(engine, random_prompt(BS, seed=99))[0]
    asked = hashes[:3] + [unknown] + hashes[3:5]
    assert engine.prefixes.num_held(asked) == 3
    run = engine.prefixes.export(asked)
    assert run is not None and run.hashes == hashes[:3]
    assert torch.equal(run.values, whole.values[:, :, :, :3])
    assert engine.prefixes.export([unknown] + hashes) is None
    assert engine.prefixes.num_held([unknown] + hashes) == 0
    assert engine.prefixes.export([]) is None
    # a run that starts inside the chain (what a peer asks for past its own blocks)
    tail = engine.prefixes.export(hashes[5:])
    assert tail.hashes == hashes[5:] and torch.equal(tail.values, whole.values[:, :, :, 5:])


# ---- 4. another layout ------------------------------------------------------------------------

@pytest.mark.parametrize("other", [dict(dtype="bfloat16"), dict(block_size=8),
                                   dict(kv_dtype="int8")],
                         ids=["dtype", "block_size", "kv_dtype"])
def test_a_copy_of_another_layout_is_refused_and_changes_nothing(tiny_llama, other):
    holder = tiny_llama.engine()
    prefix = random_prompt(PREFIX, seed=1)
    serve(holder, "a", prefix + random_prompt(5, seed=2))
    state = over_the_wire(holder.prefixes.export(hashes_of(holder, prefix)))

    asker = tiny_llama.engine(**other)
    serve(asker, "x", random_prompt(20, seed=7))  # something cached before
    bm = asker.block_manager
    before = (bm.cached_hashes(), bm.num_free_blocks)
    with pytest.raises(HandoffError, match="another layout"):
        asker.prefixes.install(state)
    assert (bm.cached_hashes(), bm.num_free_blocks) == before
    assert asker.prefixes.num_installed_blocks == 0
    bm.check_invariants()
    # the same engine kind takes it (the control)
    same = tiny_llama.engine()
    assert same.prefixes.install(state) == NUM_PREFIX_BLOCKS


def test_a_copy_whose_tensors_do_not_match_its_layout_is_refused_and_changes_nothing(tiny_llama):
    holder = tiny_llama.engine()
    prefix = random_prompt(PREFIX, seed=1)
    serve(holder, "a", prefix + random_prompt(5, seed=2))
    state = holder.prefixes.export(hashes_of(holder, prefix))
    asker = tiny_llama.engine()
    bad = [PrefixState(state.layout, state.hashes, state.values.to(torch.bfloat16), None),
           PrefixState(state.layout, state.hashes[:7], state.values, None),
           PrefixState(state.layout, state.hashes, state.values,
                       torch.ones(state.values.shape[:-1]))]
    for copy in bad:
        with pytest.raises(HandoffError):
            asker.prefixes.install(copy)
        assert asker.block_manager.num_cached_blocks == 0
        assert asker.block_manager.num_free_blocks == asker.block_manager.num_blocks
    asker.block_manager.check_invariants()


# ---- 5. where install stops, and what it keeps --------------------------------------------------

def _prefix_state(tiny_llama, prefix: list[int]) -> tuple[list[bytes], PrefixState]:
    holder = tiny_llama.engine()
    serve(holder, "a", prefix + random_prompt(5, seed=2))
    hashes = hashes_of(holder, prefix)
    return hashes, over_the_wire(holder.prefixes.export(hashes))


def test_install_stops_at_a_hash_already_cached(tiny_llama):
    prefix = random_prompt(PREFIX, seed=1)
    hashes, state = _prefix_state(tiny_llama, prefix)
    asker = tiny_llama.engine()
    later = PrefixState(state.layout, hashes[5:], state.values[:, :, :, 5:].clone(), None)
    assert asker.prefixes.install(later) == 3
    assert asker.prefixes.num_held(hashes) == 0  # h0 missing: the chain is not usable yet
    middle = PrefixState(state.layout, hashes[2:], state.values[:, :, :, 2:].clone(), None)
    assert asker.prefixes.install(middle) == 3  # h2..h4, then h5 is cached
    assert asker.prefixes.install(state) == 2  # h0, h1
    assert asker.prefixes.install(state) == 0  # everything cached
    assert asker.prefixes.num_held(hashes) == NUM_PREFIX_BLOCKS
    asker.block_manager.check_invariants()
    tail = random_prompt(5, seed=3)
    assert serve(asker, "b", prefix + tail)[0] == tiny_llama.reference(prefix + tail, 6)
    assert asker.stats().prefix_peer_hit_tokens == PREFIX


def test_install_takes_nothing_when_no_block_is_free(tiny_llama):
    hashes, state = _prefix_state(tiny_llama, random_prompt(PREFIX, seed=1))
    asker = tiny_llama.engine(num_blocks=10)
    asker.add_request("busy", random_prompt(37, seed=5), greedy(3))
    asker.step()  # its prompt computed: it holds every block
    bm = asker.block_manager
    assert bm.num_free_blocks == 0
    assert asker.prefixes.install(state) == 0
    assert bm.num_cached_blocks == 9  # its own full blocks, nothing else
    bm.check_invariants()
    while asker.has_unfinished():
        asker.step()
    bm.check_invariants()


def test_install_stops_when_the_free_blocks_are_used_up(tiny_llama):
    hashes, state = _prefix_state(tiny_llama, random_prompt(PREFIX, seed=1))
    asker = tiny_llama.engine(num_blocks=14)
    asker.add_request("busy", random_prompt(37, seed=5), greedy(3))
    asker.step()  # holds 10 blocks
    bm = asker.block_manager
    free = bm.num_free_blocks
    assert free == 4
    installed = asker.prefixes.install(state)
    bm.check_invariants()
    # the leading `free` blocks, every one still cached: a usable run
    assert (installed, asker.prefixes.num_held(hashes)) == (free, free)


def test_an_install_larger_than_the_free_room_leaves_no_wrong_bytes_in_the_tier(tiny_llama):
    prefix = random_prompt(PREFIX, seed=1)
    hashes, state = _prefix_state(tiny_llama, prefix)
    asker = tiny_llama.engine(num_blocks=14, kv_offloading_size=tier_gib(tiny_llama, 32))
    asker.add_request("busy", random_prompt(37, seed=5), greedy(3))
    asker.step()
    asker.prefixes.install(state)
    while asker.has_unfinished():
        asker.step()
    tail = random_prompt(5, seed=3)
    assert serve(asker, "b", prefix + tail)[0] == tiny_llama.reference(prefix + tail, 6)


def test_keep_blocks_survive_an_install_larger_than_the_room(tiny_llama):
    prefix = random_prompt(PREFIX, seed=1)
    hashes, state = _prefix_state(tiny_llama, prefix)
    asker = tiny_llama.engine(num_blocks=12)
    serve(asker, "own", prefix[:8] + random_prompt(4, seed=8))  # h0, h1 and 2 tail blocks
    asker.add_request("busy", random_prompt(29, seed=5), greedy(3))
    asker.step()  # it holds the 8 never-cached blocks: the 4 cached ones are the only room
    bm = asker.block_manager
    assert (len(bm._free_uncached), len(bm._evictable)) == (0, 4)
    rest = PrefixState(state.layout, hashes[2:], state.values[:, :, :, 2:].clone(), None)
    installed = asker.prefixes.install(rest, hashes[:2])
    bm.check_invariants()
    assert [bm.locate(h)[0] if bm.locate(h) else None for h in hashes[:2]] == [DEVICE] * 2
    assert (installed, asker.prefixes.num_held(hashes)) == (2, 4)


def _keep_case(tiny_llama, keep: bool):
    """An engine holding the prompt's first 2 blocks as its least recently used cached blocks
    and one free never-cached block: installing the other 6 evicts 5 cached blocks."""
    prefix = random_prompt(PREFIX, seed=1)
    hashes, state = _prefix_state(tiny_llama, prefix)
    asker = tiny_llama.engine(num_blocks=12)
    serve(asker, "own", prefix[:8] + random_prompt(4, seed=8))  # h0, h1 and 2 tail blocks
    serve(asker, "other", random_prompt(24, seed=9))  # 7 more cached blocks, newer
    bm = asker.block_manager
    assert (len(bm._free_uncached), len(bm._evictable)) == (1, 11)
    rest = PrefixState(state.layout, hashes[2:], state.values[:, :, :, 2:].clone(), None)
    installed = asker.prefixes.install(rest, hashes[:2] if keep else ())
    bm.check_invariants()
    tail = random_prompt(5, seed=3)
    return hashes, installed, asker, serve(asker, "b", prefix + tail), prefix + tail


def test_the_prompts_own_blocks_are_kept_from_the_installs_evictions(tiny_llama):
    hashes, installed, asker, (tokens, _, cached), prompt = _keep_case(tiny_llama, keep=True)
    assert installed == 6
    assert cached == PREFIX
    assert asker.stats().prefix_peer_hit_tokens == 6 * BS
    assert tokens == tiny_llama.reference(prompt, 6)


def test_without_keep_the_install_evicts_the_prompts_own_blocks(tiny_llama):
    """The negative control of the test above: the same install without `keep`."""
    hashes, installed, asker, (tokens, _, cached), prompt = _keep_case(tiny_llama, keep=False)
    assert installed == 6
    assert cached == 0  # h0 evicted: the installed blocks are unreachable
    assert asker.stats().prefix_peer_hit_tokens == 0
    assert tokens == tiny_llama.reference(prompt, 6)


# ---- 6. malformed copies and ids ----------------------------------------------------------------

def _encoded(tiny_llama, kv_dtype: str = "auto") -> tuple[PrefixState, bytes, bytes]:
    holder = tiny_llama.engine(kv_dtype=kv_dtype)
    prefix = random_prompt(12, seed=1)
    serve(holder, "a", prefix + random_prompt(3, seed=2), n=2)
    state = holder.prefixes.export(hashes_of(holder, prefix))
    header, buffers = state.encode()
    return state, header, b"".join(bytes(v) for v in buffers)


def test_malformed_prefix_copies_are_refused(tiny_llama):
    state, header, payload = _encoded(tiny_llama, "int8")
    assert same_blocks(PrefixState.decode(header, payload), state)  # the control

    def header_with(**fields) -> bytes:
        base = {"kind": "prefix", "layout": state.layout, "hashes": list(state.hashes)}
        base.update(fields)
        return pack_tensors({k: v for k, v in base.items() if v is not ...},
                            [("values", state.values), ("scales", state.scales)])[0]

    cases = {
        "truncated payload": (header, payload[:-1]),
        "longer payload": (header, payload + b"\0"),
        "empty payload": (header, b""),
        "garbage header": (b"\xc1not msgpack", payload),
        "truncated header": (header[:len(header) // 2], payload),
        "header not a map": (pack([1, 2, 3]), payload),
        "a sequence's header": (header_with(kind="sequence"), payload),
        "no kind": (header_with(kind=...), payload),
        "no hashes": (header_with(hashes=...), payload),
        "fewer hashes than blocks": (header_with(hashes=state.hashes[:2]), payload),
        "hashes not bytes": (header_with(hashes=[h.hex() for h in state.hashes]), payload),
        "layout not a map": (header_with(layout="float32"), payload),
        "no values": (pack_tensors({"kind": "prefix", "layout": state.layout,
                                    "hashes": list(state.hashes)},
                                   [("scales", state.scales)])[0], state.scales.numpy().tobytes()),
        "values not blocks": (pack_tensors({"kind": "prefix", "layout": state.layout,
                                            "hashes": list(state.hashes)},
                                           [("values", state.values.flatten(0, 1))])[0],
                              state.values.numpy().tobytes()),
        "an unknown tensor": (pack_tensors({"kind": "prefix", "layout": state.layout,
                                            "hashes": list(state.hashes)},
                                           [("values", state.values),
                                            ("logits", state.scales)])[0], payload),
    }
    for name, (bad_header, bad_payload) in cases.items():
        with pytest.raises(HandoffError):
            PrefixState.decode(bad_header, bad_payload)
            pytest.fail(f"{name}: decoded")
    # a tensor of an unknown dtype
    fields = {"kind": "prefix", "layout": state.layout, "hashes": list(state.hashes),
              "tensors": [{"name": "values", "dtype": "complex64",
                           "shape": list(state.values.shape)}]}
    with pytest.raises(HandoffError):
        PrefixState.decode(pack(fields), payload)


def test_prefix_ids_round_trip_and_malformed_ones_are_rejected():
    hashes = [bytes(range(16)), bytes(range(16, 32)), b"\xff" * 16]
    assert prefix_id(hashes).startswith(PREFIX_ID)
    assert parse_prefix_id(prefix_id(hashes)) == hashes
    assert parse_prefix_id(prefix_id(hashes[:1])) == hashes[:1]
    good = prefix_id(hashes)
    for bad in [PREFIX_ID, PREFIX_ID + "0", good[:-1], good + "0", good[:-2] + "zz",
                PREFIX_ID + "g" * 32, ""]:
        assert parse_prefix_id(bad) is None, bad


def test_a_prefix_id_with_whitespace_is_rejected():
    assert parse_prefix_id(PREFIX_ID + "  " + "ab" * 15) is None


# ---- 7. the block manager's bookkeeping ---------------------------------------------------------

def test_block_manager_install_bookkeeping():
    bm = BlockManager(8, 2)
    tokens = list(range(10, 22))  # 6 blocks
    hashes = bm.block_hashes("probe", tokens)
    bm.free("probe")
    assert bm.install(hashes[:4]) == [0, 1, 2, 3]
    bm.check_invariants()
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 8
    assert bm.num_held_leading_blocks(hashes) == 4
    assert [bm.locate(h) for h in hashes[:5]] == [(DEVICE, b) for b in range(4)] + [None]
    hits = bm.find_cached_prefix("r", tokens + [1])
    assert hits == [0, 1, 2, 3] and bm.prefix_peer_hit_tokens == 0
    assert bm.allocate_slots("r", len(tokens) + 1, hits) is not None
    assert bm.prefix_peer_hit_tokens == 8
    bm.check_invariants()
    bm.free("r")
    bm.check_invariants()
    hits = bm.find_cached_prefix("s", tokens + [1])
    assert hits[:4] == [0, 1, 2, 3]
    bm.allocate_slots("s", len(tokens) + 1, hits)
    assert bm.prefix_peer_hit_tokens == 8  # taken once: counted once
    bm.free("s")
    # an installed block evicted before a request took it is not counted later
    bm2 = BlockManager(2, 2)
    bm2.install(hashes[:2])
    bm2.allocate_slots("t", 4)  # evicts both
    assert bm2.num_cached_blocks == 0 and not bm2._installed
    bm2.check_invariants()
    # prefix caching off: nothing installed
    assert BlockManager(4, 2, enable_prefix_caching=False).install(hashes) == []
