"""The least time any server on this machine needs for a serving workload, from the workload's
work and the machine's ceilings measured in the same run: the ceiling a throughput target is
judged against.

A workload is its requests' prompt and output lengths, the prompt tokens an ideal prefix cache
would never compute, and how many requests are in flight at most. Its floor is the larger of
- **compute**: every FLOP it must do (benchmarks/roofline.py's `ModelCost`: the prompts' tokens
  not cached, attention over their causal pairs, every decode row's products and attention over
  its context, the LM head once per token made) at the peak product rate, the best of every
  product implementation this machine has (`roofline.product_rates`, bf16 and float32, the
  faster named);
- **memory**: the fewest decode steps the workload allows (a request makes its tokens one step
  at a time, and a step decodes at most the in-flight count of them) times the weights a step
  reads at least once, at the read bandwidth measured on a buffer of that size.

Both are lower bounds, so their maximum is: no schedule does the work in less. Its output
tokens over the floor is the **ceiling** throughput; a server's throughput over it is its share.
A target of k times a peer is out of this machine's reach where the peer's share times k is
above 1. The bound is loose where attention or small products run below the peak, never tight
above it: it says what cannot be done, not what can.

    .venv/bin/python -m benchmarks.serve_floor --model random:llama-3.2-1b --prompts 24 \\
        --input-len 256 --output-len 64 --concurrency 16
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from benchmarks.roofline import ModelCost, ProductRates, product_rates, read_bandwidth
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path

ELEMENT_BYTES = 2  # weights read at bf16, the narrowest dtype either server computes in here


@dataclass(frozen=True)
class Workload:
    prompt_lengths: tuple[int, ...]
    output_lengths: tuple[int, ...]  # tokens each request makes, its first (from the prompt) too
    cached: tuple[int, ...]  # per request, the prompt tokens an ideal prefix cache holds
    concurrency: int  # requests in flight at most

    def __post_init__(self):
        if not (len(self.prompt_lengths) == len(self.output_lengths) == len(self.cached)):
            raise ValueError("prompt_lengths, output_lengths and cached must be as long")
        if not self.prompt_lengths:
            raise ValueError("a workload has at least one request")
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if any(c < 0 or c >= n for c, n in zip(self.cached, self.prompt_lengths)):
            raise ValueError("a request's cached tokens must be fewer than its prompt's")
        if any(n < 1 for n in self.output_lengths):
            raise ValueError("every request makes at least one token")

    @classmethod
    def uniform(cls, prompts: int, input_len: int, output_len: int, concurrency: int,
                shared_prefix: int = 0, distinct_prefixes: int = 0) -> Workload:
        """`prompts` requests of `input_len` tokens making `output_len` each; with a shared
        prefix, the first request of each of `distinct_prefixes` computes it, the rest hit it."""
        cached = [0] * min(distinct_prefixes, prompts) + [shared_prefix] * max(
            0, prompts - distinct_prefixes) if shared_prefix else [0] * prompts
        return cls((input_len,) * prompts, (output_len,) * prompts, tuple(cached), concurrency)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lengths)

    def decode_steps(self) -> int:
        """The fewest decode steps that make every token after each request's first: its
        longest request's, and no fewer than the rows over the in-flight count."""
        rows = [n - 1 for n in self.output_lengths]
        return max(max(rows), math.ceil(sum(rows) / self.concurrency))

    def flops(self, cost: ModelCost) -> float:
        """Every FLOP the workload must compute: the prompts' uncached tokens (products, and
        attention over their causal pairs, the cached context included), the LM head once per
        prompt, then every decode row (products, head, attention over its context)."""
        total = 0.0
        for n, c, out in zip(self.prompt_lengths, self.cached, self.output_lengths):
            pairs = n * (n + 1) / 2 - c * (c + 1) / 2
            total += (2 * cost.active_layer_params * (n - c) + 4 * cost.num_layers
                      * cost.q_width * pairs + 2 * cost.head_params)
            contexts = (out - 1) * n + (out - 1) * out / 2  # n+1 .. n+out-1, summed
            total += cost.decode_step_flops(out - 1) + 4 * cost.num_layers * cost.q_width * contexts
        return total


