"""Settings are defined once: the engine's configuration is the worker's settings, every KVFLEET_*
variable is read through a settings class, and the README's tables are the fields' own texts."""

from __future__ import annotations

import argparse
import ast
import os
import dataclasses
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvfleet.flags import add_settings_flags, settings_from_args
from kvfleet.settings_doc import SECTIONS, settings_tables
from kvfleet.shared.byte_size import binary_size_text
from kvfleet.shared.engine_config import (ENGINE_ONLY, FIELD_GROUPS, GROUPS, CacheConfig,
                                          EngineConfig, LoraConfig, SpeculativeConfig,
                                          _with_group_fields, field_groups)
from kvfleet.shared.settings import KernelSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_MODULE = ROOT / "shared" / "settings.py"
SCANNED = ("shared", "worker", "batch", "gateway", "kvfleet", "benchmarks")
# Not settings of kvfleet: where benchmarks/vllm_env.sh and benchmarks/sglang_router_env.sh put
# the peers' virtualenvs (the shell scripts read them too).
NOT_SETTINGS = {"KVFLEET_VLLM_VENV", "KVFLEET_SGLANG_ROUTER_VENV"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVFLEET_")]:
        monkeypatch.delenv(name)


def test_the_readme_holds_the_settings_tables_as_the_fields_describe_them():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- settings tables:")
    start = readme.index("\n", start) + 1
    end = readme.index("<!-- end of settings tables -->")
    assert readme[start:end] == settings_tables(), \
        "README.md's settings tables are stale: paste `python -m kvfleet.settings_doc` there"


def test_every_field_is_described_and_in_a_table():
    tables = settings_tables()
    for _, settings_cls, _ in SECTIONS:
        for name, field in settings_cls.model_fields.items():
            assert field.description, f"{settings_cls.__name__}.{name} has no description"
            assert f"| `KVFLEET_{name.upper()}` |" in tables


def test_the_workers_engine_settings_are_the_engine_config_fields(clean_env):
    engine_fields = EngineConfig.__pydantic_fields__
    settings_fields = WorkerSettings.model_fields
    for name, field in engine_fields.items():
        if name in ENGINE_ONLY:
            assert name not in settings_fields
            continue
        setting = settings_fields[name]
        assert (setting.annotation, setting.default, setting.description, setting.metadata) == \
               (field.annotation, field.default, field.description, field.metadata)
    assert WorkerSettings().engine_config() == EngineConfig()
    given = WorkerSettings(kv_memory="2GiB", swap_space="512MiB", block_size=32, kv_dtype="int8",
                           max_running=8, enable_prefix_caching=False).engine_config()
    assert (given.kv_memory_bytes, given.swap_space_bytes) == (2 << 30, 512 << 20)
    assert (given.block_size, given.kv_dtype, given.max_running) == (32, "int8", 8)
    assert given.enable_prefix_caching is False


def test_the_engine_config_keeps_its_keywords_and_checks_every_construction():
    config = EngineConfig(kv_memory_bytes=1 << 20, swap_space_bytes=0, block_size=4)
    assert (config.kv_memory_bytes, config.swap_space_bytes) == (config.kv_memory, 0) == (1 << 20, 0)
    assert EngineConfig(kv_memory="1MiB") == EngineConfig(kv_memory_bytes=1 << 20)
    resized = dataclasses.replace(config, block_size=64)  # what the engine does with `auto`
    assert (resized.block_size, resized.kv_memory_bytes) == (64, 1 << 20)
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(config, block_size=0)
    with pytest.raises(ValueError, match="swap_space_bytes"):
        EngineConfig(swap_space_bytes=-1)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="(?s)kv_dtype.*'fp8'"):
        EngineConfig(kv_dtype="int4")
    with pytest.raises(ValueError, match="no_such_field"):
        EngineConfig(no_such_field=1)


