"""Unit tests of the sampler: no model, small hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.core.sampler import (
    Sampler,
    SamplerInput,
    apply_min_tokens,
    apply_penalties,
    inverse_cdf,
    noise_key,
    uniform_noise,
)

EOS = 2


def make_input(
    prompt: list[int] | None = None, output: list[int] | None = None, **params
) -> SamplerInput:
    return SamplerInput(SamplingParams(**params), list(prompt or [5, 6]), list(output or []))


def tokens(results) -> list[int]:
    return [token_id for token_id, _ in results]


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(eos_token_ids=[EOS])


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, 50, generator=torch.Generator().manual_seed(7))  # [6, vocab 50]


# --- greedy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_equals_argmax(sampler, logits, dtype):
    logits = logits.to(dtype)
    inputs = [make_input(temperature=0.0, seed=i) for i in range(len(logits))]
    assert tokens(sampler.sample(logits, inputs)) == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("num_random", [0, 1])
def test_greedy_takes_the_first_of_tied_maxima(sampler, num_random):
    """As argmax does (HF `generate`'s greedy choice), alone and beside a sampled row; ties are
    common in bf16 logits."""
    logits = torch.zeros(3, 4096)
    logits[0, [7, 3000]] = 5.0
    logits[1, [4095, 12, 2048]] = 1.0
    logits[2, [100, 101]] = 2.0
    inputs = [make_input(temperature=0.0) for _ in range(3)]
    if num_random:
        inputs[2] = make_input(temperature=1.0, seed=3)
    assert tokens(sampler.sample(logits, inputs))[:3 - num_random] == [7, 12, 100][:3 - num_random]


def test_greedy_does_not_modify_the_callers_logits(sampler, logits):
    before = logits.clone()
    inputs = [make_input(temperature=0.0, repetition_penalty=3.0, output=[1]) for _ in logits]
    sampler.sample(logits, inputs)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5, 50.0])
def test_top_k_one_equals_greedy(sampler, logits, temperature):
    inputs = [make_input(temperature=temperature, top_k=1, seed=i) for i in range(len(logits))]
    assert tokens(sampler.sample(logits, inputs)) == logits.argmax(dim=-1).tolist()


def test_empty_batch_and_shape_mismatch(sampler, logits):
    assert sampler.sample(torch.empty(0, 50), []) == []
    with pytest.raises(ValueError):
        sampler.sample(logits, [make_input()])


# --- determinism ----------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(logits):
    inputs = [make_input(seed=42, output=[1] * i) for i in range(len(logits))]
    first = tokens(Sampler([EOS]).sample(logits, inputs))
    second = tokens(Sampler([EOS]).sample(logits.clone(), inputs))
    assert first == second


def test_seed_none_is_seed_zero(sampler):
    flat = torch.zeros(1, 1000)
    for position in range(5):
        output = [7] * position
        none_seed = sampler.sample(flat, [make_input(seed=None, output=output)])
        zero_seed = sampler.sample(flat, [make_input(seed=0, output=output)])
        assert none_seed == zero_seed


def test_independent_of_batch_composition_and_row_order(sampler):
    vocab = 1000
    flat = torch.zeros(1, vocab)  # uniform: the noise alone decides, so any leak would show
    others = [
        make_input(temperature=0.0),
        make_input(seed=9, top_p=0.5, output=[3, 4]),
        make_input(seed=9, top_k=7, repetition_penalty=1.5),
        make_input(seed=11, min_p=0.1, presence_penalty=0.5, logprobs=2),
    ]
    other_logits = torch.randn(len(others), vocab, generator=torch.Generator().manual_seed(3))
    for seed in range(20):
        request = make_input(seed=seed, output=[1] * (seed % 4))
        alone = sampler.sample(flat, [request])[0][0]
        for row in range(len(others) + 1):
            batch_inputs = others[:row] + [request] + others[row:]
            batch_logits = torch.cat([other_logits[:row], flat, other_logits[row:]])
            assert sampler.sample(batch_logits, batch_inputs)[row][0] == alone


def test_resumed_request_continues_the_same_stream(sampler):
    vocab = 300
    step_logits = torch.randn(30, vocab, generator=torch.Generator().manual_seed(5))
    params = dict(seed=1234, temperature=1.0, repetition_penalty=1.2)

    def generate(output: list[int], until: int, fresh: Sampler) -> list[int]:
        output = list(output)
        while len(output) < until:
            step = step_logits[len(output)].unsqueeze(0)
            output.append(fresh.sample(step, [make_input(output=output, **params)])[0][0])
        return output

    full = generate([], 30, sampler)
    resumed = generate(full[:12], 30, Sampler([EOS]))  # as if another worker picked it up
    assert resumed == full


def _reference_uniform(seed: int, position: int) -> float:
    """The noise spec written out again with plain integers: splitmix64 twice, top 23 bits."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    return ((mix(mix(seed) ^ position) >> 41) + 0.5) / 2**23


def test_noise_is_the_integer_spec_and_exact_in_float32():
    for seed, position in [(0, 0), (1, 0), (0, 1), (42, 17), (2**63 + 5, 10**6)]:
        u = uniform_noise(seed, position)
        assert u == _reference_uniform(seed, position)
        # the device sees the same bits: the float32 copy is the value itself
        assert torch.tensor(u, dtype=torch.float32).item() == u
        assert 0.0 < u < 1.0


def test_positions_and_seeds_give_different_noise():
    keys = {noise_key(seed, position) for seed in range(20) for position in range(50)}
    assert len(keys) == 20 * 50
    uniforms = torch.tensor([uniform_noise(seed, p) for seed in range(50) for p in range(200)])
    # 10,000 draws: mean 1/2, variance 1/12, and flat over 10 bins (chi-square, 9 dof, 99.9%)
    assert abs(uniforms.mean().item() - 0.5) < 0.01
    assert abs(uniforms.var().item() - 1 / 12) < 0.005
    counts = torch.histc(uniforms, bins=10, min=0.0, max=1.0)
    assert (((counts - 1000) ** 2) / 1000).sum().item() < 27.88
    # consecutive positions are not correlated
    stream = torch.tensor([uniform_noise(7, p) for p in range(5000)])
    assert abs(torch.corrcoef(torch.stack([stream[:-1], stream[1:]]))[0, 1].item()) < 0.05


def test_inverse_cdf_picks_the_token_whose_interval_holds_u():
    scores = torch.log(torch.tensor([[0.25, 0.0, 0.5, 0.25]]))  # token 1 impossible
    for u, want in [(0.01, 0), (0.2499, 0), (0.2501, 2), (0.7499, 2), (0.7501, 3), (0.9999, 3)]:
        assert inverse_cdf(scores, torch.tensor([[u]])).tolist() == [want]


def test_different_positions_give_different_tokens(sampler):
    flat = torch.zeros(1, 1000)
    stream = [sampler.sample(flat, [make_input(seed=3, output=[0] * p)])[0][0] for p in range(20)]
    assert len(set(stream)) > 15


def test_different_seeds_give_different_streams(sampler):
    flat = torch.zeros(1, 1000)
    first = [sampler.sample(flat, [make_input(seed=1, output=[0] * p)])[0][0] for p in range(10)]
    second = [sampler.sample(flat, [make_input(seed=2, output=[0] * p)])[0][0] for p in range(10)]
    assert first != second


# --- distribution and filters ---------------------------------------------------------------------


def draw(sampler: Sampler, row: torch.Tensor, num_draws: int, **params) -> torch.Tensor:
    """Sample `row` once for each seed 0..num_draws-1, in one batch: counts per token [vocab]."""
    logits = row.unsqueeze(0).expand(num_draws, -1)
    inputs = [make_input(seed=seed, **params) for seed in range(num_draws)]
    chosen = torch.tensor(tokens(sampler.sample(logits, inputs)))
    return torch.bincount(chosen, minlength=row.shape[0])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_empirical_distribution_matches_softmax(sampler, temperature):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    num_draws = 4000
    counts = draw(sampler, row, num_draws, temperature=temperature).double()
    expected = torch.softmax(row.double() / temperature, dim=-1) * num_draws
    chi_square = (((counts - expected) ** 2) / expected).sum().item()
    assert chi_square < 24.3  # the 99.9% quantile of chi-square with 7 degrees of freedom


def test_filtered_distribution_is_the_renormalised_softmax(sampler):
    """top_k=4 with temperature 0.8: the 4 best tokens in proportion to softmax(row / 0.8)."""
    row = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.9, -0.2, 1.6, 0.0])
    num_draws = 4000
    counts = draw(sampler, row, num_draws, temperature=0.8, top_k=4).double()
    kept = row.topk(4).indices
    assert counts.sum() == counts[kept].sum() == num_draws
    expected = torch.softmax(row[kept].double() / 0.8, dim=-1) * num_draws
    chi_square = (((counts[kept] - expected) ** 2) / expected).sum().item()
    assert chi_square < 16.27  # the 99.9% quantile of chi-square with 3 degrees of freedom


