"""The attention seams: device kinds are told apart only in worker/engine/memory/device.py and backend
names only in the registry; every backend's metadata and forward (and its fused-layer entry)
compute what SDPA computes over each sequence's whole K/V; the engine resolves its backend once
and its runner uses that instance."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.wire import SamplingParams
from tests.engine.paged_cases import MIXED, ChunkSpec
from kvfleet.worker.engine.attention import (CONTEXT_KWARG, fused_layer_attention, paged_attention_forward,
                                     resolve_attention_backend)
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
from kvfleet.worker.engine.memory.kv_format import resolve_kv_format
from kvfleet.worker.engine.core.model_runner import ModelRunner, plan_step
from kvfleet.worker.engine.core.scheduler import ScheduledChunk, SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence
from kvfleet.worker.engine.kernels.triton_attention import interpreting

ROOT = Path(__file__).resolve().parents[2]
# the only modules that may compare device types and backend names
ALLOWED = {Path("worker/engine/memory/device.py"), Path("worker/engine/attention/registry.py")}
_NAMES = r"""["'](?:sdpa|cpu|triton|cuda)["']"""
FORBIDDEN = [
    re.compile(r"\.type\s*[!=]="),  # device.type == "cuda", x.device.type != "cpu"
    re.compile(rf"[!=]=\s*{_NAMES}"),
    re.compile(rf"{_NAMES}\s*[!=]="),
    re.compile(rf"\bin\s*[(\[{{]\s*{_NAMES}"),  # name in ("cpu", ...)
    re.compile(r"attention_backend\s*[!=]="),
]
CPU = torch.device("cpu")
NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 2, 3, 64, 8


def comparisons(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if not line.lstrip().startswith("#") and any(p.search(line) for p in FORBIDDEN)]


def test_the_pattern_finds_device_and_backend_comparisons():
    found = comparisons('if device.type == "cuda":\nok = x.device.type != "cpu"\n'
                        'if name == "triton": pass\nif "sdpa" != b: pass\n'
                        'if n in ("cpu", "x"): pass\nif self.attention_backend != other: pass\n')
    assert len(found) == 6
    assert comparisons('if is_cuda(device):\nname = "cuda" if ok else "cpu"\n'
                       '# device.type == "cpu"\n') == []


def test_only_the_registry_and_the_device_module_compare_devices_or_backend_names():
    found = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative not in ALLOWED:
            found += [f"{relative}: {line}" for line in comparisons(path.read_text())]
    assert found == []


def _step(chunks: list[ChunkSpec], dtype: torch.dtype, backend_name: str, seed: int = 0):
    """A one-layer model's runner over a pool whose every slot holds random K/V, the step's
    metadata, and query/key/value as transformers hands them over ([1, heads, T, D])."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    kv_format = resolve_kv_format("auto", dtype)
    need = [-(-(c.start + c.num_tokens) // BLOCK_SIZE) for c in chunks]
    num_blocks = sum(need) + 2
    pool = KVCachePool(KVLayout(1, NUM_KV_HEADS, HEAD_DIM, kv_format), num_blocks, BLOCK_SIZE, CPU)
    rows = torch.arange(NUM_KV_HEADS * num_blocks * BLOCK_SIZE)
    pool.write(0, rows, torch.randn(len(rows), HEAD_DIM), torch.randn(len(rows), HEAD_DIM))
    free = list(range(num_blocks))
    rng.shuffle(free)
    scheduled = []
    for i, (spec, n) in enumerate(zip(chunks, need)):
        table, free = free[:n], free[n:]
        seq = Sequence(f"r{i}", [3] * (spec.start + spec.num_tokens), SamplingParams(max_tokens=1))
        scheduled.append(ScheduledChunk(seq, spec.start, spec.num_tokens, table, emits_token=True))
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=NUM_KV_HEADS * GROUP * HEAD_DIM, head_dim=HEAD_DIM, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=NUM_KV_HEADS * GROUP,
        num_key_value_heads=NUM_KV_HEADS, vocab_size=32)).to(dtype)
    backend = resolve_attention_backend(backend_name, CPU, dtype, kv_format, HEAD_DIM)
    runner = ModelRunner(model, pool, attention_backend=backend)
    plan, _ = plan_step(SchedulerOutput(chunks=scheduled), BLOCK_SIZE)
    metadata = runner.prepare(plan).context
    total = sum(c.num_tokens for c in chunks)
    # one [T, (H + 2 KVH) * D] buffer, as a fused layer's q/k/v product
    qkv = torch.randn(total, (NUM_KV_HEADS * (GROUP + 2)) * HEAD_DIM).to(dtype)
    q_end, k_end = GROUP * NUM_KV_HEADS * HEAD_DIM, (GROUP + 1) * NUM_KV_HEADS * HEAD_DIM
    q, k, v = (qkv[:, a:b].view(total, -1, HEAD_DIM)
               for a, b in ((0, q_end), (q_end, k_end), (k_end, qkv.shape[1])))
    return pool, plan, metadata, (q, k, v)


def _reference(pool: KVCachePool, plan, query: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA of every chunk's queries over its sequence's K/V as the pool holds them: [T, H, D]."""
    kv = pool.layer(0)  # [2, KVH, NB, bs, D]
    out, row = [], 0
    for chunk in plan.chunks:
        blocks = chunk.block_table[:-(-chunk.end // BLOCK_SIZE)]
        keys, values = (kv[i][:, blocks].reshape(NUM_KV_HEADS, -1, HEAD_DIM)[:, :chunk.end]
                        for i in (0, 1))  # [KVH, end, D]
        q = query[row:row + chunk.num_tokens].transpose(0, 1).float()  # [H, n, D]
        positions = torch.arange(chunk.start, chunk.end).unsqueeze(1)
        mask = torch.arange(chunk.end).unsqueeze(0) <= positions  # [n, end]: causal with offset
        o = F.scaled_dot_product_attention(
            q, keys.float().repeat_interleave(GROUP, 0), values.float().repeat_interleave(GROUP, 0),
            attn_mask=mask, scale=HEAD_DIM ** -0.5)
        out.append(o.transpose(0, 1).to(dtype))
        row += chunk.num_tokens
    return torch.cat(out)


class _Layer(torch.nn.Module):
    layer_idx = 0


BACKEND_CASES = [("sdpa", torch.float32), ("cpu", torch.float32), ("cpu", torch.bfloat16),
                 ("triton", torch.float32)]


@pytest.mark.parametrize("backend_name, dtype", BACKEND_CASES)
def test_each_backend_computes_sdpa_over_the_whole_context(backend_name, dtype):
    """Decodes of ragged contexts and prefill chunks from 0 and after a cached prefix, in one
    step: the backend's metadata and forward give SDPA's output over each sequence's K/V; its
    fused-layer entry gives the same, bit for bit."""
    if backend_name == "triton" and not interpreting():
        pytest.skip("the Triton kernel runs on CPU tensors under its interpreter only")
    pool, plan, metadata, (q, k, v) = _step(MIXED, dtype, backend_name)
    assert metadata.backend.name == backend_name
    out, _ = paged_attention_forward(_Layer(), *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                                     None, scaling=HEAD_DIM ** -0.5, **{CONTEXT_KWARG: metadata})
    expected = _reference(pool, plan, q, dtype)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    error = (out[0].float() - expected.float()).abs().max().item()
    assert error < bound, f"max abs error {error:.2e}"
    fused = fused_layer_attention(0, q, k, v, metadata, HEAD_DIM ** -0.5)
    assert torch.equal(fused, out[0])


def test_the_cpu_backend_takes_the_prefill_kernel_where_it_runs():
    for dtype, flag in ((torch.float32, "avx512f"), (torch.bfloat16, "avx512_bf16")):
        _, _, metadata, _ = _step(MIXED, dtype, "cpu")
        has_kernel = flag in cpu_features().flags
        assert metadata.backend.cpu_kernel and metadata.decode is not None
        assert (metadata.prefill is not None) is has_kernel
        assert bool(metadata.prefills) is not has_kernel


def test_the_engine_resolves_its_backend_once_and_the_runner_uses_it(tiny_llama):
    engine = tiny_llama.engine()
    assert engine.runner.attention_backend is engine.attention_backend
    assert engine.attention_backend.name == "cpu" and engine.attention_backend.cpu_kernel