# One value other than the default for every flat field: each must land in its group.
NOT_DEFAULTS = {
    "device": "cpu", "dtype": "float32", "load_format": "dummy", "attention_backend": "sdpa",
    "cuda_graphs": "off", "deterministic": False, "grammar_cache_size": 8,
    "tensor_parallel_size": 2, "block_size": 32, "num_blocks": 100, "kv_memory": "2GiB",
    "gpu_memory_utilization": 0.5, "kv_dtype": "int8", "swap_space": "1GiB",
    "kv_offloading_size": 1.5, "kv_offloading_disk": "/var/cache/kvfleet",
    "kv_offloading_disk_size": 8.0, "enable_prefix_caching": False, "watermark": 0.05,
    "preemption": "swap", "max_batched_tokens": 256, "max_running": 8, "target_itl_ms": 30.0,
    "target_ttft_ms": 500.0, "min_target_itl_ms": 10.0, "pace_warmup": False,
    "enable_lora": True, "max_loras": 2, "max_cpu_loras": 8, "max_lora_rank": 64,
    "speculative_config": '{"method": "ngram"}',
}
# fields that are valid only with others of their group (the disk tier sits behind the host tier)
COMPANIONS = {
    "kv_offloading_disk": {"kv_offloading_size": 1.5, "kv_offloading_disk_size": 8.0},
    "kv_offloading_disk_size": {"kv_offloading_size": 1.5,
                                "kv_offloading_disk": "/var/cache/kvfleet"},
}


def test_each_flat_keyword_lands_in_its_group_and_nowhere_else():
    assert set(NOT_DEFAULTS) == set(EngineConfig.__pydantic_fields__) == set(FIELD_GROUPS)
    default = EngineConfig()
    for name, value in NOT_DEFAULTS.items():
        config = EngineConfig(**{name: value, **COMPANIONS.get(name, {})})
        group = FIELD_GROUPS[name]
        flat = getattr(config, name)
        assert flat != getattr(default, name), name
        if group in GROUPS:
            assert isinstance(getattr(config, group), GROUPS[group])
            assert getattr(getattr(config, group), name) == flat, name
        for other in GROUPS:
            if other != group:
                assert getattr(config, other) == getattr(default, other), (name, other)
    assert EngineConfig(kv_memory="2GiB").cache.kv_memory_bytes == 2 << 30
    assert EngineConfig(max_loras=3).lora.lora_cache_size == 12  # derived in its group
    assert EngineConfig(speculative_config='{"method": "ngram"}').speculative_config == \
        SpeculativeConfig(method="ngram")


def test_the_groups_are_frozen_and_follow_every_construction():
    config = EngineConfig(block_size=16)
    with pytest.raises(ValidationError, match="frozen"):
        config.cache.block_size = 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 64  # the flat field and its group cannot disagree
    resized = dataclasses.replace(config, block_size=64)
    assert (resized.cache.block_size, config.cache.block_size) == (64, 16)
    with pytest.raises(ValidationError, match="no_such_field"):
        CacheConfig(no_such_field=1)


def test_checks_within_a_group_and_across_groups_stay():
    message = r"max_cpu_loras \(2\) must be >= max_loras \(4\)"
    with pytest.raises(ValueError, match=message):
        EngineConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match=message):
        LoraConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(kv_offloading_size=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="draft model"):
        EngineConfig(kv_offloading_size=1,
                     speculative_config={"method": "draft_model", "model": "draft"})


def test_every_flat_field_belongs_to_exactly_one_group():
    assert field_groups(["a", "b"], {"x": ("a",), "y": ("b",)}) == {"a": "x", "b": "y"}
    with pytest.raises(ValueError, match="b is in 0 groups"):
        field_groups(["a", "b"], {"x": ("a",)})
    with pytest.raises(ValueError, match=r"b is in 2 groups \['x', 'y'\]"):
        field_groups(["a", "b"], {"x": ("a", "b"), "y": ("b",)})
    with pytest.raises(ValueError, match="y.c is not a flat field"):
        field_groups(["a"], {"x": ("a",), "y": ("c",)})
    with pytest.raises(TypeError, match="block_size is written twice"):
        @_with_group_fields
        class Twice:
            block_size: int = 16


def test_flags_and_variables_reach_the_groups(clean_env, monkeypatch):
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, WorkerSettings)
    monkeypatch.setenv("KVFLEET_BLOCK_SIZE", "32")
    monkeypatch.setenv("KVFLEET_TARGET_ITL_MS", "30")
    args = parser.parse_args(["--max-loras", "2", "--target-itl-ms", "40", "--no-pace-warmup"])
    config = settings_from_args(WorkerSettings, args).engine_config()
    assert (config.cache.block_size, config.lora.max_loras) == (32, 2)
    assert (config.pace.target_itl_ms, config.pace.pace_warmup) == (40.0, False)  # flag over env


