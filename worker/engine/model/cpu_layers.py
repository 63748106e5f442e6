"""Decoder layers of Llama-family models (Llama, Qwen2, Mistral, Qwen3, and the mixture-of-experts
Qwen3-MoE and Mixtral) on the CPU, fused (bf16, float32).

HF's eager layer runs about 30 small torch ops per layer around 7 matrix products; at decode sizes
their per-op cost and the Python between them are a large share of a step. `FusedDecoderLayer` computes
the same layer as 4 packed oneDNN products (q/k/v together, o, gate/up together, down), the
engine's paged attention, and 3 C++ element-wise passes (cpu_layer_ops.cpp: RMSNorm with the
residual add folded in, RoPE in place on q and k, SiLU(gate) * up; on AMX tiles the last is
the gate/up product's own epilogue, and the residual add after the down product that product's,
same bits), rounding to bf16 where the
eager bf16 layer rounds (float32 is plain float32: its greedy output still equals HF `generate`
token for token in the tests). The products are oneDNN-packed where the dtype packs on this CPU
(cpu_linear.py), else F.linear. `FusedRMSNorm` takes the final norm. Layers of another shape are
left as they are, and so is everything under tensor parallelism (its ranks hold sharded layers).

Qwen3's attention normalises each q and k head (RMSNorm over the head's dimensions) before RoPE:
the same RMSNorm pass, one head a row. A mixture-of-experts layer's MLP half is the model's own
sparse block (its router, then its experts, packed by cpu_experts.py), called once on the
normalised rows; the rest of the layer is the fused one, so an MoE layer makes the same few
calls around its experts as a dense one around its MLP.
"""

from __future__ import annotations

import torch

from kvfleet.worker.engine.kernels import cpu_kernels
from kvfleet.worker.engine.attention import CONTEXT_KWARG, fused_layer_attention
from kvfleet.worker.engine.kernels.cpu_attention import DTYPE_CODES
from kvfleet.worker.engine.kernels.cpu_kernels import layer_ops_kernel
from kvfleet.worker.engine.kernels.cpu_experts import experts_of
from kvfleet.worker.engine.kernels.cpu_linear import product

FUSED_LAYER_TYPES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer",
                     "Qwen3DecoderLayer", "Qwen3MoeDecoderLayer", "MixtralDecoderLayer")
# types HF gave a per-layer sliding window later: fused only where the layer has none
_WINDOWED_TYPES = ("Qwen3DecoderLayer", "Qwen3MoeDecoderLayer", "MixtralDecoderLayer")
FUSED_DTYPES = (torch.bfloat16, torch.float32)


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name} failed with status {status}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * rms_norm(x) over the last dim of contiguous [rows, hidden]; with `residual`, that
    tensor becomes x + residual first (in place) and the sum is what is normalised."""
    out = torch.empty_like(x)
    _check(layer_ops_kernel().kvfleet_rms_norm(
        DTYPE_CODES[x.dtype], x.data_ptr(), None if residual is None else residual.data_ptr(),
        weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
        torch.get_num_threads()), "kvfleet_rms_norm")
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [rows, heads, dim] (last dim contiguous) in place by cos/sin [rows, dim]."""
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    _check(layer_ops_kernel().kvfleet_rope(
        DTYPE_CODES[x.dtype], x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.stride(1),
        x.shape[2], cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()), "kvfleet_rope")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from contiguous [rows, 2 * inter] (gate, then up) -> [rows, inter]."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    _check(layer_ops_kernel().kvfleet_silu_mul(
        DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, inter,
        torch.get_num_threads()), "kvfleet_silu_mul")
    return out


def _concat(*linears: torch.nn.Linear, invariant: bool = False,
            silu_pairs: bool = False) -> torch.nn.Module:
    """One product over the linears' stacked weights (outputs side by side); `silu_pairs`
    (gate, up): where cpu_linear.product can, one that returns silu(gate) * up itself."""
    fused = torch.nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                            bias=linears[0].bias is not None, dtype=linears[0].weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))
    return product(fused, invariant, silu_pairs)


