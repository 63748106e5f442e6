"""The engine on the Triton attention backend (Triton's interpreter on CPU) and on the decode
graphs' static-buffer path run eagerly: the same greedy tokens as HF generate, with chunked
prefill, prefix-cache hits and padded batch buckets."""

from __future__ import annotations

import copy

from kvfleet.worker.engine.core.cuda_graphs import batch_buckets, proposal_buckets
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.metrics import WorkerMetrics
from tests.engine.tiny_models import greedy, random_prompt, run_to_completion

SHARED = random_prompt(13, seed=40)


def prompts() -> list[list[int]]:
    # a prefix shared with the first prompt (cache hits once it is done), ragged lengths
    return [SHARED + random_prompt(3, seed=41), random_prompt(9, seed=42),
            SHARED + random_prompt(6, seed=43)]


def run(engine, new_tokens: int) -> dict[str, list[int]]:
    first, *rest = prompts()
    engine.add_request("p0", first, greedy(new_tokens))
    produced = run_to_completion(engine)  # alone, so the others find its blocks cached
    for i, prompt in enumerate(rest, start=1):
        engine.add_request(f"p{i}", prompt, greedy(new_tokens))
    produced.update(run_to_completion(engine))
    return produced


def test_triton_backend_equals_hf_generate(tiny_llama):
    engine = tiny_llama.engine(attention_backend="triton", cuda_graphs="off", max_batched_tokens=8)
    produced = run(engine, 5)
    assert [produced[f"p{i}"] for i in range(3)] == [tiny_llama.reference(p, 5) for p in prompts()]
    assert engine.stats().prefix_hit_tokens > 0  # a chunk attended to a cached prefix


def test_static_decode_buffers_give_the_same_tokens(tiny_llama):
    engine = tiny_llama.engine(attention_backend="triton", cuda_graphs="eager")
    graphs = engine.runner.decode_graphs
    batch_sizes = []
    static_run = graphs.run
    graphs.run = lambda chunks: (batch_sizes.append(len(chunks)), static_run(chunks))[1]
    # the last block is the padding rows' scratch: never handed to a sequence
    assert engine.stats().num_blocks_total == engine.pool.num_blocks - 1
    produced = run(engine, 6)  # decode batches of 1 and 2: bucket 2 has no padding, ...
    assert [produced[f"p{i}"] for i in range(3)] == [tiny_llama.reference(p, 6) for p in prompts()]
    # ... and 3 streams decode in bucket 4 with one padded row
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"q{i}", prompt, greedy(4))
    produced = run_to_completion(engine)
    assert [produced[f"q{i}"] for i in range(3)] == [tiny_llama.reference(p, 4) for p in prompts()]
    assert {1, 2, 3} <= set(batch_sizes)  # every decode step went through the static buffers


def test_batch_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert proposal_buckets(0) == [0] and proposal_buckets(1) == [0, 1]
    assert proposal_buckets(5) == [0, 1, 2, 4, 5] and proposal_buckets(8) == [0, 1, 2, 4, 8]


class EagerReplay:
    """Stands in for a captured CUDA graph on CPU: a replay runs the captured body and writes the
    bucket's logits buffer in place, as replaying the graph does."""

    def __init__(self, graphs, key: tuple[int, int]):
        self.graphs, self.key = graphs, key
        graphs._graph_logits[key] = graphs._forward(*key)

    def replay(self) -> None:
        self.graphs._graph_logits[self.key].copy_(self.graphs._forward(*self.key))


def test_graph_replays_are_counted_and_exported(tiny_llama):
    engine = tiny_llama.engine(attention_backend="triton", cuda_graphs="eager")
    graphs = engine.runner.decode_graphs
    for size in graphs.buckets:
        graphs.graphs[(size, 0)] = EagerReplay(graphs, (size, 0))
    decode_only_steps = []
    execute = engine.runner.execute
    engine.runner.execute = lambda sched: (
        decode_only_steps.append(all(c.num_tokens == 1 for c in sched.chunks)), execute(sched))[1]
    produced = run(engine, 4)
    assert [produced[f"p{i}"] for i in range(3)] == [tiny_llama.reference(p, 4) for p in prompts()]
    replays = engine.stats().num_cuda_graph_steps
    # every decode-only step replayed a graph, no step with a prefill chunk did
    assert replays == sum(decode_only_steps) > 0 and not all(decode_only_steps)
    metrics = WorkerMetrics("w1", "tiny")
    metrics.update_stats(engine.stats())
    assert f'kvfleet_worker_cuda_graph_steps_total{{model="tiny",worker="w1"}} {float(replays)}' \
        in metrics.render().decode()


def test_verified_proposals_on_the_triton_kernel_equal_hf_generate(tiny_llama):
    """Speculation's steps carry several query rows per stream (its last token and the
    proposals): the Triton kernel attends each to its own prefix, through the decode graphs'
    static buffers of a (streams, proposals) bucket, padding rows and streams included."""
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False}
    config = EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=4,
                          attention_backend="triton", cuda_graphs="eager",
                          speculative_config=spec)
    # the model as its own draft: every greedy proposal right, several rows a stream each step
    engine = Engine(copy.deepcopy(tiny_llama.model), config,
                    draft_model=copy.deepcopy(tiny_llama.model))
    graphs = engine.runner.decode_graphs
    assert graphs.proposal_buckets == [0, 1, 2, 4]
    steps = []  # (bucket, each stream's proposals)
    static_run = graphs.run
    graphs.run = lambda chunks: (steps.append((graphs.bucket(chunks),
                                               [len(c.draft) for c in chunks])),
                                 static_run(chunks))[1]
    repeats = [random_prompt(5, seed=50) * 4, random_prompt(7, seed=51) * 3,
               random_prompt(4, seed=52) * 2]
    for i, prompt in enumerate(repeats):
        # 11 tokens: the last verified step of each has fewer proposals than its bucket's
        engine.add_request(f"s{i}", prompt, greedy(11 + i))
    produced = run_to_completion(engine)
    assert [produced[f"s{i}"] for i in range(3)] == [
        tiny_llama.reference(p, 11 + i) for i, p in enumerate(repeats)]
    assert any(bucket == (4, 4) and len(drafts) == 3 for bucket, drafts in steps)  # a padding stream
    assert any(min(drafts) < bucket[1] for bucket, drafts in steps)  # padding proposal rows
    assert all(bucket is not None for bucket, _ in steps)
    stats = engine.speculation.speculator.stats
    assert stats.num_accepted_tokens > 0 and max(stats.accepted_per_position[1:]) > 0
