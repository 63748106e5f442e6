"""Tiny random Llama and Qwen2 models, their HF greedy references, and engine-test helpers."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineConfig

VOCAB = 512
# initializer_range well above the default 0.02 gives clear logit margins, so greedy choices do
# not flip on float noise between a batched and an unbatched forward.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
               initializer_range=0.25, eos_token_id=2, bos_token_id=1, pad_token_id=0)
MODEL_FACTORIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON)),
}


def build_wide_llama() -> LlamaForCausalLM:
    """A tiny Llama whose heads are 64 wide (the C++ kernels' vectorised paths) with
    transformers' default initialisation, so its logits are close together as a real model's
    are (bf16 rounding shows in them)."""
    torch.manual_seed(4321)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
                         pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def build_model(family: str, **overrides):
    """The seeded tiny model, `overrides` on its config: every process that builds it gets the
    same weights (a picklable loader for tensor-parallel ranks: partial(build_model, family))."""
    torch.manual_seed(1234)
    if not overrides:
        return MODEL_FACTORIES[family]()
    model_cls, config_cls = {"llama": (LlamaForCausalLM, LlamaConfig),
                             "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[family]
    return model_cls(config_cls(**{**_COMMON, **overrides}))


class TinyModel:
    """A seeded random model; `engine()` wraps a fresh copy, `reference()` runs HF generate."""

    def __init__(self, family: str, **overrides):
        self.family = family
        self.model = build_model(family, **overrides).eval()
        self.model.set_attn_implementation("eager")
        self._references: dict[tuple, list[int]] = {}

    def engine(self, tokenizer=None, **config) -> Engine:
        config.setdefault("device", "cpu")
        # float32, not auto: its greedy output is compared with HF generate token for token, and
        # auto is bf16 on CPUs with native bf16
        config.setdefault("dtype", "float32")
        config.setdefault("num_blocks", 256)
        config.setdefault("block_size", 4)
        return Engine(copy.deepcopy(self.model), EngineConfig(**config), tokenizer=tokenizer)

    def reference(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """HF greedy continuation with EOS disabled (memoised)."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._references:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
            self._references[key] = out[0, len(prompt):].tolist()
        return self._references[key]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle; the tokens each request produced."""
    produced: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return produced
        for out in engine.step():
            produced.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def tokens_before_divergence(got: list[int], want: list[int]) -> int:
    """How many leading tokens two greedy streams share (bf16 agreement is measured with it)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return min(len(got), len(want))


def save_tiny_llama(directory) -> str:
    """The seeded tiny Llama saved as a model directory (for from_pretrained in another dtype)."""
    torch.manual_seed(1234)
    MODEL_FACTORIES["llama"]().save_pretrained(directory)
    return str(directory)