class FusedRMSNorm(torch.nn.Module):
    """An HF RMSNorm ([1, T, hidden] in, same out) through kvfleet_rms_norm."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.eps).view(x.shape)


class FusedDecoderLayer(torch.nn.Module):
    """What an HF Llama-family decoder layer computes, from that layer's weights."""

    def __init__(self, layer: torch.nn.Module, invariant: bool = False):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = attn.scaling
        self.layer_idx = attn.layer_idx
        self.qkv = _concat(attn.q_proj, attn.k_proj, attn.v_proj, invariant=invariant)
        self.o_proj = product(attn.o_proj, invariant)
        # Qwen3: an RMSNorm over each q and k head before RoPE
        self.q_norm = FusedRMSNorm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = FusedRMSNorm(attn.k_norm) if hasattr(attn, "k_norm") else None
        # a mixture-of-experts layer: the model's sparse block computes the MLP half
        self.mlp = mlp if is_sparse_block(mlp) else None
        if self.mlp is None:
            self.gate_up = _concat(mlp.gate_proj, mlp.up_proj, invariant=invariant,
                                   silu_pairs=True)
            # kvfleet's product on AMX tiles or with AVX-512: silu(gate) * up in the product's
            # epilogue (same bits as silu_mul after it); on AMX tiles also the down product
            # added into the residual in its own (as residual.add_ rounds)
            self._silu_in_product = getattr(self.gate_up, "silu_pairs", False)
            self.down_proj = product(mlp.down_proj, invariant)
            self._add_in_product = getattr(self.down_proj, "adds_in_place", False)
        self.input_norm = FusedRMSNorm(layer.input_layernorm)
        self.post_norm = FusedRMSNorm(layer.post_attention_layernorm)
        # what every forward splits its q/k/v product by, computed once
        self._num_heads_qk = self.num_heads + self.num_kv_heads
        self._num_heads_qkv = self._num_heads_qk + self.num_kv_heads
        self._head_split = (self.num_heads, self.num_kv_heads, self.num_kv_heads)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None,
                **kwargs) -> torch.Tensor:  # [1, T, hidden] -> [1, T, hidden]
        x = hidden_states[0].contiguous()  # [T, hidden]
        num_tokens = x.shape[0]
        h = rms_norm(x, self.input_norm.weight, self.input_norm.eps)
        # [T, H + 2 KVH, D]: q, k and v heads side by side in each row, split as views
        heads = self.qkv(h).view(num_tokens, self._num_heads_qkv, self.head_dim)
        q, k, v = heads.split(self._head_split, dim=1)
        cos, sin = _rope_tables(position_embeddings)  # [T, D] each
        if self.q_norm is not None:  # each head normalised (one head a row), in its place
            for part, norm in ((q, self.q_norm), (k, self.k_norm)):
                rows = part.contiguous().view(-1, self.head_dim)
                part.copy_(rms_norm(rows, norm.weight, norm.eps).view(part.shape))
        # q and k heads side by side in each row: one rotation pass for both
        rope_(heads[:, :self._num_heads_qk], cos, sin)
        attn = fused_layer_attention(self.layer_idx, q, k, v, kwargs[CONTEXT_KWARG],
                                     self.scaling)  # [T, H, D]
        residual = self.o_proj(attn.view(num_tokens, -1))  # becomes x + attention below
        h = rms_norm(x, self.post_norm.weight, self.post_norm.eps, residual=residual)
        if self.mlp is not None:  # the sparse block: its router, then its experts
            return residual.add_(self.mlp(h.unsqueeze(0))[0]).unsqueeze(0)
        # in place: the same bf16 (or float32) sum, without a new tensor
        # the epilogues only where no forward hook (an adapter's terms, lora/) adds to the
        # product's own output
        if self._silu_in_product and not self.gate_up._forward_hooks:
            act = self.gate_up(h)
        elif self._silu_in_product:
            act = silu_mul(self.gate_up(h, silu=False))
        else:
            act = silu_mul(self.gate_up(h))
        if self._add_in_product and not self.down_proj._forward_hooks:
            return self.down_proj(act, add_to=residual).unsqueeze(0)
        return residual.add_(self.down_proj(act)).unsqueeze(0)


# The last forward's RoPE tables: every layer of one forward gets the same `position_embeddings`
# tuple (the model computes it once), so its contiguous [T, D] copies are made once a forward,
# not once a layer. One slot holds (that tuple, its tables), read and replaced whole, so two
# engines' threads can only make a copy twice; the tuple is held, so `is` cannot match a new
# tuple at a reused address.
_rope_cache: list = [None]


def _rope_tables(position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, D], contiguous, from the model's ([1, T, D], [1, T, D])."""
    cached = _rope_cache[0]
    if cached is None or cached[0] is not position_embeddings:
        cached = (position_embeddings, tuple(t[0].contiguous() for t in position_embeddings))
        _rope_cache[0] = cached
    return cached[1]


def is_sparse_block(mlp: torch.nn.Module) -> bool:
    """`mlp` is a transformers mixture-of-experts block: a router (`gate`) and an experts block
    of the 3-D layout (cpu_experts.py), called on [1, T, hidden]."""
    return hasattr(mlp, "gate") and experts_of(getattr(mlp, "experts", None))


def can_fuse(layer: torch.nn.Module) -> bool:
    """A Llama-family layer with plain CPU linears of one FUSED_DTYPES dtype, RMSNorms (Qwen3's
    per-head q and k norms too), SiLU, full-width RoPE, and a dense MLP or a sparse block."""
    name = type(layer).__name__
    if name not in FUSED_LAYER_TYPES:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    weights = [getattr(m, "weight", None) for m in linears]
    if mlp is not None and is_sparse_block(mlp):
        weights += [mlp.experts.gate_up_proj, mlp.experts.down_proj]
    else:
        mlp_linears = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        linears += mlp_linears
        weights += [getattr(m, "weight", None) for m in mlp_linears]
    dtypes = {getattr(w, "dtype", None) for w in weights}
    if not (all(type(m) is torch.nn.Linear for m in linears)
            and all(w.is_cpu for w in weights)
            and len(dtypes) == 1 and dtypes <= set(FUSED_DTYPES)):
        return False
    config = getattr(attn, "config", None)
    norms = [getattr(layer, "input_layernorm", None),
             getattr(layer, "post_attention_layernorm", None)]
    if name in _WINDOWED_TYPES and getattr(attn, "sliding_window", None) is not None:
        return False
    if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
        return False
    norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
    return (getattr(config, "hidden_act", None) == "silu"
            and getattr(config, "partial_rotary_factor", 1.0) == 1.0
            and all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") for n in norms))


def fuse_decoder_layers(model: torch.nn.Module, invariant: bool = False) -> int:
    """Replace every layer `can_fuse` accepts (and then the final norm) where the layer ops'
    kernel loads here, its products batch-invariant where `invariant`; returns how many."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or cpu_kernels.unavailable_reason("layer_ops") is not None:
        return 0  # without the element-wise ops HF's layers stay (the log said why)
    fused = 0
    for i, layer in enumerate(layers):
        if can_fuse(layer):
            layers[i] = FusedDecoderLayer(layer, invariant)
            fused += 1
    norm = model.model.norm
    if fused == len(layers) and hasattr(norm, "variance_epsilon"):
        model.model.norm = FusedRMSNorm(norm)
    return fused
