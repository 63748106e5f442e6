"""One answer per (prompt, parameters, seed) at the default `--deterministic`: a request's tokens
*and logprobs* are bit-identical alone, in a batch (sharing a prefix another request computes in
the same step, or not), with its prompt chunked, after a prefix-cache hit, after a preemption (recompute or swap) and when it resumes from a checkpoint as prompt +
tokens already sent (what a worker does after another died), in bf16 and float32.

The model is a tiny Llama whose heads are 64 wide (the C++ kernels' vectorised paths) with
transformers' default initialisation, so its logits are close together as a real model's are.
Tokens and logprobs alone are a blunt check on so small a model (bf16 logits are coarse), so every
case also compares the final norm's output at every position computed, keyed by the tokens up to
it: thousands of bf16 rows, each of which a single different rounding anywhere below it shows in."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet.shared.wire import SamplingParams
from tests.engine.kernel_variants import build_variant
from tests.engine.tiny_models import build_wide_llama, random_prompt, run_to_completion
from kvfleet.worker.engine.kernels import cpu_kernels, cpu_linear
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.kernels.kernel_binding import BoundKernel
from kvfleet.worker.engine.model.model_prep import shared_copy
from kvfleet.worker.engine.core.scheduler import SchedulerOutput

DTYPES = [torch.bfloat16, torch.float32]
MAX_TOKENS = 24
NUM_REQUESTS = 10
COMMON = random_prompt(40, seed=99)  # a shared opening: the prefix cache's hits


@pytest.fixture(scope="module")
def wide_heads_llama() -> torch.nn.Module:
    return build_wide_llama()


def requests() -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded requests of different lengths, half of them after the common opening."""
    out = []
    for i in range(NUM_REQUESTS):
        prompt = random_prompt(9 + 7 * i, seed=i)
        if i % 2:
            prompt = COMMON + prompt
        params = (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
                  if i < 7 else
                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=100 + i,
                                 ignore_eos=True, logprobs=3))
        out.append((prompt, params))
    return out


class FinalHiddenStates:
    """The final norm's output row of every position an engine computes, keyed by the tokens up
    to and including it (the same key whichever request, batch or chunk computed it)."""

    def __init__(self, engine: Engine):
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        self._keys: list[tuple[int, ...]] = []
        execute = engine.runner.execute

        def recording(sched: SchedulerOutput):
            # the forward's row order (model_runner.plan_step): decodes by context, then prefills
            decodes = sorted((c for c in sched.chunks if c.num_tokens == 1), key=lambda c: c.end)
            self._keys = [tuple(c.seq.token_ids[:pos + 1])
                          for c in decodes + [c for c in sched.chunks if c.num_tokens > 1]
                          for pos in range(c.start, c.end)]
            return execute(sched)

        engine.runner.execute = recording
        engine.model.model.norm.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        for key, row in zip(self._keys, output[0], strict=True):
            self.rows[key] = row.clone()

    def assert_same_as(self, reference: FinalHiddenStates, case: str) -> None:
        shared = self.rows.keys() & reference.rows.keys()
        assert len(shared) >= NUM_REQUESTS * MAX_TOKENS // 2, case
        differing = [k for k in shared if not torch.equal(self.rows[k], reference.rows[k])]
        assert not differing, f"{case}: {len(differing)} of {len(shared)} positions differ"


def make_engine(model, dtype, **config) -> Engine:
    config = {"device": "cpu", "dtype": str(dtype).removeprefix("torch."), "block_size": 16,
              "num_blocks": 256, **config}
    engine = Engine(shared_copy(model), EngineConfig(**config))
    engine.hidden = FinalHiddenStates(engine)
    return engine


def run(engine: Engine, reqs, prefix: str = "r",
        sent: list[list[int]] | None = None) -> dict[int, tuple[list[int], list]]:
    """Each request's tokens and logprobs, run together in `engine`; `sent`: each resumes after
    these output tokens, as a worker resumes a checkpoint."""
    logprobs: dict[str, list] = {}
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(f"{prefix}{i}", prompt, params,
                           output_token_ids=None if sent is None else sent[i])
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.req_id, []).extend(out.new_logprobs or [])
    return {i: (tokens[f"{prefix}{i}"], logprobs[f"{prefix}{i}"]) for i in range(len(reqs))}


