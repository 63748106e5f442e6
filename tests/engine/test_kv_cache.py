"""The KV pool's budget: bytes per token, blocks from a byte budget, the operator's report."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvfleet.shared.cpu_features import CpuFeatures, cpu_features
from kvfleet.worker.engine.memory.device import resolve_device, resolve_dtype
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout, plan_budget
from kvfleet.worker.engine.memory.kv_format import resolve_kv_format

FP32 = resolve_kv_format("fp32", torch.float32)


def test_bytes_per_token_of_the_default_model_shape():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, kv_format=FP32)
    assert layout.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert KVLayout(30, 3, 64, resolve_kv_format("bf16", torch.float32)).bytes_per_token == 23_040


def test_dtype_and_device_resolution():
    cpu = resolve_device("cpu")
    avx2_only = CpuFeatures("some AVX2 CPU", frozenset({"avx", "avx2", "fma"}))
    avx512_bf16 = CpuFeatures("Zen 4", frozenset({"avx2", "avx512f", "avx512_bf16"}))
    amx = CpuFeatures("Sapphire Rapids", frozenset({"avx512f", "amx_tile", "amx_bf16"}))
    assert resolve_dtype("auto", cpu, avx2_only) is torch.float32  # bf16 would be emulated
    assert resolve_dtype("auto", cpu, avx512_bf16) is torch.bfloat16
    assert resolve_dtype("auto", cpu, amx) is torch.bfloat16
    assert resolve_dtype("auto", cpu, CpuFeatures("unknown", frozenset())) is torch.float32
    # without a CpuFeatures: this machine's own verdict
    assert resolve_dtype("auto", cpu) is (torch.bfloat16 if cpu_features().native_bf16
                                          else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda"), avx2_only) is torch.bfloat16
    assert resolve_dtype("float32", cpu, amx) is torch.float32
    assert resolve_dtype("float16", cpu) is torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cpu)


def test_cpu_budget_sizes_the_pool_and_reports_it():
    model = torch.nn.Linear(1000, 1000)  # 4.004 MB of float32 weights
    layout = KVLayout(30, 3, 64, FP32)
    budget = plan_budget(model, layout, block_size=16, max_model_len=8192, device=torch.device("cpu"),
                         num_blocks=None, kv_memory_bytes=1 << 30, gpu_memory_utilization=0.9)
    assert budget.num_blocks == (1 << 30) // (46_080 * 16) == 1456
    assert budget.tokens_that_fit == 23_296
    report = budget.report()
    assert report[0] == "weights: 4.00 MB"
    assert report[1].startswith("KV cache: 1.07 GB") and "1456 blocks x 16 tokens" in report[1]
    assert report[2] == "KV bytes per token: 46,080 (fp32)"
    assert report[3] == "tokens that fit: 23,296"
    assert report[4] == "conversations of 2k tokens that fit: 11"
    assert report[5] == "conversations of 8k tokens that fit: 2"


def test_explicit_num_blocks_wins_and_an_empty_budget_is_an_error():
    model = torch.nn.Linear(4, 4)
    layout = KVLayout(2, 2, 16, FP32)
    budget = plan_budget(model, layout, 4, 512, torch.device("cpu"), num_blocks=7,
                         kv_memory_bytes=0, gpu_memory_utilization=0.9)
    assert budget.num_blocks == 7
    with pytest.raises(ValueError, match="holds no block"):
        plan_budget(model, layout, 4, 512, torch.device("cpu"), num_blocks=None,
                    kv_memory_bytes=100, gpu_memory_utilization=0.9)


def test_engine_pool_tensors_match_the_budget(tiny_llama):
    engine = tiny_llama.engine(num_blocks=10, block_size=4)
    assert engine.pool.layer(0).shape == (2, 2, 10, 4, 16)  # K/V, kv heads, blocks, slots, dim
    assert engine.pool.layer(1).data_ptr() != engine.pool.layer(0).data_ptr()
    assert engine.pool.num_bytes == 10 * 4 * engine.budget.bytes_per_token
    assert engine.budget_report()[1].startswith("KV cache:")
    assert engine.max_model_len == 512


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_cpu_pool_memory_is_resident_from_the_start():
    """Every page of the pool is faulted in when the pool is made: no step stops later while the
    kernel clears a page on its first write, and a pool the machine cannot back fails at
    start-up."""
    layout = KVLayout(4, 2, 64, resolve_kv_format("auto", torch.bfloat16))
    before = _resident_bytes()
    pool = KVCachePool(layout, 512, 64, torch.device("cpu"))  # 64 MiB
    assert pool.num_bytes == 64 * 2**20
    assert _resident_bytes() - before >= 0.9 * pool.num_bytes
    assert not pool.layer(3).any()


def test_cpu_pool_memory_starts_zeroed_and_belongs_to_its_pool():
    """The CPU pool lives in its own anonymous (huge-page advised) mapping: zeroed, writable, not
    shared with another pool, and alive as long as the tensor is."""
    layout = KVLayout(2, 3, 64, resolve_kv_format("auto", torch.bfloat16))
    first, second = (KVCachePool(layout, 40, 16, torch.device("cpu")) for _ in range(2))
    assert first.layer(1).shape == (2, 3, 40, 16, 64) and first.layer(1).dtype == torch.bfloat16
    assert not first.layer(0).any() and not first.layer(1).any()
    first.layer(1).fill_(1.5)
    gc.collect()
    assert (first.layer(1) == 1.5).all() and not first.layer(0).any()
    assert not second.layer(1).any()
    assert first.num_bytes == 2 * 2 * 3 * 40 * 16 * 64 * 2
