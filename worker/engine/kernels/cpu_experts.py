"""A mixture-of-experts layer's experts through packed CPU products.

transformers keeps an MoE layer's experts as two 3-D parameters (`gate_up_proj` [experts,
2 x intermediate, hidden], `down_proj` [experts, hidden, intermediate]: Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE ...) and computes each expert's tokens with `F.linear` on a slice, which on a CPU
reorders the bf16 weight on every call (cpu_linear.py). `PackedExperts` computes the same thing
with each expert's two products packed once (`cpu_linear.product`: kvfleet's own product or
oneDNN's): the tokens routed to an expert gathered, its gate/up product, SiLU-and-multiply, its
down product, scaled by the routing weight and added to each token's output, experts in
ascending order as transformers adds them.

Where the experts' products are kvfleet's own, every expert's weights are packed side by side
and a forward makes one call for all the routed experts' gate/up products and one for their down
products (`kvfleet_linear_groups`, cpu_matmul.cpp; on AMX tiles `kvfleet_amx_linear_groups`,
cpu_amx.cpp): every output is the one the per-expert product gives, and the few
torch calls around them (the routed rows gathered, SiLU x up) take the whole step's rows at
once. Each token's terms are weighted and added in ascending expert order in one pass
(`kvfleet_moe_combine`, cpu_layer_ops.cpp), rounded as the loop's eager ops round them: at a
512-token step that pass replaced a multiply, an `index_copy_` and k strided adds that took
longer than the per-expert loop's glue. A decode step of one stream through Qwen3-30B-A3B's
layer routes 8 experts a layer: the per-expert loop made a dozen torch calls and two product
calls for each.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from kvfleet.worker.engine.kernels.cpu_attention import DTYPE_CODES
from kvfleet.worker.engine.kernels.cpu_kernels import (amx_kernel, layer_ops_kernel, matmul_kernel,
                                                       unavailable_reason)
from kvfleet.worker.engine.kernels.cpu_linear import (BF16_FORM_CODES, bf16_form, own_product,
                                                      packs, product)


def experts_of(module: nn.Module) -> bool:
    """`module` is a transformers experts block of the 3-D layout above (no biases)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)
            and gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]
            and hasattr(module, "act_fn") and not hasattr(module, "gate_up_proj_bias"))


