"""On a GPU: cuda:N, the profiled KV budget, sticky errors, CUDA graphs against eager steps, and
bf16 greedy agreement with HF generate in bf16 on the same GPU (tiny model and default model)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from tests.engine.tiny_models import (
    greedy, random_prompt, save_tiny_llama, tokens_before_divergence)
from kvfleet.worker.engine.engine import Engine, EngineConfig

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def hf_greedy(path: str, prompts, new_tokens: int, device, pad_token_id=0) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=pad_token_id)
            results.append(out[0, len(prompt):].tolist())
    del model
    torch.cuda.empty_cache()
    return results


def agreement(produced, expected, new_tokens) -> float:
    return sum(tokens_before_divergence(g, w) for g, w in zip(produced, expected)) / (len(expected) * new_tokens)


def test_cuda_n_is_the_current_device(saved_tiny):
    index = torch.cuda.device_count() - 1
    engine = Engine.from_pretrained(saved_tiny, EngineConfig(device=f"cuda:{index}", num_blocks=64))
    assert torch.cuda.current_device() == index
    assert engine.pool.layer(0).device == torch.device("cuda", index)
    assert next(engine.model.parameters()).device == torch.device("cuda", index)


def test_budget_comes_from_a_profiled_step(saved_tiny, gpu):
    config = EngineConfig(device=str(gpu), gpu_memory_utilization=0.3, max_batched_tokens=2048)
    engine = Engine.from_pretrained(saved_tiny, config)
    assert "peak step" in engine.budget.source
    _, total = torch.cuda.mem_get_info(gpu)
    assert engine.pool.num_bytes <= 0.3 * total
    prompts = [random_prompt(400, seed=i) for i in range(8)]
    assert all(len(t) == 8 for t in engine.generate(prompts, greedy(8)))


def test_graph_replays_equal_eager_steps(saved_tiny, gpu):
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 64, 100, 230)]
    outputs = {}
    for mode in ("auto", "off"):
        engine = Engine.from_pretrained(saved_tiny, EngineConfig(
            device=str(gpu), num_blocks=512, attention_backend="triton", cuda_graphs=mode))
        assert (engine.runner.decode_graphs is not None) == (mode == "auto")
        if mode == "auto":
            assert engine.runner.decode_graphs.graphs  # captured
        outputs[mode] = engine.generate(prompts, greedy(20))
        replays = engine.stats().num_cuda_graph_steps  # kvfleet_worker_cuda_graph_steps_total
        assert replays >= 19 if mode == "auto" else replays == 0  # every decode-only step
    assert outputs["auto"] == outputs["off"]


def test_speculative_steps_replay_their_bucket_graphs_with_plain_decodings_answers(saved_tiny,
                                                                                    gpu):
    """The model as its own draft (every greedy proposal accepted): verified steps replay the
    (streams, proposals) graphs and give plain decoding's tokens, at the default bf16."""
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 64, 100, 230)]
    plain = Engine.from_pretrained(saved_tiny, EngineConfig(device=str(gpu), num_blocks=512))
    expected = plain.generate(prompts, greedy(20))
    spec = {"method": "draft_model", "model": saved_tiny, "num_speculative_tokens": 4,
            "adaptive": False}
    engine = Engine.from_pretrained(saved_tiny, EngineConfig(
        device=str(gpu), num_blocks=512, speculative_config=spec))
    assert {key[1] for key in engine.runner.decode_graphs.graphs} == {0, 1, 2, 4}
    assert engine.generate(prompts, greedy(20)) == expected
    assert engine.stats().num_cuda_graph_steps > 0
    assert engine.speculation.speculator.stats.num_accepted_tokens > 0


def test_tiny_bf16_greedy_agrees_with_hf_generate_on_cuda(saved_tiny, gpu):
    prompts = [random_prompt(n, seed=n) for n in (5, 37, 120, 260, 300, 410)]
    expected = hf_greedy(saved_tiny, prompts, 24, gpu)
    engine = Engine.from_pretrained(saved_tiny, EngineConfig(device=str(gpu), num_blocks=512))
    assert engine.attention_backend.name == "triton" and engine.runner.decode_graphs is not None
    measured = agreement(engine.generate(prompts, greedy(24)), expected, 24)
    print(f"tiny model, CUDA bf16 agreement with HF generate: {measured:.1%}")
    assert measured >= 0.8


def test_default_model_bf16_greedy_agrees_with_hf_generate_on_cuda(gpu):
    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    questions = ["What is the capital of France?", "Write a haiku about memory budgets.",
                 "Explain continuous batching in one sentence."]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, tokenize=True)["input_ids"])
               for q in questions]
    expected = hf_greedy(path, prompts, 32, gpu, pad_token_id=tokenizer.pad_token_id)
    engine = Engine.from_pretrained(path, EngineConfig(device=str(gpu), num_blocks=256), tokenizer=tokenizer)
    produced = engine.generate(prompts, greedy(32))
    measured = agreement(produced, expected, 32)
    print(f"default model, CUDA bf16 agreement with HF generate: {measured:.1%}; "
          f"identical streams: {sum(p == e for p, e in zip(produced, expected))}/{len(prompts)}")
    assert measured >= 0.8


def test_a_device_side_assert_is_sticky():
    """In a child process: the error poisons its CUDA context, and is classified as sticky."""
    code = (
        "import torch\n"
        "from kvfleet.worker.engine.memory.device import is_sticky_device_error\n"
        "x = torch.zeros(4, device='cuda')\n"
        "try:\n"
        "    x[torch.tensor([10], device='cuda')] = 1.0\n"
        "    torch.cuda.synchronize()\n"
        "except Exception as exc:\n"
        "    print('sticky' if is_sticky_device_error(exc) else f'not sticky: {exc!r}')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "sticky" in result.stdout and "not sticky" not in result.stdout, result.stdout + result.stderr
