"""Unit tests of the scheduler: budgets, admission, preemption, finishing (no model)."""

from __future__ import annotations

from kvfleet.shared.wire import RequestStatus, SamplingParams
from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.core.preemption import PreemptionCostModel, SwapSpace
from kvfleet.worker.engine.core.scheduler import Scheduler, SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.core.stopping import StopChecker

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, max_batched_tokens=32, max_running=8, watermark=0.0,
                   prefix_caching=True) -> Scheduler:
    bm = BlockManager(num_blocks, BS, prefix_caching)
    return Scheduler(bm, StopChecker([EOS], max_model_len=1000), max_batched_tokens, max_running,
                     watermark)


def seq(req_id: str, prompt_len: int, max_tokens: int = 8, start: int = 10, **params) -> Sequence:
    return Sequence(req_id, list(range(start, start + prompt_len)),
                    SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    samples = {c.seq.req_id: [(token, None)] for c in out.chunks if c.emits_token}
    sched.update(out, samples)
    return out


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {c.seq.req_id: c.num_tokens for c in out.chunks}


def test_prefill_then_decode_and_finish_frees_blocks():
    sched = make_scheduler()
    s = seq("a", 10, max_tokens=3)
    sched.add(s)
    assert plan(step(sched)) == {"a": 10}
    assert s.status is RequestStatus.RUNNING and s.output_token_ids == [7]
    assert plan(step(sched)) == {"a": 1}
    step(sched)
    assert s.status is RequestStatus.FINISHED_LENGTH and s.output_token_ids == [7, 7, 7]
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 64
    sched.block_manager.check_invariants()


def test_decodes_come_first_and_prefill_is_chunked_to_the_remaining_budget():
    sched = make_scheduler(max_batched_tokens=8)
    for name in "abc":
        sched.add(seq(name, 3, max_tokens=50, start=ord(name) * 10))
    step(sched)  # a(3) + b(3) + c(2 of its 3): c is admitted with a chunk
    long = seq("long", 30, max_tokens=5, start=500)
    sched.add(long)
    out = step(sched)
    # a, b decode; c finishes its prompt (1 token); long gets the rest of the budget
    assert plan(out) == {"a": 1, "b": 1, "c": 1, "long": 5}
    out = step(sched)
    assert plan(out) == {"a": 1, "b": 1, "c": 1, "long": 5}
    assert long.num_computed_tokens == 10 and long.output_token_ids == []
    sched.block_manager.check_invariants()


def test_a_running_prefill_never_takes_a_decoders_token():
    sched = make_scheduler(max_batched_tokens=6)
    long, short = seq("long", 40, max_tokens=2, start=500), seq("short", 3, max_tokens=20)
    # running in admission order [long (mid-prefill), short (decoding)], as after a preemption
    for s, computed in ((long, 8), (short, 2)):
        s.status, s.num_computed_tokens = RequestStatus.RUNNING, computed
        sched.block_manager.allocate_slots(s.req_id, computed)
        sched.running.append(s)
    out = step(sched)
    assert plan(out) == {"long": 5, "short": 1}
    assert [c.seq.req_id for c in out.chunks] == ["long", "short"]


def test_max_running_limits_admission():
    sched = make_scheduler(max_running=2)
    for name in "abc":
        sched.add(seq(name, 4))
    out = step(sched)
    assert set(plan(out)) == {"a", "b"} and len(sched.waiting) == 1


def test_waiting_request_is_not_admitted_until_its_kv_fits():
    sched = make_scheduler(num_blocks=6, max_batched_tokens=64)
    sched.add(seq("a", 16, max_tokens=2))  # 4 blocks (+1 when decoding)
    sched.add(seq("b", 12, max_tokens=2, start=100))  # 3 blocks: does not fit beside a
    out = step(sched)
    assert plan(out) == {"a": 16} and [s.req_id for s in sched.waiting] == ["b"]
    step(sched)  # a finishes (2 tokens)
    out = step(sched)
    assert plan(out) == {"b": 12}


def test_watermark_keeps_blocks_free_for_running_streams():
    sched = make_scheduler(num_blocks=10, watermark=0.3)  # 3 blocks reserved
    sched.add(seq("a", 8, max_tokens=20))
    sched.add(seq("b", 8, max_tokens=20, start=100))  # 2 + 2 blocks <= 10 - 3
    sched.add(seq("c", 16, max_tokens=20, start=200))  # 4 more would leave < 3 free
    out = step(sched)
    assert set(plan(out)) == {"a", "b"}


def test_preempts_the_most_recently_admitted_and_requeues_it_first():
    sched = make_scheduler(num_blocks=6, max_batched_tokens=64)
    a = seq("a", 7, max_tokens=14)  # alone it needs at most 5 blocks; a and b together more
    b = seq("b", 7, max_tokens=14, start=100)
    sched.add(a)
    sched.add(b)
    for _ in range(10):
        out = step(sched)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == ["b"]
    assert sched.num_preemptions == 1
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert len(b.output_token_ids) > 1  # generated tokens are kept and recomputed later
    assert not sched.block_manager.holds("b")
    sched.block_manager.check_invariants()
    later = seq("w", 3, max_tokens=2, start=300)
    sched.add(later)
    assert [s.req_id for s in sched.waiting] == ["b", "w"]
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
    assert len(a.output_token_ids) == 14 and len(b.output_token_ids) == 14
    assert sched.block_manager.num_free_blocks == 6


def test_a_preempted_sequence_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=6, max_batched_tokens=64, prefix_caching=False)
    a, b = seq("a", 7, max_tokens=14), seq("b", 7, max_tokens=14, start=100)
    sched.add(a)
    sched.add(b)
    while not sched.num_preemptions:
        step(sched)
    resumed = None
    for _ in range(50):
        out = step(sched)
        resumed = next((c for c in out.chunks if c.seq is b), None)
        if resumed is not None:
            break
    assert resumed is not None and resumed.start == 0
    assert resumed.num_tokens == b.num_tokens - 1 and b.num_tokens > 8  # prompt + outputs
    assert resumed.emits_token