def as_linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype,
                       device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class PackedExperts(nn.Module):
    """An experts block's forward (hidden [tokens, hidden], top_k_index and top_k_weights
    [tokens, k]) over per-expert packed products."""

    def __init__(self, experts: nn.Module, grouped: bool | None = None, invariant: bool = False):
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.intermediate = experts.down_proj.shape[2]
        self.hidden = experts.down_proj.shape[1]
        self.act_fn = experts.act_fn
        dtype = experts.gate_up_proj.dtype
        # `grouped` (default: where the products are kvfleet's own) packs every expert's weights
        # side by side for one call per product (kvfleet_linear_groups, or on AMX tiles
        # kvfleet_amx_linear_groups); else one packed product per expert
        self.grouped = grouped_products(dtype, invariant) if grouped is None else grouped
        if self.grouped:
            self._code = (BF16_FORM_CODES[bf16_form()] if dtype == torch.bfloat16
                          else DTYPE_CODES[dtype])
            self._tiles = self._code == BF16_FORM_CODES["amx"]
            if self._tiles:
                self._kvfleet_amx_linear_groups = amx_kernel().kvfleet_amx_linear_groups
            else:
                self._kvfleet_linear_groups = matmul_kernel().kvfleet_linear_groups
            self._kvfleet_moe_combine = layer_ops_kernel().kvfleet_moe_combine
            self.gate_up_packed, self._gate_up_at = _pack_all(experts.gate_up_proj, self._code)
            self.down_packed, self._down_at = _pack_all(experts.down_proj, self._code)
        else:
            self.gate_up = nn.ModuleList(product(as_linear(w), invariant)
                                         for w in experts.gate_up_proj)
            self.down = nn.ModuleList(product(as_linear(w), invariant) for w in experts.down_proj)

    def __deepcopy__(self, memo) -> PackedExperts:
        """A copy sharing the packed weights (never written after packing), so the addresses
        the grouped calls pass stay those of live tensors; the modules are copied (the
        per-expert products share their packed weights as KernelLinear's copies do)."""
        clone = copy.copy(self)
        clone._parameters = {name: copy.deepcopy(p, memo) for name, p in self._parameters.items()}
        clone._buffers = dict(self._buffers)
        clone._modules = {name: copy.deepcopy(m, memo) for name, m in self._modules.items()}
        return clone

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            return self._grouped_forward(hidden_states, top_k_index, top_k_weights)
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
            # a token comes to an expert once, so `rows` are distinct: out[rows] += update adds
            # each row once, in the dtype's one rounding, as index_add_ does (whose CPU kernel,
            # a sort and scatter for the general case, costs a millisecond for one row)
            out.index_put_((rows,), update.to(out.dtype), accumulate=True)
            start += count
        return out


    def _grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
        """The loop's arithmetic, each product one call for every expert."""
        num_tokens, k = top_k_index.shape
        if num_tokens == 0:
            return torch.zeros_like(hidden_states)
        # each token's experts ascending: position t * k + j holds its j-th smallest expert
        experts, slots = top_k_index.sort(dim=-1)
        weights = top_k_weights.gather(-1, slots).reshape(-1)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, tokens in order within each
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(flat, minlength=self.num_experts)[:self.num_experts], 0,
                     out=offsets[1:])
        x = hidden_states.contiguous().index_select(0, order // k)  # [routed rows, hidden]
        rows, dtype, threads = x.shape[0], x.dtype, torch.get_num_threads()
        gate_up = torch.empty(rows, 2 * self.intermediate, dtype=dtype)
        self._groups(x, offsets, self._gate_up_at, gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        act = (self.act_fn(gate) * up).contiguous()
        down = torch.empty(rows, self.hidden, dtype=dtype)
        self._groups(act, offsets, self._down_at, down)
        # each token's terms weighted and added in ascending expert order, as the loop adds
        # them, in one pass: token t's j-th term is row at[t * k + j] of `down`
        at = torch.empty_like(order)
        at[order] = torch.arange(order.numel())
        scale = weights.float().contiguous()  # held: the call reads it
        out = torch.empty(num_tokens, self.hidden, dtype=dtype)
        _check(self._kvfleet_moe_combine(
            DTYPE_CODES[dtype], down.data_ptr(), at.data_ptr(), scale.data_ptr(), num_tokens, k,
            self.hidden, out.data_ptr(), threads), "kvfleet_moe_combine")
        return out

    def _groups(self, x: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                y: torch.Tensor) -> None:
        """y = each group's rows of x (contiguous) against its expert's packed weight."""
        k, n, threads = x.shape[1], y.shape[1], torch.get_num_threads()
        if self._tiles:
            _check(self._kvfleet_amx_linear_groups(
                self._code, x.data_ptr(), k, k, offsets.data_ptr(), weights.data_ptr(),
                self.num_experts, n, y.data_ptr(), n, threads), "kvfleet_amx_linear_groups")
        else:
            _check(self._kvfleet_linear_groups(
                self._code, x.data_ptr(), k, k, offsets.data_ptr(), weights.data_ptr(),
                self.num_experts, n, y.data_ptr(), n, threads), "kvfleet_linear_groups")


# transformers' top-k routers this module computes (each: F.linear, a float softmax, top-k, the
# chosen weights normalised to sum 1 where the router says so), and whether the router hands
# the experts its weights in the logits' dtype (True) or in float32
ROUTERS = {"Qwen3MoeTopKRouter": True, "Qwen2MoeTopKRouter": True, "MixtralTopKRouter": False}


class PackedRouter(nn.Module):
    """A transformers top-k router (ROUTERS) whose logits come from a packed product instead of
    F.linear (which reorders a bf16 weight on every call); where `invariant`, kvfleet's product,
    whose sums do not depend on the batch. The rest is the router's own arithmetic: softmax in
    float32, top-k, the chosen weights divided by their sum (Mixtral always, Qwen's where
    `norm_topk_prob`), cast to the logits' dtype where the router casts."""

    def __init__(self, router: nn.Module, invariant: bool = False):
        super().__init__()
        self.top_k, self.hidden_dim = router.top_k, router.hidden_dim
        self.normalize = getattr(router, "norm_topk_prob", True)
        self.cast = ROUTERS[type(router).__name__]
        self.product = product(as_linear(router.weight), invariant)

    def forward(self, hidden_states: torch.Tensor):
        logits = self.product(hidden_states.reshape(-1, self.hidden_dim))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, (top.to(logits.dtype) if self.cast else top), index


def packs_router(router: nn.Module) -> bool:
    return (type(router).__name__ in ROUTERS and isinstance(getattr(router, "weight", None),
                                                            nn.Parameter)
            and all(hasattr(router, a) for a in ("top_k", "hidden_dim")))


def grouped_products(dtype: torch.dtype, invariant: bool = False) -> bool:
    """An experts block of `dtype` computes through one grouped call per product here: its
    linears take kvfleet's own product (cpu_linear.own_product; `invariant`: wherever it builds),
    in any of its forms (AMX tiles included), and the layer ops kernel builds."""
    return (dtype in DTYPE_CODES and own_product(dtype, invariant)
            and unavailable_reason("layer_ops") is None)  # its kvfleet_moe_combine adds the terms


def _pack_all(weights: torch.Tensor, code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, n, k] -> (each expert's weight packed for kvfleet_linear, or for the tiles
    where `code` is the amx form's, side by side; the address of each expert's packed weight,
    int64)."""
    num, n, k = weights.shape
    tiles, threads = code == BF16_FORM_CODES["amx"], torch.get_num_threads()
    if tiles:  # kvfleet_amx_pack's output: k padded to whole 32-column tiles
        size = -(-n // 16) * 16 * (-(-k // 32) * 32)
    else:  # kvfleet_pack_linear's: k rounded up to even for bf16
        per = 2 if weights.dtype == torch.bfloat16 else 1
        size = -(-n // 16) * 16 * (-(-k // per) * per)
    packed = torch.empty(num, size, dtype=weights.dtype)
    for e in range(num):
        w, out = weights[e].detach().contiguous(), packed[e]
        if tiles:
            _check(amx_kernel().kvfleet_amx_pack(code, w.data_ptr(), n, k, out.data_ptr(),
                                                 threads), "kvfleet_amx_pack")
        else:
            _check(matmul_kernel().kvfleet_pack_linear(code, w.data_ptr(), n, k, out.data_ptr(),
                                                       threads), "kvfleet_pack_linear")
    addresses = torch.tensor([packed[e].data_ptr() for e in range(num)], dtype=torch.int64)
    return packed, addresses


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name} failed with status {status}")


def pack_cpu_experts(model: nn.Module, invariant: bool = False) -> int:
    """Replace every experts block of `model` whose dtype packs here with PackedExperts, and its
    block's router (ROUTERS) with PackedRouter (kvfleet's product where `invariant`); returns how
    many experts blocks were replaced."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if experts_of(module) and packs(module.gate_up_proj.dtype, invariant):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, PackedExperts(module, invariant=invariant))
            router = getattr(parent, "gate", None)
            if router is not None and packs_router(router):
                parent.gate = PackedRouter(router, invariant)
            replaced += 1
    return replaced
