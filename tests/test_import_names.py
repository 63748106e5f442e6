"""The project's import names live under one namespace (issue 50, item 4): the folders gateway/,
worker/, shared/ and batch/ are imported as kvfleet.gateway, kvfleet.worker, kvfleet.shared and
kvfleet.batch, in a checkout (kvfleet/_checkout.py) and in the installed wheel (setup.py), so no
other distribution's top-level `worker` or `shared` can collide with ours."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import kvfleet
from kvfleet._checkout import CheckoutFinder
from tests.test_architecture import ROOT, SUBPACKAGES, module_files


def bare_imports(path: Path, text: str) -> list[str]:
    """'file:line name' of each absolute import of a folder by its bare name (`from worker...`)."""
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [f"{path}:{node.lineno} {name}" for name in names
                  if name.split(".")[0] in SUBPACKAGES]
    return found


def test_the_check_finds_a_bare_import():
    text = ("from kvfleet.worker import engine\nimport kvfleet.shared.wire\nfrom . import x\n"
            "def f():\n    from shared.wire import Token\n    import gateway.app\n")
    assert bare_imports(Path("m.py"), text) == ["m.py:5 shared.wire", "m.py:6 gateway.app"]


def test_nothing_imports_a_folder_by_its_bare_name():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert len(files) > 300
    found = [hit for name in files for hit in bare_imports(Path(name), (ROOT / name).read_text())]
    assert found == []


def test_one_list_of_folders():
    assert set(kvfleet.SUBPACKAGES) == set(SUBPACKAGES)
    setup_py = ast.parse((ROOT / "setup.py").read_text())
    (listed,) = [ast.literal_eval(node.value) for node in setup_py.body
                 if isinstance(node, ast.Assign) and node.targets[0].id == "SUBPACKAGES"]
    assert listed == kvfleet.SUBPACKAGES


def test_a_checkout_imports_its_folders_under_kvfleet():
    import kvfleet.worker.engine.engine as engine  # noqa: PLC0415

    assert Path(engine.__file__) == ROOT / "worker" / "engine" / "engine.py"
    finder = CheckoutFinder("kvfleet", ROOT, tuple(SUBPACKAGES))
    assert finder.find_spec("kvfleet.shared").origin == str(ROOT / "shared" / "__init__.py")
    # only the four folders: the checkout's tests and benchmarks are not kvfleet's
    assert finder.find_spec("kvfleet.tests") is None and finder.find_spec("kvfleet.benchmarks") is None
    assert finder.find_spec("worker") is None


def test_the_wheel_installs_everything_under_kvfleet(tmp_path):
    """Built as pip builds it: every product module, and the kernels' C++ sources, under
    kvfleet/, and nothing else at the top but the distribution's metadata."""
    # built from a copy of the checkout's files: setuptools builds in the source's build/, where
    # modules moved or deleted since an earlier build would still be packed
    source = tmp_path / "source"
    for name in subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.split():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                           "--no-build-isolation", "--wheel-dir", str(tmp_path), str(source)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names} == {"kvfleet", wheel.name.split("-py")[0]
                                                        + ".dist-info"}
    product = {name: path for name, path in module_files().items()
               if name.split(".")[0] == "kvfleet"}
    expected = {"/".join(name.split(".")) + ("/__init__.py" if path.name == "__init__.py"
                                             else ".py") for name, path in product.items()}
    assert len(expected) > 200 and expected - names == set()
    sources = {f"kvfleet/{path}" for path in subprocess.run(
        ["git", "ls-files", "*.cpp", "*.h"], cwd=ROOT, capture_output=True, text=True,
        check=True).stdout.split()}
    assert sources and sources - names == set()
