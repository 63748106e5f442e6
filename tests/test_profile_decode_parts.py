"""benchmarks/profile_decode.py --parts: a decode step's time split by the fused CPU layers'
calls (each product by its shape, the norms, RoPE, the attention, the rest), on a tiny random
model; and benchmarks/amx_revisions.py's --shapes."""

from __future__ import annotations

import argparse
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import amx_revisions, profile_decode
from benchmarks.prefill_parts import PartTimer
from kvfleet.shared.model_shapes import shape_config
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.kernels import cpu_linear
from kvfleet.worker.engine.model import cpu_layers


@pytest.fixture
def tiny_model(tmp_path):
    torch.manual_seed(0)
    config = shape_config("llama-3.2-1b", hidden_size=256, intermediate_size=512,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture
def restored():
    """profile_decode --parts wraps module functions for the process: put them back after."""
    saved = {name: getattr(cpu_layers, name) for name in
             ("rms_norm", "rope_", "fused_layer_attention", "silu_mul")}
    forward = cpu_linear.KernelLinear.forward
    yield
    for name, fn in saved.items():
        setattr(cpu_layers, name, fn)
    cpu_linear.KernelLinear.forward = forward


def test_parts_split_the_step_and_name_each_product(tiny_model, restored, monkeypatch, capsys):
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))  # the chat-mix prompts' ids
    monkeypatch.setattr(profile_decode, "load_tokenizer", lambda path: tokenizer)
    assert profile_decode.main(["--model", str(tiny_model), "--streams", "3", "--steps", "4",
                                "--parts"]) == 0
    out = capsys.readouterr().out
    step = float(re.search(r"step median ([\d.]+) ms", out).group(1))
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+) \|$", out, re.M))
    assert "the rest" in rows and "RMSNorm" in rows and "attention (K/V write, kernel)" in rows
    parts = {name: float(ms) for name, ms in rows.items() if name != "the rest"}
    # a batch-invariant engine (the default) computes its linears in kvfleet's product on
    # every CPU: each timed by its shape (q/k/v 256 x 512, o 256 x 256, ...)
    assert {"product 256 x 512", "product 256 x 256"} <= set(parts), rows
    assert all(ms >= 0 for ms in parts.values()) and parts["RMSNorm"] > 0 and step > 0
    # each step's rest is that step less its parts, which it contains: never negative (a part
    # counted twice, or outside the step, would make it so); the medians of parts and steps come
    # from different steps, so their sums are not compared
    assert float(rows["the rest"]) >= 0


def test_the_part_timer_counts_only_while_active():
    timer = PartTimer()

    class Owner:
        @staticmethod
        def work(x):
            return x + 1

    timer.wrap(Owner, "work", "work")
    assert Owner.work(1) == 2 and "work" not in timer.seconds
    timer.active = True
    Owner.work(1)
    assert timer.seconds["work"] > 0


def test_shapes_are_parsed_and_bad_ones_refused():
    assert amx_revisions.parse_shapes("16x2048x16384, 1X576x960") == (
        (16, 2048, 16384), (1, 576, 960))
    for bad in ("16x2048", "0x2x3", "axbxc", "1x2x3x4"):
        with pytest.raises(argparse.ArgumentTypeError):
            amx_revisions.parse_shapes(bad)
