"""The numerics fingerprint (worker/engine/model/numerics.py): decided by the machine's features and
the settings alone, so processes started together on a loaded host agree; different wherever
the rounding can differ (a negative control per component the settings can change here)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from kvfleet.shared.cpu_features import cpu_features
from tests.engine.tiny_models import MODEL_FACTORIES
from kvfleet.worker.engine.kernels import cpu_linear
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.model.numerics import Numerics

# bf16 where the CPU computes it natively (the default dtype there), else float32 (the default)
DTYPE = "bfloat16" if cpu_features().native_bf16 else "float32"


def fingerprint_of(dtype: str = DTYPE, **config) -> str:
    torch.manual_seed(0)
    model = MODEL_FACTORIES["llama"]()
    engine = Engine(model, EngineConfig(**{"device": "cpu", "dtype": dtype, "num_blocks": 32,
                                           "block_size": 16, **config}))
    return engine.numerics.fingerprint


def _child_fingerprint(_: int) -> str:
    return fingerprint_of()


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def test_the_fingerprint_names_its_components_and_changes_with_any():
    numerics = Numerics({"dtype": "bfloat16", "linears": "kvfleet product 1"})
    assert numerics.fingerprint.startswith("fp_") and len(numerics.fingerprint) == 13
    assert numerics.fingerprint == Numerics(dict(numerics.components)).fingerprint
    assert Numerics({"dtype": "bfloat16", "linears": "kvfleet product 2"}).fingerprint \
        != numerics.fingerprint
    assert "dtype bfloat16; linears kvfleet product 1" in numerics.describe()


def test_an_engine_fingerprint_follows_its_settings():
    """Same settings, same fingerprint; another dtype, block size or numerics mode another. The
    components say what computes: the CPU's rounding flags, kernels, linears, attention."""
    first = fingerprint_of()
    assert fingerprint_of() == first
    other_dtype = "float32" if DTYPE == "bfloat16" else "bfloat16"
    assert fingerprint_of(other_dtype) != first
    assert fingerprint_of(block_size=32) != first
    assert len({first, fingerprint_of(deterministic=False)}) == 2
    torch.manual_seed(0)
    engine = Engine(MODEL_FACTORIES["llama"](), EngineConfig(device="cpu", dtype=DTYPE,
                                                             num_blocks=32, block_size=16))
    components = engine.numerics.components
    assert components["dtype"] == DTYPE and components["invariant"] == "yes"
    assert components["attention"] == engine.attention_backend.describe()
    assert "kvfleet product" in components["linears"]  # batch-invariant: kvfleet's product
    assert set(components["cpu"].split()) <= set(cpu_features().flags)


@pytest.mark.parametrize("variable, values", [
    ("KVFLEET_CPU_PRODUCTS", ("auto", "onednn")),
    ("KVFLEET_CPU_BF16_PRODUCT", ("dot", "fma"))])
def test_a_pinned_product_changes_the_fingerprint(monkeypatch, variable, values):
    """The settings that pick another product: another fingerprint (where the product forms
    exist here: the bf16 forms need AVX512-BF16, bf16 the native kind)."""
    if variable == "KVFLEET_CPU_BF16_PRODUCT" and (
            DTYPE != "bfloat16" or not cpu_linear.own_product(torch.bfloat16, True)):
        values = ("dot", "dot")  # one product here: the same fingerprint
    prints = []
    for value in values:
        monkeypatch.setenv(variable, value)
        for cached in (cpu_linear.own_product, cpu_linear.bf16_form):
            cached.cache_clear()
        prints.append(fingerprint_of())
    for cached in (cpu_linear.own_product, cpu_linear.bf16_form):
        cached.cache_clear()
    assert (prints[0] != prints[1]) is (values[0] != values[1])


def test_processes_started_at_once_on_a_busy_host_agree():
    """Eight processes build the same engine at once while two more keep every core busy: one
    fingerprint (a start-up timing would split them: it once chose either bf16 form)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.engine.test_numerics"])
    stop = context.Event()
    burners = [context.Process(target=_burn, args=(stop,)) for _ in range(os.cpu_count() or 2)]
    for burner in burners:
        burner.start()
    try:
        with context.Pool(8) as pool:
            results = pool.map(_child_fingerprint, range(8), chunksize=1)
    finally:
        stop.set()
        for burner in burners:
            burner.join(timeout=10)
    assert set(results) == {fingerprint_of()}