# probabilities 0.4, 0.3, 0.2, 0.1 (and two tokens with almost none)
FILTER_ROW = torch.log(torch.tensor([0.1, 0.4, 1e-4, 0.2, 0.3, 1e-4]))


@pytest.mark.parametrize(
    "params, allowed",
    [
        (dict(top_k=2), {1, 4}),
        (dict(top_k=3), {1, 4, 3}),
        (dict(top_p=0.6), {1, 4}),  # 0.4 < 0.6, then 0.4 + 0.3 reaches it
        (dict(top_p=0.85), {1, 4, 3}),
        (dict(top_p=0.01), {1}),
        (dict(min_p=0.6), {1, 4}),  # keeps p >= 0.24
        (dict(min_p=0.3), {1, 4, 3}),  # keeps p >= 0.12
        (dict(top_k=3, top_p=0.5), {1, 4}),  # top_p on the renormalised top 3: 4/9 < 0.5
        (dict(top_k=3, min_p=0.6), {1, 4}),
        (dict(top_p=0.95, temperature=3.0), {0, 1, 3, 4}),
    ],
)
def test_filters_never_pick_outside_the_allowed_set(sampler, params, allowed):
    params.setdefault("temperature", 1.0)
    counts = draw(sampler, FILTER_ROW, 800, **params)
    picked = set(torch.nonzero(counts).flatten().tolist())
    assert picked == allowed  # nothing outside, and every allowed token does come up


