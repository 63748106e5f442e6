"""The keep-or-recompute cost model and the host swap space (no model, no torch)."""

from __future__ import annotations

import pytest

from kvfleet.worker.engine.core.preemption import RECOMPUTE, SWAP, PreemptionCostModel, SwapSpace

MB = 1_000_000


def model(mode="auto", bandwidth=1e9, s_per_token=1e-3) -> PreemptionCostModel:
    return PreemptionCostModel(mode, block_bytes=MB, swap_bytes_per_s=bandwidth,
                               prefill_s_per_token=s_per_token)


def test_auto_swaps_a_long_context_and_recomputes_a_cheap_one():
    m = model()  # 10 blocks: 20 MB round trip = 20 ms; recompute 1 ms per token
    assert m.swap_seconds(10) == pytest.approx(0.02)
    assert m.choose(10, num_tokens_to_recompute=160, swap_has_room=True) == SWAP  # 160 ms
    assert m.choose(10, num_tokens_to_recompute=10, swap_has_room=True) == RECOMPUTE  # 10 ms
    # tokens shared through the prefix cache cost nothing to recompute
    assert m.choose(10, num_tokens_to_recompute=0, swap_has_room=True) == RECOMPUTE


def test_fixed_modes_and_the_fallback_without_room():
    assert model("swap").choose(10, 1, swap_has_room=True) == SWAP
    assert model("recompute").choose(10, 10_000, swap_has_room=True) == RECOMPUTE
    assert model("swap").choose(10, 10_000, swap_has_room=False) == RECOMPUTE
    assert model("auto").choose(10, 10_000, swap_has_room=False) == RECOMPUTE
    with pytest.raises(ValueError, match="preemption"):
        model("sometimes")


def test_measured_rates_move_the_decision():
    m = model(bandwidth=1e9, s_per_token=1e-3)
    assert m.choose(10, 100, True) == SWAP
    for _ in range(20):  # the host link turns out 100x slower than the prior
        m.observe_swap(num_bytes=10 * MB, seconds=1.0)
    assert m.swap_bytes_per_s.value == pytest.approx(1e7, rel=0.05)
    assert m.choose(10, 100, True) == RECOMPUTE
    # decode-heavy steps do not count as prefill rate; prefill-heavy ones do
    m.observe_step(num_prefill_tokens=4, num_batched_tokens=64, seconds=10.0)
    assert m.prefill_s_per_token.num_observations == 0
    m.observe_step(num_prefill_tokens=500, num_batched_tokens=512, seconds=51.2)
    assert m.prefill_s_per_token.value == pytest.approx(0.1)
    assert m.choose(10, 100, True) == SWAP  # 10 s to recompute vs 2 s to move


def test_swap_space_counts_blocks_per_stream():
    space = SwapSpace(capacity_blocks=10)
    space.reserve("a", 6)
    assert not space.can_hold(5) and space.can_hold(4)
    with pytest.raises(ValueError, match="already"):
        space.reserve("a", 1)
    with pytest.raises(ValueError, match="full"):
        space.reserve("b", 5)
    assert space.release("a") == 6 and space.release("a") == 0
    assert space.num_used_blocks == 0