@dataclass(frozen=True)
class Floor:
    compute_s: float
    memory_s: float
    output_tokens: int
    peak_flops: float
    peak_by: str
    bandwidth: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound_by(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def ceiling(self) -> float:
        """Output tokens per second no server on this machine exceeds on the workload."""
        return self.output_tokens / self.seconds

    def share(self, tokens_per_s: float) -> float:
        return tokens_per_s / self.ceiling

    def describe(self) -> str:
        return (f"floor {self.seconds:.1f} s, bound by {self.bound_by} (its FLOPs "
                f"{self.compute_s:.1f} s at {self.peak_flops / 1e9:.0f} GFLOP/s by {self.peak_by}, "
                f"its fewest decode steps {self.memory_s:.1f} s at {self.bandwidth / 1e9:.1f} "
                f"GB/s): ceiling {self.ceiling:.1f} output tok/s")


def floor(workload: Workload, cost: ModelCost, peak_flops: float, bandwidth: float,
          peak_by: str = "peak") -> Floor:
    weights = cost.decode_step_bytes(1, 0, ELEMENT_BYTES)["weights"]
    return Floor(workload.flops(cost) / peak_flops,
                 workload.decode_steps() * weights / bandwidth,
                 workload.output_tokens, peak_flops, peak_by, bandwidth)


def reachable(target: float, peer_share: float) -> bool:
    """Whether `target` times a peer at `peer_share` of the ceiling is within it."""
    return target * peer_share <= 1.0


@dataclass(frozen=True)
class Ceilings:
    """What the machine does at best, measured once for a model: its peak product rate (the
    faster dtype's best implementation) and the read bandwidth of a decode step's weights."""

    cost: ModelCost
    rates: tuple[ProductRates, ...]
    bandwidth: float

    @property
    def best(self) -> ProductRates:
        return max(self.rates, key=lambda r: r.peak)

    def floor(self, workload: Workload) -> Floor:
        best = self.best
        dtype = {torch.bfloat16: "bf16", torch.float32: "float32"}.get(best.dtype, "")
        return floor(workload, self.cost, best.peak, self.bandwidth,
                     f"{best.peak_by} ({dtype})")

    def describe(self) -> str:
        return "\n".join([*(f"  {r.describe()}" for r in self.rates),
                          f"  read bandwidth {self.bandwidth / 1e9:.1f} GB/s"])


def model_cost(model: str) -> tuple[ModelCost, tuple[int, int]]:
    """A model's cost (from its config, no weights loaded) and its largest linear's shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_path(model, weights=False))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    cost = ModelCost.of(built)
    width = cost.q_width if cost.num_experts > 1 else config.intermediate_size
    return cost, (config.hidden_size, width)


def measure(model: str, dtypes=(torch.bfloat16, torch.float32)) -> Ceilings:
    """The ceilings for `model` on this machine, now: best product rates at its largest linear
    shape in each dtype, and the read bandwidth over its decode step's weights."""
    cost, shape = model_cost(model)
    rates = []
    for dtype in dtypes:
        try:
            rates.append(product_rates(dtype, *shape))
        except RuntimeError as exc:  # no product of this dtype runs here
            print(f"# {dtype}: {exc}")
    if not rates:
        raise RuntimeError("no product could be timed on this machine")
    weights = cost.decode_step_bytes(1, 0, ELEMENT_BYTES)["weights"]
    return Ceilings(cost, tuple(rates), read_bandwidth(int(weights)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="prompt tokens shared by the prompts of one prefix")
    p.add_argument("--distinct-prefixes", type=int, default=0)
    p.add_argument("--tokens-per-s", type=float, nargs="*", default=[],
                   help="throughputs to place against the ceiling")
    args = p.parse_args(argv)
    workload = Workload.uniform(args.prompts, args.input_len, args.output_len, args.concurrency,
                                args.shared_prefix, args.distinct_prefixes)
    print(f"# CPU {cpu_features().describe()}; {torch.get_num_threads()} threads; "
          f"model {args.model}")
    ceilings = measure(args.model)
    print(ceilings.describe())
    result = ceilings.floor(workload)
    print(result.describe())
    for tps in args.tokens_per_s:
        print(f"{tps:.1f} tok/s is {result.share(tps):.0%} of the ceiling")


if __name__ == "__main__":
    main()
