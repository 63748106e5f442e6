"""The engine's model preparation (model_prep.py): its own copy, weights shared, the caller's model
never changed; a draft model through the same path; the seam where adapters add terms."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.engine.tiny_models import build_model, greedy, random_prompt
from kvfleet.worker.engine.core.config import EngineConfig
from kvfleet.worker.engine.model.cpu_layers import FusedDecoderLayer
from kvfleet.worker.engine.kernels.cpu_linear import KernelLinear, PackedLinear, SiblingLinear
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.engine.model.model_prep import add_linear_term, linear_products, prepare_model, shared_copy

PROMPTS = [random_prompt(n, seed=70 + i) for i, n in enumerate([6, 17])]


def engine_on(model, **config) -> Engine:
    config = {"device": "cpu", "dtype": "float32", "num_blocks": 64, "block_size": 4, **config}
    return Engine(model, EngineConfig(**config))


def hf_logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([PROMPTS[1]])).logits


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_shared_copy_has_new_modules_over_the_same_weights(tiny):
    model = copy.deepcopy(tiny.model)
    twin = shared_copy(model)
    for (name, a), (_, b) in zip(model.named_modules(), twin.named_modules()):
        assert a is not b, name
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert a is not b and a.data_ptr() == b.data_ptr(), name
    assert twin.config is not model.config
    assert twin.model.layers[0].self_attn.config is twin.config  # one config in the copy
    twin.to(torch.bfloat16)  # the copy's cast leaves the model's weights alone
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_an_engine_leaves_its_model_unchanged_and_shares_its_weights(tiny, backend):
    """Fused on CPU or HF's layers under SDPA: the model's layers, attention and outputs are what
    they were, its untouched weights are the engine's (not a second copy), and both engines
    give HF generate's greedy tokens in float32."""
    model = copy.deepcopy(tiny.model)
    layer_types = [type(m) for m in model.modules()]
    attention, logits = model.config._attn_implementation, hf_logits(model)
    engine = engine_on(model, attention_backend=backend)
    assert (engine.prepared.num_fused_layers > 0) == (backend == "cpu")
    assert [type(m) for m in model.modules()] == layer_types
    assert model.config._attn_implementation == attention
    assert torch.equal(hf_logits(model), logits)
    for name in ("model.embed_tokens", "model.norm"):
        ours, theirs = engine.model.get_submodule(name).weight, model.get_submodule(name).weight
        assert ours.data_ptr() == theirs.data_ptr(), name
    produced = engine.generate(PROMPTS, greedy(10))
    assert produced == [hf_greedy(model, p, 10) for p in PROMPTS]


def test_an_engine_in_another_dtype_casts_its_copy_only(tiny):
    model = copy.deepcopy(tiny.model)
    engine = engine_on(model, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_draft_model_goes_through_the_same_preparation(tiny):
    draft = build_model(tiny.family, num_hidden_layers=1).eval()
    layer_types = [type(m) for m in draft.modules()]
    engine = Engine(copy.deepcopy(tiny.model),
                    EngineConfig(device="cpu", dtype="float32", num_blocks=64, block_size=4),
                    draft_model=draft)
    assert engine.speculation.prepared.num_fused_layers == engine.prepared.num_fused_layers // 2 == 1
    assert type(engine.speculation.prepared.module.model.layers[0]) is FusedDecoderLayer
    assert [type(m) for m in draft.modules()] == layer_types
    assert (engine.speculation.prepared.module.model.embed_tokens.weight.data_ptr()
            == draft.model.embed_tokens.weight.data_ptr())


def kinds_of(model) -> dict[str, torch.nn.Module]:
    """One linear of each kind: a fused layer's products, a sibling, a packed linear."""
    kinds = {}
    for name, module in linear_products(model).items():
        kind = type(module).__name__
        if ".qkv" in name or ".gate_up" in name:
            kind = "fused layer " + kind
        kinds.setdefault(kind, module)
    return kinds


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_a_term_changes_every_kind_of_linear_and_its_removal_restores_it(tiny, backend):
    model = engine_on(copy.deepcopy(tiny.model), attention_backend=backend).model
    kinds = kinds_of(model)
    packed = (KernelLinear, PackedLinear)
    if backend == "cpu":
        assert any(k.startswith("fused layer") for k in kinds), kinds
    else:
        assert any(isinstance(m, SiblingLinear) for m in kinds.values()), kinds
    assert any(isinstance(m, packed) for m in kinds.values()), kinds
    generator = torch.Generator().manual_seed(3)
    for kind, linear in kinds.items():
        x = torch.randn(3, linear.in_features, generator=generator)
        a = torch.randn(linear.in_features, 2, generator=generator)
        b = torch.randn(2, linear.out_features, generator=generator)
        before = linear(x).clone()
        handle = add_linear_term(linear, lambda rows: rows @ a @ b)
        assert torch.allclose(linear(x), before + x @ a @ b, atol=1e-4), kind
        handle.remove()
        assert torch.equal(linear(x), before), kind


def test_terms_on_every_linear_change_the_engine_and_leave_no_trace(tiny):
    # no prefix cache: blocks computed under the terms would be found by the last run
    engine = engine_on(copy.deepcopy(tiny.model), enable_prefix_caching=False)
    params = greedy(8, logprobs=2)

    def run() -> list:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}-{run.calls}", prompt, params)
        run.calls += 1
        outputs = []
        while engine.has_unfinished():
            outputs += [(o.req_id[:2], o.new_token_ids, o.new_logprobs) for o in engine.step()]
        return outputs

    run.calls = 0
    before = run()
    handles = [add_linear_term(m, lambda x, n=m.out_features: x[..., :1].expand(*x.shape[:-1], n))
               for m in linear_products(engine.model).values()]
    assert run() != before
    for handle in handles:
        handle.remove()
    assert run() == before


def test_add_linear_term_takes_only_linears(tiny):
    with pytest.raises(TypeError, match="not a linear"):
        add_linear_term(tiny.model.model.norm, lambda x: x)


def test_prepare_model_keeps_the_model_on_its_device(tiny):
    model = copy.deepcopy(tiny.model)
    prepared = prepare_model(model, torch.device("cpu"), torch.float32)
    assert prepared.shard is None and prepared.num_heads == model.config.num_attention_heads
    assert prepared.module is not model


def test_a_term_on_a_packed_linear_outside_a_model():
    """oneDNN's packed linear, which the engine picks where kvfleet's product does not build."""
    from kvfleet.worker.engine.kernels.cpu_linear import packing_available

    if not packing_available(torch.float32):
        pytest.skip("oneDNN packs no float32 weights with this torch build (torch_private refused its private ops)")
    torch.manual_seed(4)
    linear = PackedLinear(torch.nn.Linear(16, 8))
    x, a, b = torch.randn(3, 16), torch.randn(16, 2), torch.randn(2, 8)
    before = linear(x).clone()
    handle = add_linear_term(linear, lambda rows: rows @ a @ b)
    assert torch.allclose(linear(x), before + x @ a @ b, atol=1e-5)
    handle.remove()
    assert torch.equal(linear(x), before)
