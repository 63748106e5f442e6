"""Speculative decoding changes how fast an answer comes, never the answer: with proposals from
n-gram lookup, suffix trees or a draft model, every request's tokens and logprobs are those of
plain decoding, bit for bit, greedy and seeded sampling with penalties, logit_bias, min_tokens,
stop tokens and max_tokens cut inside a step, in bf16 (the default on this kind of CPU) and
float32, alone, batched, preempted, and resumed mid-answer; float32 greedy equals transformers'
own `generate`.

The draft model that proposes best is the target itself (every greedy proposal accepted), which
makes every step verify several tokens; a smaller random draft rejects most of its proposals,
which exercises the rollback; the n-gram and suffix proposers meet prompts that repeat a phrase
(a random model's greedy output falls into loops they catch)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.wire import SamplingParams
from tests.engine.tiny_models import VOCAB, build_wide_llama, greedy, random_prompt, run_to_completion
from kvfleet.worker.engine.kernels import cpu_attention
from kvfleet.worker.engine.attention import cpu_backend
from kvfleet.worker.engine.attention.cpu_backend import CpuBackend
from kvfleet.worker.engine.kernels.cpu_attention import CpuDecodePlan
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
from kvfleet.worker.engine.memory.kv_format import resolve_kv_format
from kvfleet.worker.engine.model.model_prep import shared_copy

DTYPES = ["bfloat16", "float32"]
PHRASE = random_prompt(12, seed=7)


@pytest.fixture(scope="module")
def wide_llama() -> torch.nn.Module:
    return build_wide_llama()


@pytest.fixture(scope="module")
def small_draft() -> torch.nn.Module:
    torch.manual_seed(99)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=64,
                         vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=2,
                         bos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def requests() -> list[tuple[list[int], SamplingParams]]:
    """Prompts that repeat a phrase (proposals hit) or not, with every sampling feature."""
    sampled = dict(temperature=0.9, top_p=0.9, top_k=50, ignore_eos=True, logprobs=2)
    out = []
    for i in range(10):
        prompt = random_prompt(5 + 3 * i, seed=i)
        if i % 2 == 0:
            prompt = prompt + PHRASE + random_prompt(4, seed=50 + i) + PHRASE[:6]
        params = [
            greedy(40, logprobs=3),
            greedy(40, repetition_penalty=1.3),
            SamplingParams(max_tokens=37, seed=11, **sampled),
            SamplingParams(max_tokens=40, seed=12, presence_penalty=0.5, frequency_penalty=0.3,
                           **sampled),
            greedy(40, logit_bias={int(PHRASE[3]): 5.0, 17: -100.0}),
            # EOS allowed after min_tokens; stop tokens: the answer ends inside a step
            SamplingParams(max_tokens=60, temperature=0.0, min_tokens=5,
                           stop_token_ids=[int(t) for t in PHRASE[8:11]]),
            greedy(3),  # ends inside its first verified step
            SamplingParams(max_tokens=40, seed=13, temperature=1.3, min_p=0.05, ignore_eos=True),
            greedy(40, num_speculative_tokens=0),  # speculation off for this one
            greedy(40, num_speculative_tokens=2),
        ][i]
        out.append((prompt, params))
    return out


def run(engine: Engine, reqs, sent: list[list[int]] | None = None
        ) -> dict[int, tuple[list[int], list]]:
    """Each request's tokens and logprobs (as (token, logprob, top) triples)."""
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(f"r{i}", prompt, params,
                           output_token_ids=None if sent is None else sent[i])
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(reqs))}
    logprobs: dict[str, list] = {f"r{i}": [] for i in range(len(reqs))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.req_id].extend(out.new_token_ids)
            logprobs[out.req_id].extend((lp.token_id, lp.logprob, lp.top)
                                        for lp in out.new_logprobs or [])
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return {i: (tokens[f"r{i}"], logprobs[f"r{i}"]) for i in range(len(reqs))}


def make_engine(model, dtype: str, spec: dict | None, draft=None, **config) -> Engine:
    config = {"device": "cpu", "dtype": dtype, "block_size": 16, "num_blocks": 128,
              "speculative_config": spec, **config}
    return Engine(shared_copy(model), EngineConfig(**config),
                  draft_model=None if draft is None else copy.deepcopy(draft))