def test_top_p_on_a_large_vocab_matches_a_full_sort(sampler):
    noise = torch.randn(2, 1000, generator=torch.Generator().manual_seed(4))
    # nearly flat: the cutoff lies beyond the first 256 candidates; peaked: within them
    rows = torch.stack([noise[0] * 0.3, noise[1] * 3.0])
    for row in rows:
        probs, order = torch.softmax(row, dim=-1).sort(descending=True)
        num_allowed = int(((probs.cumsum(dim=-1) - probs) < 0.9).sum())
        ranks = {token_id: rank for rank, token_id in enumerate(order.tolist())}
        picked = torch.nonzero(draw(sampler, row, 400, top_p=0.9)).flatten().tolist()
        assert max(ranks[t] for t in picked) < num_allowed
        if num_allowed > 600:
            assert max(ranks[t] for t in picked) > 300
    # a batch where one row needs the full sort and the other does not: same as each alone
    for seed in range(20):
        inputs = [make_input(seed=seed, top_p=0.9), make_input(seed=seed + 1, top_p=0.9)]
        batch = tokens(sampler.sample(rows, inputs))
        alone = [tokens(sampler.sample(rows[i : i + 1], [inputs[i]]))[0] for i in range(2)]
        assert batch == alone


def test_top_k_keeps_ties_with_the_kth(sampler):
    row = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0])
    counts = draw(sampler, row, 500, top_k=2)
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 2, 3}


# --- penalties and min_tokens ---------------------------------------------------------------------


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 0.0, 1.0], [2.0, -1.0, 0.5, -0.5, 0.0, 1.0]])
    inputs = [
        make_input(
            prompt=[0, 4],
            output=[1, 1, 3],
            repetition_penalty=2.0,
            presence_penalty=0.5,
            frequency_penalty=0.25,
        ),
        make_input(prompt=[0], output=[1]),  # no penalties: untouched
    ]
    scores = logits.clone()
    apply_penalties(scores, inputs)
    # repetition over prompt+output {0,1,3,4}: positive / 2, negative * 2, zero stays zero;
    # then output counts {1: 2, 3: 1}: minus 0.25 * count + 0.5 for presence (prompt not counted).
    expected = torch.tensor(
        [
            [1.0, -2.0 - 0.5 - 0.5, 0.5, -1.0 - 0.25 - 0.5, 0.0, 1.0],
            [2.0, -1.0, 0.5, -0.5, 0.0, 1.0],
        ]
    )
    assert torch.allclose(scores, expected)


