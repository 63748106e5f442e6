"""The C++ kernels' binding (kernel_binding.py, cpu_kernels.py): typed from each kernel's header,
checked against the sources by the compiler and against every call in worker/ here, and one
kernel that fails to build leaves the others working."""

from __future__ import annotations

import ast
import ctypes
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.engine.tiny_models import greedy, random_prompt, run_to_completion
from kvfleet.worker.engine.kernels import cpu_kernels, cpu_linear
from kvfleet.worker.engine.kernels.cpu_attention import KernelUnavailable
from kvfleet.worker.engine.kernels.cpu_kernels import KERNELS, KernelSource, build_and_bind
from kvfleet.worker.engine.model.cpu_layers import rms_norm
from kvfleet.worker.engine.attention import resolve_backend_name
from kvfleet.worker.engine.kernels.kernel_binding import HeaderError, parse_header, read_header

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def declared(name: str) -> dict:
    return {d.name: d for d in read_header(KERNELS[name].header)}


def test_the_parser_types_scalars_and_pointers_and_refuses_the_rest():
    (function,) = parse_header('''
        // a comment (int ignored(void);)
        extern "C" {
        /* another */ int f(int a, const int64_t b, float c, const int32_t* d, void *e,
                            const float* const g, double h);
        }''')
    assert function.name == "f" and function.restype is ctypes.c_int
    assert function.argtypes == (ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double)
    assert function.params == ("a", "b", "c", "d", "e", "g", "h")
    (none,) = parse_header('extern "C" { void g(void); }')
    assert none.restype is None and none.argtypes == ()
    with pytest.raises(HeaderError, match="parameter 'x' of type 'size_t'"):
        parse_header('extern "C" { int f(size_t x); }')
    with pytest.raises(HeaderError, match="needs a type and a name"):
        parse_header('extern "C" { int f(int); }')
    with pytest.raises(HeaderError, match="return type 'float'"):
        parse_header('extern "C" { float f(int x); }')
    with pytest.raises(HeaderError, match='no extern "C"'):
        parse_header("int f(int x);")


def test_each_library_exports_what_its_header_declares():
    """Every kvfleet_ function a library exports is declared (so typed), and nothing else is."""
    if shutil.which("nm") is None:
        pytest.fail("nm (binutils) is needed to list a library's symbols")
    for name in KERNELS:
        library = cpu_kernels.build_kernel(name)
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                                 text=True, check=True).stdout
        exported = set(re.findall(r"\bT (kvfleet_\w+)$", symbols, re.M))
        assert exported == set(declared(name)), name
        bound = cpu_kernels.kernel(name)
        for function, declaration in declared(name).items():
            assert getattr(bound, function).argtypes == declaration.argtypes


def _kernel_calls(tree: ast.AST):
    """(function, positional argument count) of each call of a kernel function: the bound
    function by its name (`kernel.kvfleet_linear(...)`) or held under it (`self._kvfleet_linear`)."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr.lstrip("_").startswith("kvfleet_")):
            yield node.func.attr.lstrip("_"), len(node.args), node.lineno


def test_every_call_in_worker_passes_what_the_header_declares():
    """ctypes refuses too few arguments but passes extra ones through: each call site's count is
    checked here against the declaration."""
    declarations = {d.name: d for spec in KERNELS.values() for d in read_header(spec.header)}
    called = set()
    for path in (ROOT / "worker").rglob("*.py"):
        for function, count, line in _kernel_calls(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{line}"
            assert function in declarations, f"{where}: {function} is declared in no header"
            assert count == len(declarations[function].params), (
                f"{where}: {function} takes {declarations[function].params}, called with {count}")
            called.add(function)
    assert called == set(declarations)  # every function is called somewhere, so checked


def _copy_kernel(tmp_path: Path, name: str) -> KernelSource:
    """A copy of a kernel's source and headers in tmp_path, to be changed by the test."""
    spec = KERNELS[name]
    for path in (spec.source, spec.header, *cpu_kernels.COMMON_HEADERS):
        shutil.copy(path, tmp_path / path.name)
    return KernelSource(tmp_path / spec.source.name, tmp_path / spec.header.name)


def _add_parameter(path: Path, before: str, after: str) -> None:
    text = path.read_text()
    assert before in text
    path.write_text(text.replace(before, after))