def alone(model, dtype, reqs, **config) -> tuple[dict, FinalHiddenStates]:
    """Every request in an engine of its own, its prompt in one chunk: the reference answers and
    hidden states."""
    results, hidden = {}, None
    for i, req in enumerate(reqs):
        engine = make_engine(model, dtype, **config)
        results[i] = run(engine, [req])[0]
        if hidden is None:
            hidden = engine.hidden
        else:
            hidden.rows.update(engine.hidden.rows)
    return results, hidden


@pytest.fixture(scope="module", params=DTYPES, ids=["bf16", "float32"])
def reference(request, wide_heads_llama):
    dtype = request.param
    return (dtype, *alone(wide_heads_llama, dtype, requests()))


def test_the_engine_reports_itself_batch_invariant_by_default(wide_heads_llama):
    engine = make_engine(wide_heads_llama, torch.bfloat16)
    assert engine.config.deterministic and engine.invariance_gap is None
    assert engine.device_report().endswith("; batch-invariant")
    # an engine over another's prepared model (its layers already fused) says the same
    again = Engine(engine.model, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64))
    assert again.invariance_gap is None
    off = make_engine(wide_heads_llama, torch.bfloat16, deterministic=False)
    assert off.invariance_gap == "--no-deterministic"
    assert "not batch-invariant: --no-deterministic" in off.device_report()


@pytest.mark.parametrize("case", ["batched", "batched_uncached", "chunked", "cache_hit",
                                  "recompute", "swap"])
def test_every_request_gets_its_lone_answer_bit_for_bit(reference, wide_heads_llama, case):
    dtype, expected, hidden = reference
    reqs = requests()
    config = {"batched_uncached": {"enable_prefix_caching": False},
              "chunked": {"max_batched_tokens": 16},  # prefills cut into chunks beside decodes
              "recompute": {"num_blocks": 14, "preemption": "recompute"},
              "swap": {"num_blocks": 14, "preemption": "swap", "swap_space": "64MiB"}}.get(case, {})
    engine = make_engine(wide_heads_llama, dtype, **config)
    if case == "cache_hit":  # the common opening cached first: later prompts start after it
        run(engine, [(COMMON + [7], SamplingParams(max_tokens=1, temperature=0.0))], prefix="w")
    got = run(engine, reqs)
    stats = engine.stats()
    if case == "cache_hit":
        assert stats.prefix_hit_tokens >= len(COMMON) // 16 * 16 * (NUM_REQUESTS // 2)
    if case == "batched":  # admitted in one step: the later ones share the opening's blocks
        # the first computes in that step (scheduler.py, prefix sharing within a step)
        assert stats.prefix_hit_tokens == len(COMMON) // 16 * 16 * (NUM_REQUESTS // 2 - 1)
    if case == "batched_uncached":
        assert stats.prefix_hit_tokens == 0
    if case in ("recompute", "swap"):
        assert stats.num_preemptions > 0
        assert (stats.num_swap_preemptions > 0) is (case == "swap")
    for i in expected:
        assert got[i] == expected[i], f"request {i} ({case}, {dtype})"
    engine.hidden.assert_same_as(hidden, f"{case}, {dtype}")


def test_a_resumed_request_continues_bit_for_bit(reference, wide_heads_llama):
    """What a worker does after another died: the prompt and the tokens already sent computed in
    one prefill, the seeded stream continued at its position."""
    dtype, expected, hidden = reference
    reqs = requests()
    engine = make_engine(wide_heads_llama, dtype)
    for k in (1, 9, MAX_TOKENS - 3):
        got = run(engine, reqs, prefix=f"k{k}-", sent=[expected[i][0][:k] for i in expected])
        for i in expected:
            assert got[i][0] == expected[i][0][k:], f"request {i} resumed after {k} ({dtype})"
            assert got[i][1] == expected[i][1][k:], f"request {i} resumed after {k} ({dtype})"
    engine.hidden.assert_same_as(hidden, f"resumed, {dtype}")


