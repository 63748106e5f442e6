"""A running sequence moves to another engine with its KV cache (handoff.py) and its answer goes
on as if it had not moved: tokens, logprobs and usage bit for bit (float32 and bf16, greedy and
seeded), mid-prefill, after a prefix-cache hit, swapped out before it went, into a busy engine
that must wait for room, back into the engine it left, in every KV format, with n-gram and
draft-model speculation. Nothing is computed again: the blocks arrive as they left. An engine
refuses what it cannot take and is unchanged; an imported sequence aborted before it runs
leaves nothing behind; one without KV to move stays where it is.

Engines A and B share the weights of the wide tiny Llama (heads 64 wide: rows batch-invariant
at the default --deterministic), so a reference run where nothing moves, with other requests
beside it, gives every answer. Every state crosses through its wire encoding as bytes.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kvfleet.shared.wire import RequestStatus, SamplingParams
from kvfleet.shared.wire.prefix_hash import root_hash
from tests.engine.test_lora import save_adapter
from tests.engine.tiny_models import build_model, build_wide_llama, greedy, random_prompt
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.core.handoff import HandoffError, SequenceState
from kvfleet.worker.engine.lora import LoraRequest
from kvfleet.worker.engine.model.model_prep import shared_copy

COMMON = random_prompt(40, seed=99)  # a shared opening: the prefix cache's hit
PHRASE = random_prompt(12, seed=7)  # repeated: n-gram proposals hit


@pytest.fixture(scope="module")
def wide_llama() -> torch.nn.Module:
    return build_wide_llama()


def make_engine(model, dtype: str = "bfloat16", draft=None, **config) -> Engine:
    config = {"device": "cpu", "dtype": dtype, "block_size": 16, "num_blocks": 64, **config}
    return Engine(shared_copy(model), EngineConfig(**config),
                  draft_model=None if draft is None else copy.deepcopy(draft))


def seeded(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=5,
                          ignore_eos=True, logprobs=2)


class Answers:
    """Each request's tokens, logprobs and last usage report, from the outputs of any engine."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list] = {}
        self.usage: dict[str, tuple] = {}

    def take(self, outputs) -> None:
        for out in outputs:
            assert out.error is None, out.error
            self.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            self.logprobs.setdefault(out.req_id, []).extend(out.new_logprobs or [])
            self.usage[out.req_id] = (out.num_prompt_tokens, out.num_cached_tokens,
                                      out.num_output_tokens, out.finish_reason)

    def of(self, req_id: str) -> tuple:
        return self.tokens[req_id], self.logprobs[req_id], self.usage[req_id]

    def step(self, *engines: Engine, times: int = 1) -> None:
        for _ in range(times):
            for engine in engines:
                self.take(engine.step())

    def finish(self, *engines: Engine) -> None:
        while any(e.has_unfinished() for e in engines):
            self.step(*engines)
        for engine in engines:
            assert_empty(engine)


def assert_empty(engine: Engine) -> None:
    """Nothing left: every block free (cached ones evictable), no host copy, no matcher."""
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    assert engine.swapped.num_bytes == 0 and engine.swap_space.num_used_blocks == 0
    assert not engine._seqs and not engine.has_unfinished() and not len(engine.constrained)


def reference(model, reqs: dict, dtype: str = "bfloat16", warm: list | None = None,
              **config) -> Answers:
    """Every request in one engine where nothing moves (`warm`: prompts run first)."""
    engine = make_engine(model, dtype, **config)
    answers = Answers()
    for i, prompt in enumerate(warm or []):
        engine.add_request(f"warm{i}", prompt, greedy(1))
        answers.finish(engine)
    for req_id, (prompt, params) in reqs.items():
        engine.add_request(req_id, prompt, params)
    answers.finish(engine)
    return answers


def over_the_wire(state: SequenceState) -> SequenceState:
    header, buffers = state.encode()
    return SequenceState.decode(bytes(header), b"".join(buffers))


def move(source: Engine, target: Engine, req_id: str) -> SequenceState:
    """Export from `source`, through bytes, into `target`; the state as it left."""
    num_bytes = source.kv_bytes_of(req_id)
    state = source.export_sequence(req_id)
    assert state is not None and state.num_bytes == num_bytes > 0
    assert req_id not in source._seqs and source.kv_bytes_of(req_id) == 0
    target.import_sequence(over_the_wire(state))
    return state


