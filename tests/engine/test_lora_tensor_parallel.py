"""LoRA adapters under tensor parallelism (a module of its own: one rank group per process at a
time): each rank computes its shard of every adapter's terms (B's rows of its output features on
q/k/v and gate/up, A's columns of its input features on o and down, those partial terms summed
with the product's before the all_reduce), the step message tells the ranks which adapters to
load into which slots, and every answer is PEFT's."""

from __future__ import annotations

import dataclasses
import functools

from tests.engine.test_lora import ALL, Adapters, save_adapter
from tests.engine.test_tensor_parallel import tp_config
from tests.engine.tiny_models import TinyModel, build_model, greedy, random_prompt, run_to_completion
from kvfleet.worker.engine.lora import LoraRequest
from kvfleet.worker.engine.core.model_runner import PlannedChunk, StepPlan
from kvfleet.worker.engine.parallel.tp_group import StepMessage
from kvfleet.worker.process.tp_rank import launch_engine

# 6 heads in 3 KV groups over 2 ranks: 4 + 2 heads, 2 + 1 KV heads (uneven shards)
OVERRIDES = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48)


def test_two_ranks_give_each_adapter_pefts_answer(tmp_path):
    tiny = TinyModel("qwen2", **OVERRIDES)
    adapters = Adapters(tiny, {
        "all8": save_adapter(tiny.model, tmp_path / "all8", 8, 16, ALL, seed=1),
        "ov4": save_adapter(tiny.model, tmp_path / "ov4", 4, 8, ["o_proj", "v_proj", "down_proj"],
                            seed=2)})
    config = dataclasses.replace(tp_config("recompute"), num_blocks=64, enable_lora=True,
                                 max_loras=1)
    engine = launch_engine(functools.partial(build_model, "qwen2", **OVERRIDES), config,
                           num_threads=1)
    try:
        work = [("all8", random_prompt(13, seed=1100), 8), (None, random_prompt(6, seed=1101), 8),
                ("ov4", random_prompt(9, seed=1102), 8), ("all8", random_prompt(4, seed=1103), 6)]
        for i, (name, prompt, n) in enumerate(work):
            engine.add_request(f"r{i}", prompt, greedy(n),
                               lora=None if name is None else adapters.request(name))
        produced = run_to_completion(engine)
        for i, (name, prompt, n) in enumerate(work):
            assert produced[f"r{i}"] == adapters.reference(name, prompt, n), f"r{i} ({name})"
        assert engine.lora_stats().loads_total == {"all8": 1, "ov4": 1}
    finally:
        engine.close()


def test_the_step_message_carries_each_chunks_slot_and_the_loads():
    plan = StepPlan([PlannedChunk(0, 3, [1], True, 0, 1), PlannedChunk(5, 1, [2, 3], True)],
                    [7, 8, 9, 10], [(1, "ädapter", "/a/b"), (0, "x", "")])
    message = StepMessage(plan, swap_out=[(4, [5])], drops=[2])
    assert StepMessage.decode(message.encode()) == message
    assert LoraRequest("x", "/p", b"r").prefix_root == b"r"