def test_penalties_change_the_greedy_choice(sampler):
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    assert tokens(sampler.sample(logits, [make_input(output=[0], temperature=0.0)])) == [0]
    penalties = [
        dict(repetition_penalty=1.5),
        dict(presence_penalty=1.0),
        dict(frequency_penalty=1.0),
    ]
    for params in penalties:
        chosen = sampler.sample(logits, [make_input(output=[0], temperature=0.0, **params)])
        assert tokens(chosen) == [1], params
    # presence/frequency look at the output only; a token in the prompt is not penalised
    chosen = sampler.sample(logits, [make_input(prompt=[0], temperature=0.0, presence_penalty=1.0)])
    assert tokens(chosen) == [0]


def test_penalties_ignore_ids_outside_the_vocab():
    scores = torch.tensor([[1.0, -1.0, 2.0]])
    inputs = [
        make_input(prompt=[7, -1], output=[1, 1, 99], repetition_penalty=2.0, frequency_penalty=1.0)
    ]
    apply_penalties(scores, inputs)
    assert scores.tolist() == [[1.0, -4.0, 2.0]]


def test_min_tokens_blocks_eos_and_stop_ids(sampler):
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]])  # EOS (2) best, then stop id 3
    params = dict(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    assert tokens(sampler.sample(logits, [make_input(output=[1, 1], **params)])) == [4]
    assert tokens(sampler.sample(logits, [make_input(output=[1, 1, 1], **params)])) == [2]
    # ignore_eos: EOS does not stop the request, so it is not masked; stop ids still are
    ignoring = make_input(output=[1], ignore_eos=True, **params)
    assert tokens(sampler.sample(logits, [ignoring])) == [2]
    scores = logits.clone()
    apply_min_tokens(scores, [ignoring], [EOS])
    assert scores[0, 3] == float("-inf") and scores[0, 2] == 9.0


def test_min_tokens_holds_for_random_sampling(sampler):
    row = torch.tensor([0.0, 0.0, 5.0, 0.0])  # EOS nearly certain
    counts = draw(sampler, row, 300, min_tokens=1)
    assert counts[EOS] == 0 and counts.sum() == 300


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits(sampler, logits):
    inputs = [
        make_input(temperature=0.0, logprobs=3),
        make_input(seed=1, temperature=0.5, repetition_penalty=2.0, output=[0, 1], logprobs=5),
        make_input(seed=2, logprobs=0),
        make_input(seed=3),
        make_input(temperature=0.0, logprobs=100),  # more than the vocab: all of it
        make_input(seed=4, top_k=3, presence_penalty=1.0, logprobs=1),
    ]
    results = sampler.sample(logits.to(torch.bfloat16), inputs)
    expected = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    for row, ((token_id, logprob), inp) in enumerate(zip(results, inputs)):
        if inp.params.logprobs is None:
            assert logprob is None
            continue
        assert logprob.token_id == token_id
        assert math.isclose(logprob.logprob, expected[row, token_id].item(), abs_tol=1e-5)
        num_top = min(inp.params.logprobs, logits.shape[1])
        top = expected[row].topk(num_top)
        assert [t for t, _ in logprob.top] == top.indices.tolist()
        for (_, value), want in zip(logprob.top, top.values.tolist()):
            assert math.isclose(value, want, abs_tol=1e-5)


# --- a full-size batch ----------------------------------------------------------------------------


def test_full_size_mixed_batch(sampler):
    vocab = 49152
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=1),
        dict(temperature=1.0, top_k=50, seed=2),
        dict(temperature=0.7, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2, seed=3),
    ]
    inputs = [
        make_input(prompt=list(range(i, i + 500)), output=list(range(i, i + 100)), **kinds[i % 4])
        for i in range(64)
    ]
    results = sampler.sample(logits, inputs)
    assert len(results) == 64 and all(0 <= token_id < vocab for token_id, _ in results)
    greedy = [i for i in range(64) if i % 4 == 0]
    assert [results[i][0] for i in greedy] == logits[greedy].float().argmax(dim=-1).tolist()
    # top-k keeps the 50 best and anything tied with the 50th (bf16 logits tie often)
    kth = logits[2::4].float().topk(50).values[:, -1]
    assert all(logits[2 + 4 * j, results[2 + 4 * j][0]].float() >= kth[j] for j in range(16))
