"""The CPU's ceilings, measured in the benchmark's own run, and what a model's step needs of them.

- `peak_product_rate`: FLOP/s of the fastest product this process can run at a model's largest
  linear shape (rows x hidden -> intermediate), over kvfleet's products (its own kernel, oneDNN's
  packed weights) and torch's `F.linear` (oneDNN / MKL): the peak prefill is judged against.
- `read_bandwidth`: bytes/s read from a buffer the size of a decode step's reads (the faster of
  torch's sum and MKL's sgemv over it): the memory roofline of decode.
- `ModelCost`: a model's FLOPs per prompt token and bytes per decode step (weights read once,
  every stream's K/V; for an MoE model only the experts a step's tokens route to, expected).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.engine.cpu_linear import product


def _best_seconds(fn, repeats: int, rounds: int = 3) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def peak_product_rate(dtype: torch.dtype, in_features: int, out_features: int,
                      rows: int = 512) -> dict[str, float]:
    """FLOP/s of a [rows, in] x [in, out] product by each implementation here ("kvfleet": the
    engine's own choice, cpu_linear.product; "F.linear": torch's), and "peak", the best."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    x = torch.randn(rows, in_features, dtype=dtype)
    flops = 2 * rows * in_features * out_features
    repeats = max(2, int(2e10 // flops))
    rates = {}
    with torch.inference_mode():
        engine_linear = product(linear)
        rates["kvfleet"] = flops / _best_seconds(lambda: engine_linear(x), repeats)
        rates["F.linear"] = flops / _best_seconds(lambda: F.linear(x, linear.weight), repeats)
    rates["peak"] = max(rates.values())
    return rates


def read_bandwidth(num_bytes: int, passes: int = 3) -> float:
    """Memory read bandwidth over a buffer of `num_bytes`: the faster of two readers that stream
    it once, torch's sum and MKL's float32 matrix-vector product (best of `passes` each)."""
    columns = 1024
    matrix = torch.ones(max(num_bytes // (4 * columns), 256), columns, dtype=torch.float32)
    vector = torch.ones(columns, dtype=torch.float32)
    seconds = min(_best_seconds(matrix.sum, 1, passes),
                  _best_seconds(lambda: torch.mv(matrix, vector), 1, passes))
    return matrix.numel() * 4 / seconds


@dataclass(frozen=True)
class ModelCost:
    """What a model's forward costs, from its config and parameter counts."""

    layer_params: int  # parameters of the decoder layers (all experts of an MoE)
    expert_params: int  # of those, in routed experts
    num_experts: int
    experts_per_token: int
    head_params: int  # the LM head's (vocab x hidden), computed for sampled rows only
    num_layers: int
    q_width: int  # query heads x head dim
    kv_width: int  # KV heads x head dim

    @classmethod
    def of(cls, model) -> ModelCost:
        cfg = model.config
        layers = model.model.layers
        layer_params = sum(p.numel() for p in layers.parameters())
        expert_params = sum(p.numel() for n, p in layers.named_parameters()
                            if ".experts." in n)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(layer_params, expert_params,
                   getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 1) or 1,
                   getattr(cfg, "num_experts_per_tok", 1) or 1,
                   cfg.vocab_size * cfg.hidden_size, cfg.num_hidden_layers,
                   cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim)

    @property
    def active_layer_params(self) -> float:
        """Layer parameters a token computes with (an MoE token: its experts_per_token only)."""
        return (self.layer_params - self.expert_params
                + self.expert_params * self.experts_per_token / self.num_experts)

    def prefill_flops(self, prompt_lengths: list[int]) -> float:
        """FLOPs of computing these prompts: the layers' products per token, attention over the
        causal pairs (QK^T and PV), the LM head once per prompt."""
        tokens = sum(prompt_lengths)
        pairs = sum(n * (n + 1) / 2 for n in prompt_lengths)
        return (2 * self.active_layer_params * tokens + 4 * self.num_layers * self.q_width * pairs
                + 2 * self.head_params * len(prompt_lengths))

    def decode_step_bytes(self, streams: int, mean_context: float, elem: int,
                          kv_elem: int | None = None) -> dict[str, float]:
        """Bytes a decode step of `streams` rows reads at least: every weight it computes with
        once (an MoE: the experts its tokens route to, expected under uniform routing) and every
        stream's K/V."""
        share = 1.0
        if self.num_experts > 1:  # expected fraction of experts hit by streams x k choices
            share = 1 - (1 - self.experts_per_token / self.num_experts) ** streams
        weights = (self.layer_params - self.expert_params + self.expert_params * share
                   + self.head_params) * elem
        kv = streams * mean_context * self.num_layers * 2 * self.kv_width * (kv_elem or elem)
        return {"weights": weights, "kv": kv, "total": weights + kv}

    def decode_step_flops(self, streams: int) -> float:
        return 2 * (self.active_layer_params + self.head_params) * streams
