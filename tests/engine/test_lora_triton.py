"""The LoRA SGMV kernels (worker/engine/lora/sgmv.py) under Triton's interpreter on CPU tensors:
against the torch path and a float64 reference; and an engine whose adapters run through them
(attention in Triton too, decode steps through the CUDA-graph buffers in `eager` mode) giving
PEFT's answers, base-only steps still taking the graphs' path."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_lora import Adapters, lora_engine, submit
from tests.engine.tiny_models import random_prompt, run_to_completion
from kvfleet.worker.engine.lora.sgmv import SlotRows, sgmv, sgmv_torch
from kvfleet.worker.engine.lora.slots import StackedSlots
from kvfleet.worker.engine.kernels.triton_attention import interpreting

# (start, length, slot): slot 2's rows are not consecutive, rows 37.. belong to no adapter
SEGMENTS = [(0, 1, 2), (1, 5, 0), (6, 1, 2), (7, 20, 0), (27, 10, 2), (37, 3, 1)]
RANKS = [8, 0, 3]  # slot 1 does not target this linear
NUM_ROWS, IN, OUT, WIDTH = 45, 96, 80, 130  # the output is columns [30, 110) of a wider product


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> Adapters:
    return Adapters.saved(tiny_llama, tmp_path_factory.mktemp("triton-adapters"))


def test_runs_under_the_interpreter():
    assert interpreting()  # tests/conftest.py sets it where there is no GPU


def factors(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked slots as StackedSlots holds them: A [S, 16, in], B [S, 16, out], zero past each
    slot's rank."""
    g = torch.Generator().manual_seed(5)
    a = torch.zeros(3, 16, IN)
    b = torch.zeros(3, 16, OUT)
    for slot, rank in enumerate(RANKS):
        a[slot, :rank] = torch.randn(rank, IN, generator=g) / IN ** 0.5
        b[slot, :rank] = torch.randn(rank, OUT, generator=g)
    return a.to(dtype), b.to(dtype)


def reference(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    want = out.double().clone()
    for start, length, slot in SEGMENTS:
        rows = slice(start, start + length)
        want[rows] += x[rows].double() @ a[slot].double().T @ b[slot].double()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_torch_and_float64(dtype):
    torch.manual_seed(0)
    x = torch.randn(NUM_ROWS, IN).to(dtype)
    product = torch.randn(NUM_ROWS, WIDTH).to(dtype)
    a, b = factors(dtype)
    want = reference(x, product[:, 30:110], a, b)
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    outputs = {}
    for path in ("triton", "torch"):
        out = product.clone()
        if path == "triton":
            sgmv(x, out[:, 30:110], a, b, ranks, max(RANKS),
                 SlotRows.of(SEGMENTS, x.device, for_kernels=True))
        else:
            sgmv_torch(x, out[:, 30:110], a, b, RANKS, SlotRows.of(SEGMENTS, x.device))
        # columns outside the part, rows of no adapter and of slot 1 (rank 0) are untouched
        assert torch.equal(out[:, :30], product[:, :30]) and torch.equal(out[:, 110:],
                                                                         product[:, 110:])
        assert torch.equal(out[37:], product[37:])
        outputs[path] = out[:, 30:110]
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    for path, out in outputs.items():
        error = (out.double() - want).abs().max().item()
        assert error < tolerance * want.abs().max().item(), f"{path}: {error:.2e}"
    # the torch path rounds where the kernels round (bf16: xa, then the sum): they differ by
    # float32 noise, or by a bf16 rounding of xa or of the output gone the other way
    between = (outputs["triton"].float() - outputs["torch"].float()).abs().max().item()
    assert between < (1e-5 if dtype == torch.float32 else 2 ** -5 * want.abs().max().item())


def test_an_engine_on_the_kernels_gives_pefts_answers_and_replays_base_steps(adapters):
    engine = lora_engine(adapters, attention_backend="triton", cuda_graphs="eager",
                         max_loras=2, max_batched_tokens=16, max_running=4)
    assert isinstance(engine.lora.slots, StackedSlots) and engine.lora.slots.use_triton
    graphs = engine.runner.decode_graphs
    graph_steps = []
    run = graphs.run

    def counting_run(chunks):
        assert all(c.lora_slot < 0 for c in chunks)  # captured without terms: base rows only
        graph_steps.append(len(chunks))
        return run(chunks)

    graphs.run = counting_run
    # the base requests outlive the adapters': their last steps are base-only decodes
    work = [("all8", random_prompt(19, seed=1000), 5), (None, random_prompt(7, seed=1001), 12),
            ("qv4", random_prompt(11, seed=1002), 4), ("mlp16", random_prompt(5, seed=1003), 4)]
    submit(engine, adapters, work)
    produced = run_to_completion(engine)
    for i, (name, prompt, n) in enumerate(work):
        assert produced[f"r{i}"] == adapters.reference(name, prompt, n), f"r{i} ({name})"
    assert graph_steps