def test_finish_from_outside_frees_blocks_in_any_state():
    sched = make_scheduler(max_batched_tokens=4)
    running, waiting = seq("r", 10), seq("w", 10, start=100)
    sched.add(running)
    sched.add(waiting)
    step(sched)  # r admitted with a 4-token chunk; w waits on the budget
    assert sched.block_manager.holds("r")
    sched.finish(running, RequestStatus.FINISHED_ABORTED)
    sched.finish(waiting, RequestStatus.FINISHED_ERROR, error="boom")
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 64
    assert waiting.error == "boom"


def test_prefix_hits_skip_computation_and_are_counted():
    sched = make_scheduler()
    first = seq("a", 10, max_tokens=1)
    sched.add(first)
    step(sched)
    assert first.is_finished
    second = seq("b", 10, max_tokens=1)
    sched.add(second)
    out = step(sched)
    assert plan(out) == {"b": 2} and second.num_cached_tokens == 8
    bm = sched.block_manager
    assert (bm.prefix_queried_tokens, bm.prefix_hit_tokens) == (20, 8)
    skip = seq("c", 10, max_tokens=1, skip_prefix_cache=True)
    sched.add(skip)
    assert plan(step(sched)) == {"c": 10} and skip.num_cached_tokens == 0


def test_prompts_admitted_together_compute_their_shared_prefix_once():
    """The second prompt shares the full blocks the first's chunk fills in the same step; the
    blocks are published only after the step. Control: with prefix caching off it computes
    its whole prompt beside the first."""
    for caching in (True, False):
        sched = make_scheduler(max_batched_tokens=64, prefix_caching=caching)
        bm = sched.block_manager
        first, second = seq("a", 14, max_tokens=2), seq("b", 14, max_tokens=2)
        second.token_ids[-1] = 99  # the prompts differ in their last token only
        sched.add(first)
        sched.add(second)
        out = sched.schedule()
        if not caching:
            assert plan(out) == {"a": 14, "b": 14}
            continue
        # 3 full blocks of 4 are shared: the second computes positions 12 and 13
        assert plan(out) == {"a": 14, "b": 2}
        assert bm.block_table("b")[:3] == bm.block_table("a")[:3]
        assert bm.block_table("b")[3] != bm.block_table("a")[3]
        assert second.num_cached_tokens == 12 and bm.prefix_hit_tokens == 12
        assert bm.num_cached_blocks == 0  # nothing published before the step ran
        sched.update(out, {"a": [(7, None)], "b": [(7, None)]})
        assert bm.num_cached_blocks == 3  # the first's blocks, published once
        bm.check_invariants()


