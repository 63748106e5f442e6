"""KV storage formats: 8-bit codes with per-(token, KV head) scales, their error and their size."""

from __future__ import annotations

import pytest
import torch

from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
from kvfleet.worker.engine.memory.kv_format import KV_DTYPE_CHOICES, resolve_kv_format, rotation_matrix

QUANTIZED = ["fp8", "int8"]


def rows(seed: int = 0, n: int = 64, dim: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # K/V rows with very different magnitudes per token, as real caches have
    return torch.randn(n, dim, generator=g) * torch.logspace(-3, 2, n).unsqueeze(1)


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_round_trip_error_is_bounded_relative_to_each_rows_max(name):
    fmt = resolve_kv_format(name, torch.float32)
    x = rows()
    codes, scale = fmt.quantize(x)
    assert codes.dtype == fmt.storage and codes.shape == x.shape
    assert scale.shape == (64,) and scale.dtype == torch.float16
    back = fmt.dequantize(codes, scale, torch.float32)
    row_max = x.abs().amax(dim=1, keepdim=True)
    rel = ((back - x).abs() / row_max).amax().item()
    # int8: half a step of max/127; fp8 e4m3: 3 mantissa bits, relative error <= 2^-4
    assert rel <= (0.5 / 127 + 1e-3 if name == "int8" else 2 ** -4 + 1e-3)
    assert rel > 0  # it really is quantised


def test_zero_rows_and_tiny_rows_dequantise_without_nan():
    fmt = resolve_kv_format("int8", torch.float32)
    x = torch.zeros(3, 8)
    x[1] = 1e-12
    codes, scale = fmt.quantize(x)
    back = fmt.dequantize(codes, scale, torch.float32)
    assert torch.isfinite(back).all() and back.abs().max() < 1e-6


def test_plain_formats_store_the_values_in_their_dtype():
    fmt = resolve_kv_format("bf16", torch.float32)
    x = rows(n=4)
    codes, scale = fmt.quantize(x)
    assert scale is None and codes.dtype == torch.bfloat16
    assert torch.equal(fmt.dequantize(codes, None, torch.float32), x.to(torch.bfloat16).float())


def test_auto_follows_the_model_dtype_and_bad_names_are_refused():
    assert resolve_kv_format("auto", torch.bfloat16).name == "bf16"
    assert resolve_kv_format("auto", torch.float32).name == "fp32"
    assert set(KV_DTYPE_CHOICES) == {"auto", "bf16", "fp16", "fp32", "fp8", "int8"}
    with pytest.raises(ValueError, match="kv_dtype"):
        resolve_kv_format("int4", torch.float32)


@pytest.mark.parametrize("head_dim, at_least", [(64, 1.93), (128, 1.96)])
def test_8bit_formats_hold_about_twice_the_tokens_of_bf16(head_dim, at_least):
    bf16 = KVLayout(30, 3, head_dim, resolve_kv_format("bf16", torch.float32)).bytes_per_token
    for name in QUANTIZED:
        layout = KVLayout(30, 3, head_dim, resolve_kv_format(name, torch.float32))
        assert layout.bytes_per_token == 2 * 30 * 3 * (head_dim + 2)
        assert bf16 / layout.bytes_per_token >= at_least


@pytest.mark.parametrize("name", QUANTIZED + ["bf16"])
def test_pool_write_then_gather_returns_the_values_and_swaps_round_trip(name):
    fmt = resolve_kv_format(name, torch.float32)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, kv_format=fmt)
    pool = KVCachePool(layout, num_blocks=5, block_size=4, device=torch.device("cpu"))
    assert pool.num_bytes == 5 * 4 * layout.bytes_per_token
    key, value = rows(1, n=2 * 3, dim=8), rows(2, n=2 * 3, dim=8)  # 3 tokens x 2 KV heads
    slots = torch.tensor([8, 9, 10])  # block 2, offsets 0..2
    slot_rows = (torch.arange(2).unsqueeze(1) * 20 + slots).view(-1)  # head h at h * 5 * 4
    pool.write(1, slot_rows, key, value)
    block_rows = torch.tensor([2, 7, 12, 17])  # K head 0, K head 1, V head 0, V head 1 of block 2
    got = pool.gather(1, block_rows, torch.float32).view(2, 2, 4, 8)[:, :, :3]
    rotation = pool.rotation(torch.float32)
    assert (rotation is not None) == (name == "int8")
    if rotation is not None:  # int8 rows are stored rotated
        got = got @ rotation.T
    tol = 0.07 if name == "fp8" else 0.01
    assert torch.allclose(got[0].reshape(-1, 8), key, rtol=tol, atol=tol * key.abs().max().item())
    assert torch.allclose(got[1].reshape(-1, 8), value, rtol=tol, atol=tol * value.abs().max().item())
    host = pool.copy_out([2])
    assert host.num_bytes == pool.block_bytes
    pool.copy_in(host, [4])
    moved = pool.gather(1, block_rows + 2, torch.float32)  # the same rows of block 4
    assert torch.equal(moved, pool.gather(1, block_rows, torch.float32))


@pytest.mark.parametrize("dim", [8, 64, 80])
def test_rotations_are_orthonormal(dim):
    r = rotation_matrix(dim)
    assert torch.allclose(r @ r.T, torch.eye(dim), atol=1e-5)


def test_rotating_rows_with_outlier_channels_shrinks_the_int8_error():
    fmt = resolve_kv_format("int8", torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=g)
    x[:, [5, 17]] *= 30  # two outlier channels set every row's max, as in real keys
    r = rotation_matrix(64)

    def error(rows, rotation):
        codes, scale = fmt.quantize(rows @ rotation)
        back = fmt.dequantize(codes, scale, torch.float32) @ rotation.T
        return ((back - rows).norm() / rows.norm()).item()

    assert error(x, r) < 0.5 * error(x, torch.eye(64))


def test_engine_config_refuses_unknown_formats_and_policies():
    from kvfleet.worker.engine.core.config import EngineConfig

    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype="int4")
    with pytest.raises(ValueError, match="preemption"):
        EngineConfig(preemption="sometimes")
    with pytest.raises(ValueError, match="swap_space_bytes"):
        EngineConfig(swap_space_bytes=-1)


def test_engine_logs_what_each_format_would_hold(tiny_llama):
    engine = tiny_llama.engine(kv_dtype="int8", num_blocks=10, block_size=4)
    assert engine.pool.layer(0).dtype == torch.int8
    report = engine.budget_report()
    assert "(int8)" in next(line for line in report if line.startswith("KV bytes per token"))
    by_format = next(line for line in report if line.startswith("tokens that fit by --kv-dtype"))
    # head_dim 16: int8 rows are 16 + 2 bytes, fp32 rows 64: the same bytes hold 3.5x the tokens
    assert "int8 40" in by_format and "fp32 8" in by_format
    assert any(line.startswith("preemption: auto; host swap space") for line in report)