def test_a_parameter_added_to_a_declaration_reaches_the_binding(tmp_path):
    """Header and source changed together: the binding takes the new parameter from the header,
    and a call that leaves it out is refused instead of reading garbage."""
    copy = _copy_kernel(tmp_path, "layer_ops")
    _add_parameter(copy.header, "int64_t rows, int inter,", "int64_t rows, int inter, int extra,")
    _add_parameter(copy.source, "int64_t rows,\n                                int inter,",
                   "int64_t rows,\n                                int inter, int extra,")
    bound = build_and_bind("layer_ops", {"layer_ops": copy}, tmp_path / "cache")
    assert len(bound.kvfleet_silu_mul.argtypes) == len(declared("layer_ops")["kvfleet_silu_mul"].params) + 1
    gate_up, out = torch.randn(2, 8), torch.empty(2, 4)
    with pytest.raises(TypeError, match="argument"):
        bound.kvfleet_silu_mul(0, gate_up.data_ptr(), out.data_ptr(), 2, 4, 1)


def test_a_declaration_the_source_does_not_match_fails_its_build(tmp_path, caplog):
    """The header changed alone: the compiler refuses the source's definition, so the kernel is
    unavailable (and the log says why) rather than bound to a function of another signature."""
    copy = _copy_kernel(tmp_path, "layer_ops")
    _add_parameter(copy.header, "int64_t rows, int inter,", "int64_t rows, int inter, int extra,")
    with caplog.at_level(logging.WARNING, logger="kvfleet.worker.engine.kernels.cpu_kernels"):
        bound = build_and_bind("layer_ops", {"layer_ops": copy}, tmp_path / "cache")
    assert isinstance(bound, cpu_kernels.UnavailableKernel)
    assert "conflicting declaration" in bound.reason and "kvfleet_silu_mul" in bound.reason
    assert "the layer_ops kernel (cpu_layer_ops.cpp) is unavailable" in caplog.text
    with pytest.raises(KernelUnavailable, match="kvfleet_rms_norm: the layer_ops kernel"):
        bound.kvfleet_rms_norm


@pytest.fixture
def broken(monkeypatch, tmp_path):
    """Replace one kernel of the registry by a copy of its source that does not compile."""
    def replace(name: str) -> None:
        copy = _copy_kernel(tmp_path, name)
        copy.source.write_text(copy.source.read_text() + "\nthis is not C++;\n")
        monkeypatch.setitem(KERNELS, name, copy)
        cpu_kernels.clear_cache()
        cpu_linear.own_product.cache_clear()
    yield replace
    cpu_kernels.clear_cache()
    cpu_linear.own_product.cache_clear()


def test_a_broken_layer_ops_source_leaves_attention_and_products(broken, tiny_llama):
    broken("layer_ops")
    assert "compiling cpu_layer_ops.cpp failed" in cpu_kernels.unavailable_reason("layer_ops")
    assert all(cpu_kernels.unavailable_reason(name) is None
               for name in ("decode", "prefill", "matmul"))
    assert "layer_ops unavailable: compiling cpu_layer_ops.cpp failed" in cpu_kernels.report()
    with pytest.raises(KernelUnavailable):
        rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5)
    engine = tiny_llama.engine(attention_backend="cpu")
    assert engine.runner.attention_backend.cpu_kernel and engine.prepared.num_fused_layers == 0  # HF layers
    prompt = random_prompt(12, seed=3)
    engine.add_request("r", prompt, greedy(10))
    assert run_to_completion(engine)["r"] == tiny_llama.reference(prompt, 10)


def test_a_broken_decode_source_leaves_the_other_kernels(broken):
    broken("decode")
    assert "compiling cpu_attention.cpp failed" in cpu_kernels.unavailable_reason("decode")
    assert resolve_backend_name("auto", CPU) == "sdpa"
    x, weight = torch.randn(3, 16), torch.randn(16)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    assert torch.allclose(rms_norm(x, weight, 1e-5), expected, atol=1e-5)
    # 0: unsupported, 1: the AVX-512 product, 2: the portable one (an AVX2-only CPU)
    assert cpu_kernels.matmul_kernel().kvfleet_linear_supported(0) in (0, cpu_linear.FAST, cpu_linear.PORTABLE)
