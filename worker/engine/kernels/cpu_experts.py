"""A mixture-of-experts layer's experts through packed CPU products.

transformers keeps an MoE layer's experts as two 3-D parameters (`gate_up_proj` [experts,
2 x intermediate, hidden], `down_proj` [experts, hidden, intermediate]: Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE ...) and computes each expert's tokens with `F.linear` on a slice, which on a CPU
reorders the bf16 weight on every call (cpu_linear.py). `PackedExperts` computes the same thing
with each expert's two products packed once (`cpu_linear.product`: kvfleet's own product or
oneDNN's): the tokens routed to an expert gathered, its gate/up product, SiLU-and-multiply, its
down product, scaled by the routing weight and added to each token's output, experts in
ascending order as transformers adds them.
"""

from __future__ import annotations

import torch
from torch import nn

from kvfleet.worker.engine.kernels.cpu_linear import packs, product


def _experts_of(module: nn.Module) -> bool:
    """`module` is a transformers experts block of the 3-D layout above (no biases)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)
            and gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
            and hasattr(module, "act_fn") and not hasattr(module, "gate_up_proj_bias"))


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype,
                       device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class PackedExperts(nn.Module):
    """An experts block's forward (hidden [tokens, hidden], top_k_index and top_k_weights
    [tokens, k]) over per-expert packed products."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.intermediate = experts.down_proj.shape[2]
        self.act_fn = experts.act_fn
        self.gate_up = nn.ModuleList(product(_linear(w)) for w in experts.gate_up_proj)
        self.down = nn.ModuleList(product(_linear(w)) for w in experts.down_proj)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, tokens in order within each
        tokens = order // k
        weights = top_k_weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts[:self.num_experts]):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            gate, up = self.gate_up[expert](hidden_states[rows]).split(self.intermediate, dim=-1)
            update = self.down[expert](self.act_fn(gate) * up)
            update = update * weights[start:start + count, None]
            out.index_add_(0, rows, update.to(out.dtype))
            start += count
        return out


def pack_cpu_experts(model: nn.Module) -> int:
    """Replace every experts block of `model` whose dtype packs here with PackedExperts; returns
    how many were replaced."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if _experts_of(module) and packs(module.gate_up_proj.dtype):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                    PackedExperts(module))
            replaced += 1
    return replaced
