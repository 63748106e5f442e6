"""On a GPU: the LoRA SGMV kernels compiled (against float64), and an engine serving adapters
beside base requests: the same tokens with CUDA graphs as without (base-only decode steps replay
them, adapter steps run eagerly), and bf16 agreement with PEFT's generate in bf16 on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel

from tests.engine.test_lora import Adapters, lora_engine, submit
from tests.engine.test_lora_triton import RANKS, SEGMENTS, factors, reference
from tests.engine.tiny_models import (
    TinyModel, random_prompt, run_to_completion, tokens_before_divergence)
from kvfleet.worker.engine.lora.sgmv import SlotRows, sgmv

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Adapters:
    return Adapters.saved(TinyModel("llama"), tmp_path_factory.mktemp("cuda-adapters"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_match_float64(gpu, dtype):
    torch.manual_seed(0)
    x = torch.randn(45, 96).to(dtype)
    product = torch.randn(45, 130).to(dtype)
    a, b = factors(dtype)
    want = reference(x, product[:, 30:110], a, b)
    out = product.to(gpu)
    sgmv(x.to(gpu), out[:, 30:110], a.to(gpu), b.to(gpu),
         torch.tensor(RANKS, dtype=torch.int32, device=gpu), max(RANKS),
         SlotRows.of(SEGMENTS, gpu, for_kernels=True))
    out = out.cpu()
    assert torch.equal(out[37:], product[37:]) and torch.equal(out[:, :30], product[:, :30])
    error = (out[:, 30:110].double() - want).abs().max().item()
    assert error < (1e-4 if dtype == torch.float32 else 0.05) * want.abs().max().item()


def work() -> list[tuple[str | None, list[int], int]]:
    names = ["all8", None, "qv4", "mlp16", None, "attn2", "kdown6", "all8"]
    return [(name, random_prompt(5 + 7 * i, seed=1200 + i), 24 if name is None else 12)
            for i, name in enumerate(names)]


def test_graphs_for_base_steps_and_eager_adapter_steps_give_the_same_tokens(adapters, gpu):
    produced = {}
    for mode in ("auto", "off"):
        engine = lora_engine(adapters, device=str(gpu), dtype="bfloat16", cuda_graphs=mode,
                             attention_backend="triton", max_loras=2, max_batched_tokens=64)
        assert engine.lora.slots.use_triton
        submit(engine, adapters, work())
        produced[mode] = run_to_completion(engine)
        replays = engine.stats().num_cuda_graph_steps
        assert replays > 0 if mode == "auto" else replays == 0  # the base requests' last steps
    assert produced["auto"] == produced["off"]


def test_bf16_agrees_with_peft_on_the_gpu(adapters, gpu):
    engine = lora_engine(adapters, device=str(gpu), dtype="bfloat16", max_loras=4)
    requests = work()
    submit(engine, adapters, requests)
    produced = run_to_completion(engine)
    agreed = total = 0
    for i, (name, prompt, n) in enumerate(requests):
        model = copy.deepcopy(adapters.tiny.model).to(torch.bfloat16)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters.paths[name])
        model = model.to(gpu).eval()
        ids = torch.tensor([prompt], device=gpu)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=n, eos_token_id=None,
                                 pad_token_id=0)
        agreed += tokens_before_divergence(produced[f"r{i}"], out[0, len(prompt):].tolist())
        total += n
    # not measured on a GPU yet: these requests agree 0.68 on the CPU (bf16 near ties); without
    # the adapters' terms most adapter streams part at their first token
    assert agreed >= 0.5 * total, f"{agreed} of {total}"