def test_shared_blocks_within_a_step_stop_where_the_chunk_stops():
    """A chunk cut by the budget shares only the full blocks it fills; a third prompt on
    another prefix shares nothing; a sequence that skips the cache shares nothing."""
    sched = make_scheduler(max_batched_tokens=12)
    sched.add(seq("a", 20, max_tokens=1))
    out = sched.schedule()
    assert plan(out) == {"a": 12}
    sched.update(out, {})
    sched.add(seq("b", 20, max_tokens=1))  # same prompt: 3 blocks published, 1 in this step
    sched.add(seq("c", 20, max_tokens=1, start=500))
    sched.add(seq("d", 20, max_tokens=1, skip_prefix_cache=True))
    sched.max_batched_tokens = 64
    out = sched.schedule()
    # a computes 12..19 (filling blocks 3 and 4); b takes 4 blocks (its last token computes)
    assert plan(out) == {"a": 8, "b": 4, "c": 20, "d": 20}
    bm = sched.block_manager
    assert bm.block_table("b")[:4] == bm.block_table("a")[:4]
    assert not set(bm.block_table("c")) & set(bm.block_table("a"))
    assert not set(bm.block_table("d")) & set(bm.block_table("a"))
    assert [s.num_cached_tokens for s in sched.running] == [0, 16, 0, 0]


def test_resumed_sequence_that_is_already_complete_finishes_at_once():
    sched = make_scheduler()
    s = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0), [8, 9])
    sched.add(s)
    assert s.status is RequestStatus.FINISHED_LENGTH
    assert sched.take_finished_at_add() == [s] and not sched.has_unfinished()


def test_aborting_a_sequence_that_finished_at_add_drops_it():
    sched = make_scheduler()
    s = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0), [8, 9])
    sched.add(s)
    sched.finish(s, RequestStatus.FINISHED_ABORTED)
    assert s.status is RequestStatus.FINISHED_ABORTED
    assert sched.take_finished_at_add() == [] and not sched.has_unfinished()


def swapping_scheduler(num_blocks=6, swap_blocks=64) -> Scheduler:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=False)
    model = PreemptionCostModel("swap", block_bytes=1000, swap_bytes_per_s=1e9, prefill_s_per_token=1e-3)
    return Scheduler(bm, StopChecker([EOS], max_model_len=1000), 64, 8, 0.0,
                     preemption=model, swap_space=SwapSpace(swap_blocks))


def test_a_swapped_sequence_keeps_its_progress_and_comes_back_into_new_blocks():
    sched = swapping_scheduler()
    a, b = seq("a", 7, max_tokens=14), seq("b", 7, max_tokens=14, start=100)
    sched.add(a)
    sched.add(b)
    while not sched.num_preemptions:
        out = step(sched)
    assert out.preempted_req_ids == ["b"] and sched.num_swap_preemptions == 1
    [(req_id, blocks)] = out.swap_out
    computed = b.num_computed_tokens
    assert req_id == "b" and len(blocks) == -(-computed // BS) == b.num_swapped_blocks
    assert computed == b.num_tokens - 1  # progress kept: only the last sampled token is pending
    assert sched.swap_space.num_used_blocks == len(blocks) and not sched.block_manager.holds("b")
    for _ in range(50):
        out = step(sched)
        if out.swap_in:
            break
    [(req_id, new_blocks)] = out.swap_in
    resumed = next(c for c in out.chunks if c.seq is b)
    assert req_id == "b" and len(new_blocks) == len(blocks)
    assert new_blocks == sched.block_manager.block_table("b")[:len(blocks)]
    assert resumed.start == b.num_computed_tokens - 1 and resumed.num_tokens == 1  # a decode
    assert b.num_swapped_blocks == 0 and sched.swap_space.num_used_blocks == 0
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
    assert len(a.output_token_ids) == 14 and len(b.output_token_ids) == 14
    sched.block_manager.check_invariants()


def test_no_swap_room_means_recompute_and_finishing_a_swapped_sequence_frees_its_space():
    sched = swapping_scheduler(swap_blocks=1)
    a, b = seq("a", 7, max_tokens=14), seq("b", 7, max_tokens=14, start=100)
    sched.add(a)
    sched.add(b)
    while not sched.num_preemptions:
        out = step(sched)
    assert not out.swap_out and b.num_computed_tokens == 0  # 2+ blocks never fit in 1
    roomy = swapping_scheduler()
    c, d = seq("c", 7, max_tokens=14), seq("d", 7, max_tokens=14, start=100)
    roomy.add(c)
    roomy.add(d)
    while not roomy.num_preemptions:
        step(roomy)
    roomy.finish(d, RequestStatus.FINISHED_ABORTED)
    assert roomy.swap_space.num_used_blocks == 0 and d.num_swapped_blocks == 0
