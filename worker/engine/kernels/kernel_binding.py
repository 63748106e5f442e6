"""The ctypes binding of a C++ kernel, typed from its header: the `extern "C"` declarations of the
header are the one source of each function's argument and return types.

A kernel's source includes its own header, so the compiler refuses a definition that differs from
the declaration; this module reads the same declarations to set each function's `argtypes` and
`restype`, so the binding cannot drift from the header either. A parameter added to a declaration
makes every call that leaves it out raise TypeError instead of passing garbage. (ctypes lets a
call pass *more* arguments than `argtypes` names: tests/engine/test_kernel_binding.py checks the
argument count of every call in worker/ against the header, so a function is called by its name,
or held under it: `self._kvfleet_linear = matmul_kernel().kvfleet_linear`.)

The headers use a small subset of C: `int`, `int32_t`, `int64_t`, `float`, `double` and pointers
(passed as addresses: `tensor.data_ptr()`, or None for null). Anything else is refused, so a type
the binding cannot express is found when the header is read, not when memory is corrupted.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
           "float": ctypes.c_float, "double": ctypes.c_double}
RESULTS = {"int": ctypes.c_int, "void": None}
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_EXTERN_BLOCK = re.compile(r'extern\s+"C"\s*\{(.*?)\}', re.S)
_DECLARATION = re.compile(r"^(?P<result>[A-Za-z_][\w\s]*?)\s*\b(?P<name>[A-Za-z_]\w*)\s*"
                          r"\((?P<params>[^()]*)\)$", re.S)
_NAME = re.compile(r"^[A-Za-z_]\w*$")


class HeaderError(ValueError):
    """A header declares something the binding cannot type."""


@dataclass(frozen=True)
class Declaration:
    """One `extern "C"` function of a header, as ctypes types."""

    name: str
    restype: type | None
    argtypes: tuple[type, ...]
    params: tuple[str, ...]  # the parameters' names, in order


def parse_header(text: str) -> tuple[Declaration, ...]:
    """The function declarations inside the header's `extern "C" { ... }` blocks."""
    text = _COMMENTS.sub("", text)
    blocks = _EXTERN_BLOCK.findall(text)
    if not blocks:
        raise HeaderError('no extern "C" { ... } block')
    statements = [s.strip() for block in blocks for s in block.split(";")]
    return tuple(_declaration(" ".join(s.split())) for s in statements if s)


def read_header(path: Path) -> tuple[Declaration, ...]:
    try:
        return parse_header(path.read_text())
    except HeaderError as exc:
        raise HeaderError(f"{path.name}: {exc}") from None


def _declaration(statement: str) -> Declaration:
    match = _DECLARATION.match(statement)
    if match is None:
        raise HeaderError(f"not a function declaration: {statement!r}")
    name, result = match["name"], match["result"].strip()
    if result not in RESULTS:
        raise HeaderError(f"{name}: return type {result!r} (expected one of {', '.join(RESULTS)})")
    params = match["params"].strip()
    parsed = [] if params in ("", "void") else [_parameter(name, p) for p in params.split(",")]
    return Declaration(name, RESULTS[result], tuple(t for t, _ in parsed), tuple(n for _, n in parsed))


def _parameter(function: str, text: str) -> tuple[type, str]:
    words = text.replace("*", " * ").split()
    if len(words) < 2 or not _NAME.match(words[-1]):
        raise HeaderError(f"{function}: a parameter needs a type and a name: {text!r}")
    name, base = words[-1], " ".join(w for w in words[:-1] if w not in ("const", "*"))
    if "*" in words:
        return ctypes.c_void_p, name  # an address: data_ptr() or None
    if base not in SCALARS:
        raise HeaderError(f"{function}: parameter {name!r} of type {base!r} "
                          f"(expected a pointer or one of {', '.join(SCALARS)})")
    return SCALARS[base], name


class BoundKernel:
    """The functions a header declares, resolved once in a loaded library and typed from the
    header: `bound.kvfleet_linear(...)` is the ctypes function itself (no wrapper per call)."""

    def __init__(self, library: ctypes.CDLL, declarations: tuple[Declaration, ...]):
        self.library = library  # held: the functions below point into it
        self.declarations = {d.name: d for d in declarations}
        for declaration in declarations:
            function = getattr(library, declaration.name)  # AttributeError: not exported
            function.argtypes = declaration.argtypes
            function.restype = declaration.restype
            setattr(self, declaration.name, function)