def test_the_choices_are_the_ones_the_engine_accepts():
    from kvfleet.worker.engine.kernels import cpu_linear
    from kvfleet.worker.engine.core.cuda_graphs import CUDA_GRAPH_MODES
    from kvfleet.worker.engine.attention import ATTENTION_BACKENDS
    from kvfleet.worker.engine.memory.kv_format import KV_DTYPE_CHOICES
    from kvfleet.worker.engine.core.preemption import PREEMPTION_MODES

    def choices(cls, name):
        return typing.get_args(cls.__pydantic_fields__[name].annotation)

    assert choices(EngineConfig, "attention_backend") == ATTENTION_BACKENDS
    assert choices(EngineConfig, "cuda_graphs") == CUDA_GRAPH_MODES
    assert choices(EngineConfig, "kv_dtype") == KV_DTYPE_CHOICES
    assert choices(EngineConfig, "preemption") == PREEMPTION_MODES
    assert choices(KernelSettings, "cpu_products") == cpu_linear.PRODUCTS_CHOICES


def test_the_kernel_variables_are_read_through_their_settings(monkeypatch, tmp_path):
    from kvfleet.worker.engine.kernels import cpu_kernels, cpu_linear

    monkeypatch.setenv("KVFLEET_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.kernel_cache_dir() == tmp_path
    monkeypatch.setenv("KVFLEET_KERNEL_CACHE", "")  # empty: the default, as before
    assert cpu_kernels.kernel_cache_dir() == Path.home() / ".cache" / "kvfleet" / "kernels"
    monkeypatch.setenv("KVFLEET_KERNEL_SANITIZE", "address")
    assert cpu_kernels.sanitizer() == "address"
    monkeypatch.setenv("KVFLEET_KERNEL_SANITIZE", "")
    assert cpu_kernels.sanitizer() is None
    monkeypatch.setenv("KVFLEET_CPU_PRODUCTS", "onednn")
    assert cpu_linear.products_choice() == "onednn"
    monkeypatch.setenv("KVFLEET_CPU_PRODUCTS", "fastest")
    with pytest.raises(ValueError, match="KVFLEET_CPU_PRODUCTS='fastest': expected one of"):
        KernelSettings()
    monkeypatch.setenv("KVFLEET_KERNEL_SANITIZE", "thread")
    with pytest.raises(ValueError):
        KernelSettings()


def test_sizes_are_shown_in_the_largest_binary_unit():
    assert [binary_size_text(n) for n in (1 << 30, 4 << 30, 512 << 20, 1000)] == \
           ["1GiB", "4GiB", "512MiB", "1000"]


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "text" assignments (a variable's name kept in a constant)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            found.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return found


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" or \
        isinstance(node, ast.Name) and node.id == "environ"


def _variables_read(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each os.environ.get / os.getenv / os.environ[...] / `in os.environ` read
    whose variable name is a string constant (or a module constant holding one)."""
    constants = _string_constants(tree)

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            reads_environ = func.attr in ("get", "pop") and _is_environ(func.value) \
                if isinstance(func, ast.Attribute) else False
            if reads_environ or isinstance(func, ast.Attribute) and func.attr == "getenv":
                key = node.args[0]
            elif isinstance(func, ast.Name) and func.id == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and (name := name_of(key)) is not None:
            reads.append((node.lineno, name))
    return reads


def test_no_kvfleet_variable_is_read_outside_the_settings_classes():
    offenders = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == SETTINGS_MODULE:
                continue
            for line, name in _variables_read(ast.parse(path.read_text(), str(path))):
                if name.startswith("KVFLEET_") and name not in NOT_SETTINGS:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    assert not offenders, "read these through a settings class (shared/settings.py):\n" + \
        "\n".join(offenders)


def test_the_scan_finds_each_way_of_reading_a_variable():
    source = '''
import os
from os import environ, getenv
NAME = "KVFLEET_A"
os.environ.get(NAME); os.getenv("KVFLEET_B"); os.environ["KVFLEET_C"]; getenv("KVFLEET_D")
"KVFLEET_E" in os.environ; environ.get("KVFLEET_F"); os.environ["KVFLEET_G"] = "written"
os.environ.get("CXX")
'''
    names = [name for _, name in _variables_read(ast.parse(source))]
    assert sorted(names) == ["CXX", "KVFLEET_A", "KVFLEET_B", "KVFLEET_C", "KVFLEET_D",
                             "KVFLEET_E", "KVFLEET_F"]
