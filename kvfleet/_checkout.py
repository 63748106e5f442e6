"""Imports kvfleet.gateway, kvfleet.worker, kvfleet.shared and kvfleet.batch from a source
checkout, where those folders sit beside kvfleet/ rather than in it (kvfleet/__init__.py).

A finder on `sys.meta_path` answers for those four names alone and hands their folders to the
standard path machinery; below them, each package's own `__path__` finds its modules as usual.
Widening `kvfleet.__path__` to the checkout's root would do the same in one line, and would also
make `kvfleet.tests`, `kvfleet.benchmarks` and `kvfleet.docs` importable."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path


class CheckoutFinder(importlib.abc.MetaPathFinder):
    def __init__(self, parent: str, root: Path, names: tuple[str, ...]):
        self.folders = {f"{parent}.{name}": str(root / name) for name in names}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [str(Path(folder).parent)])

    @classmethod
    def install(cls, parent: str, root: Path, names: tuple[str, ...]) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls(parent, root, names))