@pytest.fixture
def bf16_dot_form(monkeypatch):
    """kvfleet's bf16 product in its vdpbf16ps form for one test (cpu_linear.bf16_form)."""
    monkeypatch.setenv("KVFLEET_CPU_BF16_PRODUCT", "dot")
    cpu_linear.bf16_form.cache_clear()
    yield
    monkeypatch.delenv("KVFLEET_CPU_BF16_PRODUCT")
    cpu_linear.bf16_form.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_deterministic_the_same_checks_see_a_difference(wide_heads_llama, dtype,
                                                                bf16_dot_form):
    """The checks above are sharp enough to fail: with `--no-deterministic`, a resumed request's
    sent tokens are prefill rows (the prefill kernel, or SDPA: another reduction order) where the
    uninterrupted run computed them as decode rows, and hidden states differ. In bf16 the two
    attention paths mostly round to the same values: with the products in their vdpbf16ps form
    19 of 675 positions differ, with their fp32-FMA form (taken where it is faster) none of
    this model's do (measured on a Xeon without AMX), so bf16 is shown in the first form."""
    reqs = requests()
    expected, hidden = alone(wide_heads_llama, dtype, reqs, deterministic=False)
    engine = make_engine(wide_heads_llama, dtype, deterministic=False)
    run(engine, reqs, sent=[expected[i][0][:MAX_TOKENS - 3] for i in expected])
    with pytest.raises(AssertionError, match="positions differ"):
        engine.hidden.assert_same_as(hidden, "--no-deterministic")


# ---- the portable product (cpu_matmul.cpp without AVX-512) -----------------------------------------

def build_portable(directory, scalar: bool) -> BoundKernel:
    """cpu_matmul.cpp built as on a CPU without AVX-512 (KVFLEET_MATMUL_PORTABLE): its AVX2 form
    where the CPU has AVX2, or (`scalar`) its plain C++ form."""
    return build_variant("matmul", directory, ("KVFLEET_MATMUL_PORTABLE",)
                         + (("KVFLEET_MATMUL_SCALAR",) if scalar else ()))