def rows(values: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[layers, 2, KVH, n, block, ...] host blocks -> their first `num_positions` positions."""
    shape = values.shape
    flat = values.reshape(*shape[:3], shape[3] * shape[4], *shape[5:])
    return flat[:, :, :, :num_positions]


def assert_blocks_arrived(engine: Engine, state: SequenceState, draft: bool = False) -> None:
    """The engine's pool holds the state's KV in the sequence's blocks, bit for bit."""
    pool = engine.speculation.pool if draft else engine.pool
    num = state.draft_num_computed_tokens if draft else state.num_computed_tokens
    values, scales = ((state.draft_values, state.draft_scales) if draft
                      else (state.values, state.scales))
    table = engine.block_manager.block_table(state.req_id)[:values.shape[3]]
    here = pool.copy_out(table)
    assert torch.equal(rows(here.values, num), rows(values, num))
    if scales is not None:
        assert torch.equal(rows(here.scales, num), rows(scales, num))


# ---- answers as if nothing moved -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moved_sequences_continue_bit_for_bit(wide_llama, dtype):
    """Greedy and seeded sequences move mid-answer from A to B (busy with its own request), one
    goes out of A and back in (what a source does when its handoff is not taken): every answer
    is the reference's, logprobs and usage included."""
    reqs = {"greedy": (random_prompt(21, seed=1), greedy(12, logprobs=2)),
            "seeded": (random_prompt(30, seed=2), seeded(12)),
            "back": (random_prompt(17, seed=3), greedy(12, logprobs=2)),
            "b's own": (random_prompt(25, seed=4), seeded(14))}
    want = reference(wide_llama, reqs, dtype)
    a, b = make_engine(wide_llama, dtype), make_engine(wide_llama, dtype)
    got = Answers()
    for req_id in ("greedy", "seeded", "back"):
        a.add_request(req_id, *reqs[req_id])
    b.add_request("b's own", *reqs["b's own"])
    got.step(a, b, times=4)
    for req_id in ("greedy", "seeded"):
        state = move(a, b, req_id)
        assert state.output_token_ids == got.tokens[req_id]
        assert state.num_computed_tokens == state.num_tokens - 1  # its last token not yet
    move(a, a, "back")
    got.step(a, b)
    assert_blocks_arrived(b, state)
    got.finish(a, b)
    for req_id in reqs:
        assert got.of(req_id) == want.of(req_id), req_id
    # nothing computed twice: each engine prefilled only the prompts it was given
    assert a.stats().num_prefill_tokens_computed == sum(len(reqs[r][0])
                                                        for r in ("greedy", "seeded", "back"))
    assert b.stats().num_prefill_tokens_computed == len(reqs["b's own"][0])


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8", "int8"])
def test_every_kv_format_moves_its_blocks_exactly(wide_llama, kv_dtype):
    """8-bit codes with their scales (int8 rotated) and other float formats than the model's.
    These formats' attention is not batch-invariant, so the sequence runs alone in A, B and the
    reference: the same steps, and the same answer bit for bit."""
    reqs = {"x": (random_prompt(27, seed=5), greedy(10, logprobs=2))}
    want = reference(wide_llama, reqs, "float32", kv_dtype=kv_dtype)
    a = make_engine(wide_llama, "float32", kv_dtype=kv_dtype)
    b = make_engine(wide_llama, "float32", kv_dtype=kv_dtype)
    got = Answers()
    a.add_request("x", *reqs["x"])
    got.step(a, times=3)
    state = move(a, b, "x")
    assert (state.scales is not None) is (kv_dtype in ("fp8", "int8"))
    got.step(b)
    assert_blocks_arrived(b, state)
    got.finish(a, b)
    assert got.of("x") == want.of("x")


def test_a_sequence_moves_mid_prefill(wide_llama):
    """Exported after its first 16-token chunk (no output yet): B computes the rest of the
    prompt and decodes, chunked as A would."""
    reqs = {"x": (random_prompt(45, seed=6), seeded(8))}
    want = reference(wide_llama, reqs, max_batched_tokens=16)
    a = make_engine(wide_llama, max_batched_tokens=16)
    b = make_engine(wide_llama, max_batched_tokens=16)
    got = Answers()
    a.add_request("x", *reqs["x"])
    got.step(a)
    state = move(a, b, "x")
    assert state.output_token_ids == [] and state.num_computed_tokens == 16
    got.finish(a, b)
    assert got.of("x") == want.of("x")
    assert b.stats().num_prefill_tokens_computed == 45 - 16


def test_prompt_logprobs_hold_a_sequence_until_they_are_sent(wide_llama):
    """Mid-prefill, a request's prompt logprobs so far would be lost: it stays; once they went
    out with its first output it moves, and B sends none again."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    reqs = {"x": (random_prompt(40, seed=8), params)}
    engine = make_engine(wide_llama, max_batched_tokens=16)
    engine.add_request("x", *reqs["x"])
    want = []
    while engine.has_unfinished():
        want += engine.step()
    a = make_engine(wide_llama, max_batched_tokens=16)
    b = make_engine(wide_llama, max_batched_tokens=16)
    a.add_request("x", *reqs["x"])
    outputs = a.step()
    assert not outputs and a.kv_bytes_of("x") == 0 and a.export_sequence("x") is None
    while not outputs:
        outputs = a.step()
    move(a, b, "x")
    while b.has_unfinished():
        outputs += b.step()
    assert [o.prompt_logprobs for o in outputs] == [o.prompt_logprobs for o in want]
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in want]
    assert_empty(a)
    assert_empty(b)


def test_a_prefix_cache_hit_is_still_reported_after_the_move(wide_llama):
    """Its usage keeps the prompt tokens A's cache served; B publishes the blocks it got."""
    prompt = COMMON + random_prompt(9, seed=9)
    reqs = {"x": (prompt, greedy(8, logprobs=2))}
    want = reference(wide_llama, reqs, warm=[COMMON + [7]])
    assert want.usage["x"][1] == 32
    a, b = make_engine(wide_llama), make_engine(wide_llama)
    got = Answers()
    a.add_request("warm", COMMON + [7], greedy(1))
    got.finish(a)
    a.add_request("x", *reqs["x"])
    got.step(a, times=2)
    move(a, b, "x")
    got.finish(a, b)
    assert got.of("x") == want.of("x")
    assert b.num_cached_prefix_blocks(prompt) == len(prompt) // 16


def test_swapped_out_sequences_move_and_recomputed_ones_stay(wide_llama):
    """Preempted by swapping, its host copy is what moves (A's swap space is freed); preempted
    for recompute, it holds no KV: export gives None and it finishes in A, unchanged."""
    reqs = {f"r{i}": (random_prompt(20, seed=10 + i), seeded(24) if i % 2 else greedy(24))
            for i in range(4)}
    want = reference(wide_llama, reqs)
    for mode in ("swap", "recompute"):
        a = make_engine(wide_llama, num_blocks=10, preemption=mode, swap_space="64MiB")
        b = make_engine(wide_llama)
        got = Answers()
        for req_id, req in reqs.items():
            a.add_request(req_id, *req)
        while not any(s.status is RequestStatus.PREEMPTED for s in a.scheduler.waiting):
            assert a.has_unfinished(), "nothing was preempted"
            got.step(a)
        preempted = next(s for s in a.scheduler.waiting if s.status is RequestStatus.PREEMPTED)
        if mode == "swap":
            assert preempted.num_swapped_blocks and a.swap_space.num_used_blocks
            state = move(a, b, preempted.req_id)
            assert a.swap_space.num_used_blocks == 0 and a.swapped.num_bytes == 0
            assert state.num_computed_tokens == state.num_tokens - 1
        else:
            assert preempted.num_computed_tokens == 0
            assert a.kv_bytes_of(preempted.req_id) == 0
            assert a.export_sequence(preempted.req_id) is None
            assert a._seqs[preempted.req_id] is preempted
        got.finish(a, b)
        for req_id in reqs:
            assert got.of(req_id) == want.of(req_id), (mode, req_id)


def test_a_busy_engine_swaps_it_in_when_it_has_room(wide_llama):
    """B's pool is full of its own streams: the imported sequence waits (its host bytes counted
    in swap_used_bytes, not in the swap space) until one finishes, then goes on."""
    reqs = {"x": (random_prompt(30, seed=20), seeded(12)),
            "b0": (random_prompt(30, seed=21), greedy(16)),
            "b1": (random_prompt(30, seed=22), greedy(16))}
    want = reference(wide_llama, reqs)
    a, b = make_engine(wide_llama), make_engine(wide_llama, num_blocks=8)
    got = Answers()
    a.add_request("x", *reqs["x"])
    b.add_request("b0", *reqs["b0"])
    b.add_request("b1", *reqs["b1"])
    got.step(a, b, times=3)
    state = move(a, b, "x")
    waited = 0
    while b._seqs["x"].status is RequestStatus.PREEMPTED:
        stats = b.stats()
        assert stats.swap_used_bytes == state.num_bytes and b.swap_space.num_used_blocks == 0
        assert stats.num_waiting == 1
        got.step(b)
        waited += 1
    assert waited > 5 and len(got.tokens["b0"]) == len(got.tokens["b1"]) == 16
    got.finish(a, b)
    for req_id in reqs:
        assert got.of(req_id) == want.of(req_id), req_id


def test_a_sequence_moves_with_its_adapter(tiny_llama, tmp_path):
    """B loads the adapter the state names (A's pin on it is released) and the answer goes on
    under it; alone in each engine (the tiny model's 16-wide heads are not batch-invariant)."""
    path = save_adapter(tiny_llama.model, tmp_path / "qv4", 4, 8, ["q_proj", "v_proj"], seed=3)
    lora = LoraRequest("qv4", path, root_hash("tiny-llama", "qv4"))
    prompt, params = random_prompt(14, seed=50), greedy(10, logprobs=2)
    want = Answers()
    engine = tiny_llama.engine(enable_lora=True)
    engine.add_request("x", prompt, params, lora=lora)
    want.finish(engine)
    a, b = tiny_llama.engine(enable_lora=True), tiny_llama.engine(enable_lora=True)
    got = Answers()
    a.add_request("x", prompt, params, lora=lora)
    got.step(a, times=3)
    state = move(a, b, "x")
    assert state.lora == lora and b.lora_stats().loaded == ["qv4"]
    assert not a.lora._holding and b.lora._holding == {"x": "qv4"}
    got.finish(a, b)
    assert got.of("x") == want.of("x")


# ---- speculation ---------------------------------------------------------------------------------

def test_with_ngram_speculation(wide_llama):
    """Proposals need only the tokens: B's n-gram proposer picks the moved stream up."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    reqs = {"x": (random_prompt(6, seed=30) + PHRASE + random_prompt(3, seed=31) + PHRASE[:6],
                  greedy(24, logprobs=2))}
    want = reference(wide_llama, reqs)
    a = make_engine(wide_llama, speculative_config=spec)
    b = make_engine(wide_llama, speculative_config=spec)
    got = Answers()
    a.add_request("x", *reqs["x"])
    got.step(a, times=3)
    move(a, b, "x")
    got.finish(a, b)
    assert got.of("x") == want.of("x")
    assert b.speculation.speculator.stats.num_drafts > 0


def test_with_a_draft_model_its_blocks_move_too(wide_llama):
    """The draft's KV moves in the same block ids, and B's draft continues from it (the draft
    is the target itself: every proposal is accepted)."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}
    reqs = {"x": (random_prompt(25, seed=32), greedy(20, logprobs=2))}
    want = reference(wide_llama, reqs)
    a = make_engine(wide_llama, speculative_config=spec, draft=wide_llama)
    b = make_engine(wide_llama, speculative_config=spec, draft=wide_llama)
    got = Answers()
    a.add_request("x", *reqs["x"])
    got.step(a, times=3)
    state = move(a, b, "x")
    assert state.draft_values is not None and state.draft_num_computed_tokens > 0
    got.step(b)  # swapped in, one plain decode: the draft's blocks untouched yet
    assert_blocks_arrived(b, state, draft=True)
    assert b.speculation.draft.computed_of(b._seqs["x"]) == state.draft_num_computed_tokens
    got.finish(a, b)
    assert got.of("x") == want.of("x")
    assert b.speculation.speculator.stats.num_accepted_tokens > 0


# ---- the wire and what an engine refuses ---------------------------------------------------------

def test_the_wire_encoding_round_trips_without_copies(wide_llama):
    """Every field comes back; the buffers are the state's tensors' memory, and the decoded
    tensors views of the payload."""
    a = make_engine(wide_llama, kv_dtype="int8")
    params = SamplingParams(max_tokens=9, temperature=0.7, seed=3, stop_token_ids=[4], logprobs=1,
                            logit_bias={5: 1.5})
    a.add_request("x", random_prompt(20, seed=43), params)
    a.step()
    state = dataclasses.replace(a.export_sequence("x"),
                                lora=LoraRequest("adapter", "/adapters/a", b"\x00\xff"))
    header, buffers = state.encode()
    assert [torch.frombuffer(buffer, dtype=torch.uint8).data_ptr() for buffer in buffers] == [
        state.values.data_ptr(), state.scales.data_ptr()]
    payload = bytearray(b"".join(buffers))
    assert len(payload) == state.num_bytes
    back = SequenceState.decode(header, payload)
    for field in dataclasses.fields(SequenceState):
        sent, got = getattr(state, field.name), getattr(back, field.name)
        if isinstance(sent, torch.Tensor):
            assert sent.dtype == got.dtype and torch.equal(sent, got), field.name
        else:
            assert sent == got, field.name
    payload[0] ^= 1
    assert not torch.equal(back.values, state.values)


def snapshot(engine: Engine) -> tuple:
    return engine.stats(), sorted(engine._seqs), engine.lora_stats()


def test_an_engine_refuses_what_it_cannot_take_and_is_unchanged(wide_llama):
    reqs = {"x": (random_prompt(20, seed=40), greedy(8, logprobs=2))}
    want = reference(wide_llama, reqs)
    a, b = make_engine(wide_llama), make_engine(wide_llama)
    assert a.handoff_gap() is None
    got = Answers()
    a.add_request("x", *reqs["x"])
    got.step(a, times=2)
    state = a.export_sequence("x")
    header, buffers = state.encode()
    payload = b"".join(buffers)

    others = {"another model": Engine(build_model("llama"), EngineConfig(
                  device="cpu", dtype="bfloat16", block_size=16, num_blocks=64)),
              "another block size": make_engine(wide_llama, block_size=8),
              "another kv format": make_engine(wide_llama, kv_dtype="fp8"),
              "another served model": make_engine(wide_llama)}
    others["another served model"].set_prefix_root(root_hash("another-model"))
    for name, engine in others.items():
        with pytest.raises(HandoffError, match="another layout"):
            engine.import_sequence(SequenceState.decode(header, payload))
        assert_empty(engine)

    before = snapshot(b)
    adapter = LoraRequest("adapter", "/nowhere", b"root")
    bad = {"an adapter without --enable-lora": (dataclasses.replace(state, lora=adapter),
                                                 "enable-lora"),
           "the blocks of other positions": (dataclasses.replace(
               state, num_computed_tokens=state.num_computed_tokens - 16), "blocks of"),
           "nothing left to compute": (dataclasses.replace(
               state, num_computed_tokens=state.num_tokens), "computed")}
    for name, (wrong, match) in bad.items():
        with pytest.raises(HandoffError, match=match):
            b.import_sequence(wrong)
        assert snapshot(b) == before, name
    for wrong_payload in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(HandoffError, match="payload"):
            SequenceState.decode(header, wrong_payload)
    for wrong_header in (b"", b"\x93\x01", header[:len(header) // 2], b"\xc1"):
        with pytest.raises(HandoffError, match="malformed"):
            SequenceState.decode(wrong_header, payload)

    b.import_sequence(SequenceState.decode(header, bytearray(payload)))
    with pytest.raises(HandoffError, match="already"):
        b.import_sequence(SequenceState.decode(header, memoryview(payload)))
    got.finish(a, b)
    assert got.of("x") == want.of("x")


def test_an_imported_sequence_that_ends_before_it_runs_leaves_nothing(wide_llama):
    """Aborted, or failed (as when its adapter cannot be loaded after all), while it waits to
    be swapped in: its host copy goes with it."""
    a, b = make_engine(wide_llama), make_engine(wide_llama)
    a.add_request("x", random_prompt(20, seed=41), seeded(8))
    a.add_request("y", random_prompt(20, seed=42), seeded(8))
    a.step()
    move(a, b, "x")
    move(a, b, "y")
    assert b.stats().swap_used_bytes > 0
    out = b.abort("x")
    assert out.finish_reason == "abort" and out.num_output_tokens == 1
    [out] = b._fail([(b._seqs["y"], LookupError("adapter gone"))])
    assert out.finish_reason == "error"
    assert_empty(a)
    assert_empty(b)
    assert not b.step()


def test_what_cannot_move_stays():
    """Not here, or queued (no KV yet): None, and a queued request runs on."""
    engine = Engine(build_model("llama"), EngineConfig(device="cpu", dtype="float32",
                                                       block_size=4, num_blocks=32))
    assert engine.export_sequence("nobody") is None and engine.kv_bytes_of("nobody") == 0
    engine.add_request("x", random_prompt(9, seed=42), greedy(3))
    assert engine.export_sequence("x") is None and engine.kv_bytes_of("x") == 0
    answers = Answers()
    answers.finish(engine)
    assert len(answers.tokens["x"]) == 3