# adaptive off: every step verifies what the proposer has (the cost rule is tested on its own)
SPECS = {
    "ngram": ({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}, None),
    "suffix": ({"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}, None),
    "draft=target": ({"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
                     "self"),
    "small draft": ({"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False},
                    "small"),
}


def drafts_for(name, wide_llama, small_draft):
    spec, draft = SPECS[name]
    return spec, {"self": wide_llama, "small": small_draft, None: None}[draft]


@pytest.fixture(scope="module")
def plain(wide_llama) -> dict[str, dict]:
    """Every request's answer without speculation, per dtype (the reference)."""
    return {dtype: run(make_engine(wide_llama, dtype, None), requests()) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_answers_are_those_of_plain_decoding(wide_llama, small_draft, plain, dtype, name):
    spec, draft = drafts_for(name, wide_llama, small_draft)
    engine = make_engine(wide_llama, dtype, spec, draft)
    got = run(engine, requests())
    for i, want in plain[dtype].items():
        assert got[i] == want, f"request {i} differs with {name} speculation at {dtype}"
    stats = engine.speculation.speculator.stats
    assert stats.num_drafts > 0, stats
    if name != "small draft":  # an unrelated random draft is (almost) never right: rollbacks
        assert stats.num_accepted_tokens > 0, stats
    if name == "draft=target":  # a perfect draft: most steps accept several tokens
        assert stats.num_accepted_tokens > len(requests()) * 10, stats
        assert stats.accepted_per_position[2] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_with_chunked_prompts_and_preemption(wide_llama, plain, dtype):
    """A tight pool (preemption by recompute and by swap) and small prefill chunks beside the
    verified steps: still every answer of plain decoding."""
    for preemption in ("recompute", "swap"):
        engine = make_engine(wide_llama, dtype, SPECS["draft=target"][0], wide_llama,
                             num_blocks=14, max_batched_tokens=24, preemption=preemption)
        got = run(engine, requests())
        assert engine.scheduler.num_preemptions > 0
        assert got == plain[dtype], preemption


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["ngram", "draft=target"])
def test_a_resumed_request_continues_identically(wide_llama, small_draft, plain, dtype, name):
    """Resumed on another worker mid-answer (prompt + the tokens sent), with speculation: the
    rest of the answer is plain decoding's."""
    reqs = requests()
    sent = [want[0][:len(want[0]) // 2] for want in plain[dtype].values()]
    spec, draft = drafts_for(name, wide_llama, small_draft)
    got = run(make_engine(wide_llama, dtype, spec, draft), reqs, sent=sent)
    for i, (tokens, _) in plain[dtype].items():
        assert sent[i] + got[i][0] == tokens, f"request {i}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_float32_greedy_equals_transformers_generate(tiny_llama, small_draft, name):
    spec, draft = SPECS[name]
    draft = {"self": tiny_llama.model, "small": small_draft, None: None}[draft]
    engine = Engine(copy.deepcopy(tiny_llama.model),
                    EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=4,
                                 speculative_config=spec),
                    draft_model=None if draft is None else copy.deepcopy(draft))
    prompts = [random_prompt(6, seed=1) * 3, random_prompt(11, seed=2), PHRASE * 2]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, greedy(48))
    produced = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert produced[f"g{i}"] == tiny_llama.reference(prompt, 48), f"prompt {i}"
    assert engine.speculation.speculator.stats.num_drafts > 0


def test_speculation_never_preempts_and_frees_rejected_slots(wide_llama, small_draft):
    """A proposal's slots are reserved only where free blocks hold them; after each step a
    stream holds the blocks of its known tokens only."""
    engine = make_engine(wide_llama, "float32", SPECS["small draft"][0], small_draft, num_blocks=6)
    engine.add_request("a", PHRASE * 3, greedy(40))
    while engine.has_unfinished():
        engine.step()
        seq = engine._seqs.get("a")
        if seq is not None:
            held = len(engine.block_manager.block_table("a"))
            assert held == engine.block_manager.blocks_for_tokens(seq.num_tokens)
    assert engine.scheduler.num_preemptions == 0


def test_the_cost_rule_backs_off_in_a_large_batch():
    """With steps that cost per row as much as they cost per step, no proposal pays; with
    weight-bound steps (a >> b) proposals of likely streams do."""
    from kvfleet.shared.engine_config import SpeculativeConfig
    from kvfleet.worker.engine.core.sequence import Sequence
    from kvfleet.worker.engine.speculation.speculator import Speculator, StepCost

    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 512)
    limits = {f"r{i}": 4 for i in range(64)}
    for rows, seconds in [(64, 0.064), (128, 0.128), (96, 0.096)] * 5:  # 1 ms per row, no base
        spec.cost.observe(rows, seconds)
    assert spec._choose(limits, 64, 64) == {}

    class Unasked:  # where nothing can pay, the proposer is not even asked
        def propose(self, *args):
            raise AssertionError("proposed where no proposal could pay")

    spec.proposer = Unasked()
    decoding = [Sequence(f"r{i}", [5, 6, 7], greedy(100)) for i in range(64)]
    assert spec.plan(decoding, 64) == {}
    spec.cost = StepCost()
    for rows, seconds in [(1, 0.020), (8, 0.021), (4, 0.0205)] * 5:  # 20 ms a step, 0.14 per row
        spec.cost.observe(rows, seconds)
    chosen = spec._choose({"r0": 4}, 1, 1)
    assert chosen == {"r0": 4}


class KernelRows:
    """Which attention kernel computed which query rows of the target model's forwards, against
    the rows each forward verifies (a chunk's last known token and its proposals). A kernel's
    rows are those it writes in layer 0's output (the others are NaN during its call); the
    draft model's forwards, in a pool of their own, are not counted."""

    KERNELS = {"paged_decode": "decode kernel", "paged_prefill": "prefill kernel",
               "prefill_attention": "sdpa", "amx_attention": "amx tiles"}
    ROW_FORM = "prefill kernel's row form"  # paged_prefill(..., rows=True)
    LABELS = (*KERNELS.values(), ROW_FORM)

    def __init__(self, engine: Engine, monkeypatch):
        self.pool = engine.pool
        self.steps: list[dict[str, set[int]]] = []
        backend = engine.attention_backend
        build = backend.build_metadata

        def build_metadata(geometry, write_index, decodes, prefills):
            verified, row = set(), 0
            for chunk in decodes + prefills:  # the forward's row order
                if chunk.num_draft:
                    verified.update(range(row, row + chunk.num_tokens))
                row += chunk.num_tokens
            self.steps.append({"verified": verified, **{k: set() for k in self.LABELS}})
            return build(geometry, write_index, decodes, prefills)

        monkeypatch.setattr(backend, "build_metadata", build_metadata)
        for name, kernel in self.KERNELS.items():
            monkeypatch.setattr(cpu_backend, name, self._spy(getattr(cpu_backend, name), kernel))

    def _spy(self, computes, kernel: str):
        signature = inspect.signature(computes)

        def spy(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            if arguments["pool"] is not self.pool or arguments["layer"] != 0:
                return computes(*args, **kwargs)
            out = arguments["out"]  # [T, H, D]: row t is the forward's query row t
            assert out.dim() == 3, out.shape
            kept = out.clone()
            out.fill_(float("nan"))
            computes(*args, **kwargs)
            written = ~torch.isnan(out).flatten(1).all(dim=1)
            out[~written] = kept[~written]
            label = self.ROW_FORM if arguments.get("rows") else kernel
            self.steps[-1][label].update(torch.nonzero(written).flatten().tolist())

        return spy

    def rows(self, kernel: str) -> tuple[int, int]:
        """(verified rows the kernel computed, every row it computed), over all forwards."""
        return (sum(len(s["verified"] & s[kernel]) for s in self.steps),
                sum(len(s[kernel]) for s in self.steps))


def test_without_deterministic_numerics_verified_rows_take_another_kernel(wide_llama, plain,
                                                                         monkeypatch):
    """The negative control, first half (what --deterministic changes, on every CPU): with the
    default every row of every forward is computed in the decode kernel's form (on AMX CPUs in
    bf16 the tile kernel): decodes by the decode kernel, rows of several-token chunks by it too or,
    in bf16 on AVX512-BF16 CPUs, by the prefill kernel's row form (the decode kernel's bits,
    tests/engine/test_cpu_attention.py), a verified row too, as plain decoding computes it, and
    the answers are plain decoding's; with
    --no-deterministic every verified row is computed by the prefill path instead: the prefill
    kernel where it runs (AVX-512 with AVX512-BF16), else SDPA; both are taken here. Either sums
    a row's q.k in another order than the decode kernel (cpu_prefill.cpp: a row's dimensions in
    one lane; the decode kernel: across SIMD lanes, then a tree; SDPA: its GEMMs'), and another
    order can be another value (the test below constructs one). Whether this model's bf16
    answers then drift is the CPU's rounding luck (they did not on an Intel Xeon with AMX): not
    asserted. The verified rows are counted from what each kernel writes (KernelRows)."""
    spec, draft = drafts_for("draft=target", wide_llama, None)
    for deterministic, prefill_path in ((True, "kernel where it runs"),
                                        (False, "kernel where it runs"), (False, "sdpa")):
        with monkeypatch.context() as patch:
            if prefill_path == "sdpa":
                patch.setattr(cpu_attention, "prefill_supported", lambda *args: False)
            engine = make_engine(wide_llama, "bfloat16", spec, draft, deterministic=deterministic)
            assert isinstance(engine.attention_backend, CpuBackend), engine.device_report()
            spy = KernelRows(engine, patch)
            got = run(engine, requests())
        label = f"deterministic={deterministic}, prefill {prefill_path}"
        stats = engine.speculation.speculator.stats
        total = sum(len(step["verified"]) for step in spy.steps)
        # every verified chunk was seen (its last known token and its proposals), many of them
        assert total == stats.num_drafts + stats.num_draft_tokens > 10 * len(requests()), stats
        verified = {kernel: spy.rows(kernel)[0] for kernel in KernelRows.LABELS}
        computed = {kernel: spy.rows(kernel)[1] for kernel in KernelRows.LABELS}
        if deterministic:
            assert engine.invariance_gap is None, engine.invariance_gap
            # the invariant form: the tile kernel on AMX CPUs, else the decode kernel's (with the
            # prefill kernel's row form where it runs)
            backend = engine.attention_backend
            forms = (["amx tiles"] if backend.amx_tiles else
                     ["decode kernel", KernelRows.ROW_FORM] if backend.prefill_rows
                     else ["decode kernel"])
            assert sum(verified[form] for form in forms) == total, (label, verified)
            if backend.prefill_rows:  # verification chunks are several rows: the row form's
                assert verified[KernelRows.ROW_FORM] > 0, (label, verified)
            # nothing else runs at all: prompt rows are that form's rows too
            assert sum(n for kernel, n in computed.items() if kernel not in forms) == 0, (
                label, computed)
            assert got == plain["bfloat16"]
        else:
            assert engine.invariance_gap == "--no-deterministic"
            path = "prefill kernel" if engine.attention_backend.prefill_kernel else "sdpa"
            assert prefill_path != "sdpa" or path == "sdpa"
            assert verified["decode kernel"] == verified["amx tiles"] == 0, (label, verified)
            assert verified[path] == total, (label, verified)


def test_the_same_row_summed_in_another_order_is_another_value():
    """The negative control, second half, constructed so that no CPU's rounding decides it:
    the decode kernel sums a row's P.V over its keys in their order (fp32 accumulators, one
    lane per dimension; bf16 with AVX512-BF16: two keys per vdpbf16ps), so the same row with
    its pages swapped in the block table is the same sum in another order. q = 0: every score
    is 0, every probability exp(0) = 1 (exact in bf16), every product exact. Dimension 0 of the
    values: 2^25, 0, 1, 0 in one page and -2^25, 0, 0, 0 in the other (every other key, and
    every other dimension, 0: a vdpbf16ps pair holds one nonzero product at most). Their sum is
    1 exactly, and the output 1/8; in page order 2^25 + 1 rounds to 2^25 (half an ulp of 2^25
    is 2) and the -2^25 after it leaves 0; with the pages swapped -2^25 + 2^25 = 0 comes first
    and the 1 survives. The same order twice is the same value, bit for bit."""
    assert cpu_attention.unavailable_reason() is None, cpu_attention.unavailable_reason()
    dim, block = 64, 4
    pool = KVCachePool(KVLayout(1, 1, dim, resolve_kv_format("auto", torch.bfloat16)), 2, block,
                       torch.device("cpu"))
    kv = pool.layer(0)  # [2 (K, V), kv heads, blocks, block size, dim]
    kv.zero_()
    kv[1, 0, 0, :, 0] = torch.tensor([2.0 ** 25, 0, 1, 0])
    kv[1, 0, 1, :, 0] = torch.tensor([-2.0 ** 25, 0, 0, 0])
    query = torch.zeros(1, 1, dim, dtype=torch.bfloat16)  # [heads, rows, dim]

    def attend(pages: list[int]) -> torch.Tensor:
        out = torch.full((1, 1, dim), float("nan"), dtype=torch.bfloat16)  # [rows, heads, dim]
        plan = CpuDecodePlan(1, torch.tensor([pages], dtype=torch.int32),
                             torch.tensor([2 * block], dtype=torch.int32))
        cpu_attention.paged_decode(query, pool, 0, plan, dim ** -0.5, out)
        return out[0, 0]

    in_order, swapped = attend([0, 1]), attend([1, 0])
    assert in_order[0].item() == 0.0
    assert swapped[0].item() == 0.125  # the exact sum: 1 / 8 keys
    assert torch.equal(in_order[1:], swapped[1:]) and not in_order[1:].any()
    assert torch.equal(attend([0, 1]), in_order) and torch.equal(attend([1, 0]), swapped)


@pytest.mark.parametrize("name", ["ngram", "draft=target"])
def test_float32_greedy_without_deterministic(tiny_llama, name):
    spec, draft = SPECS[name]
    engine = Engine(copy.deepcopy(tiny_llama.model),
                    EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=4,
                                 deterministic=False, speculative_config=spec),
                    draft_model=None if draft is None else copy.deepcopy(tiny_llama.model))
    prompts = [random_prompt(6, seed=1) * 3, PHRASE * 2]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, greedy(40))
    produced = run_to_completion(engine)
    assert [produced[f"g{i}"] for i in range(2)] == [tiny_llama.reference(p, 40) for p in prompts]