@pytest.fixture(scope="module")
def portable_matmuls(tmp_path_factory) -> list[BoundKernel]:
    directory = tmp_path_factory.mktemp("portable")
    return [build_portable(directory, scalar=False), build_portable(directory, scalar=True)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_portable_product_is_exact_to_a_rounding_and_batch_invariant(portable_matmuls, dtype):
    """Both forms (vectorised, plain C++) within a rounding of the exact product, every row's
    result the same alone or in any batch and with 1 or 2 threads, and the two forms equal bit
    for bit (the same fused multiply-adds in the same order)."""
    code = {torch.float32: 0, torch.bfloat16: 1}[dtype]
    torch.manual_seed(8)
    n, k = 83, 301  # a partial last block; an odd column count (bf16: a half-empty last pair)
    weight, bias = torch.randn(n, k).to(dtype), torch.randn(n)
    per = 2 if dtype == torch.bfloat16 else 1
    x = torch.randn(13, k).to(dtype)
    exact = x.double() @ weight.double().T + bias.double()
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    results = []
    for matmul in portable_matmuls:
        assert matmul.kvfleet_linear_supported(code) == 2
        packed = torch.empty(math.ceil(n / 16) * math.ceil(k / per) * per * 16, dtype=dtype)
        assert matmul.kvfleet_pack_linear(code, weight.data_ptr(), n, k, packed.data_ptr(), 1) == 0

        def product(rows: torch.Tensor, threads: int) -> torch.Tensor:
            y = torch.empty(rows.shape[0], n, dtype=dtype)
            assert matmul.kvfleet_linear(code, rows.data_ptr(), rows.shape[0], k, k,
                                         packed.data_ptr(), n, bias.data_ptr(),
                                         y.data_ptr(), n, threads) == 0
            return y

        batch = product(x, 2)
        assert (batch.double() - exact).abs().max().item() <= tolerance * exact.abs().max().item()
        for i in range(x.shape[0]):
            assert torch.equal(product(x[i:i + 1].clone(), 1), batch[i:i + 1])
        # row groups of every tile height the product takes (6, 3 and 1 rows)
        for rows in (slice(3, 9), slice(0, 5), slice(2, 11), slice(1, 13)):
            assert torch.equal(product(x[rows].clone(), 2), batch[rows])
        results.append(batch)
    assert torch.equal(results[0], results[1])


def _fma_form_builds() -> bool:
    matmul = cpu_kernels.matmul_kernel()
    return (not isinstance(matmul, cpu_kernels.UnavailableKernel)
            and matmul.kvfleet_linear_supported(2) == 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_products_equal_one_product_per_group(portable_matmuls, dtype):
    """kvfleet_linear_groups (a mixture-of-experts layer's experts in one call) in both portable
    forms: each group's rows equal kvfleet_linear's for that group alone; empty groups skipped."""
    code = {torch.float32: 0, torch.bfloat16: 1}[dtype]
    torch.manual_seed(9)
    n, k, per = 40, 67, 2 if dtype == torch.bfloat16 else 1
    size = math.ceil(n / 16) * 16 * math.ceil(k / per) * per
    offsets = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int64)  # group 1 has no rows
    x = torch.randn(int(offsets[-1]), k).to(dtype)
    for matmul in portable_matmuls:
        packed = torch.empty(4, size, dtype=dtype)
        for g in range(4):
            weight = torch.randn(n, k).to(dtype)
            assert matmul.kvfleet_pack_linear(code, weight.data_ptr(), n, k,
                                              packed[g].data_ptr(), 1) == 0
        addresses = torch.tensor([packed[g].data_ptr() for g in range(4)], dtype=torch.int64)
        y = torch.full((x.shape[0], n), 7.0).to(dtype)
        assert matmul.kvfleet_linear_groups(code, x.data_ptr(), k, k, offsets.data_ptr(),
                                            addresses.data_ptr(), 4, n, y.data_ptr(), n, 2) == 0
        for g in range(4):
            first, last = int(offsets[g]), int(offsets[g + 1])
            alone = torch.empty(last - first, n, dtype=dtype)
            assert matmul.kvfleet_linear(code, x[first:last].data_ptr(), last - first, k, k,
                                         packed[g].data_ptr(), n, None, alone.data_ptr(), n,
                                         1) == 0
            assert torch.equal(y[first:last], alone), g


@pytest.mark.skipif(not _fma_form_builds(), reason="the bf16 FMA form needs AVX512-BF16")
def test_the_bf16_fma_form_sums_as_the_portable_product_does(portable_matmuls):
    """kvfleet's bf16 product in its fp32-FMA form (dtype 2) computes the portable product's
    sums bit for bit, at every tile shape (1-4 rows, 8-row tiles and their tails) and an odd k."""
    torch.manual_seed(9)
    n, k = 83, 301
    weight, bias = torch.randn(n, k).to(torch.bfloat16), torch.randn(n)
    packed = torch.empty(math.ceil(n / 16) * math.ceil(k / 2) * 2 * 16, dtype=torch.bfloat16)
    native = cpu_kernels.matmul_kernel()

    def product(matmul, code: int, rows: torch.Tensor) -> torch.Tensor:
        assert matmul.kvfleet_pack_linear(code, weight.data_ptr(), n, k, packed.data_ptr(), 1) == 0
        y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        assert matmul.kvfleet_linear(code, rows.data_ptr(), rows.shape[0], k, k, packed.data_ptr(),
                                     n, bias.data_ptr(), y.data_ptr(), n, 2) == 0
        return y

    for m in (1, 3, 4, 5, 8, 13, 21):
        x = torch.randn(m, k).to(torch.bfloat16)
        portable = product(portable_matmuls[0], 1, x)
        assert torch.equal(product(native, 2, x), portable), m
