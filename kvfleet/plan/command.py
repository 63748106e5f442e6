"""`kvfleet plan`: the capacity planner. Turns a model size, an accelerator and a demand into the
seed's memory budget, conversations per accelerator, fleet size and cost; the defaults reproduce
the seed's numbers (40 GB weights, 10 conversations of 8,000 tokens, 1,447 accelerators)."""

from __future__ import annotations

import argparse
import json
import sys

from kvfleet.text import arg_types
from kvfleet.plan.capacity import (
    DEFAULT_HEAD_DIM,
    KV_DTYPE_BYTES,
    REFERENCE_KV_DTYPE_BYTES,
    SCALE_BYTES_PER_ROW,
    PlanInputs,
    WeightsDoNotFit,
    kv_element_bytes,
    make_plan,
)
from kvfleet.plan.model_shape import ModelShapeError, load_model_shape
from kvfleet.plan.pace import MeasuredPace, Prefill, StepCostError, measure, read_curve
from kvfleet.plan.redis_side import (
    DEFAULT_GATEWAY_EVENTS_PER_S,
    DEFAULT_HEADROOM,
    DEFAULT_REDIS_US_PER_EVENT,
    DEFAULT_REQUESTS_PER_S,
    RedisInputs,
    plan_redis,
    redis_plan_json,
    redis_plan_text,
)
from kvfleet.plan.report import plan_to_json, plan_to_text
from kvfleet.text.units import format_bytes
from kvfleet.shared.settings import CommonSettings
from kvfleet.shared.wire import Keys

DEFAULT_NUM_PARAMS = 20e9
DEFAULT_GPU_TOKENS_PER_S = 2000
DEFAULT_STREAMS = 32
DEFAULT_CONTEXTS = [2000, 8000, 16000]
# the seed's answer: its 2,893,519 output tokens/s over its 500M requests a day (5,787 a second)
SEED_OUTPUT_TOKENS = 500
EXIT_USAGE = 2


class WorkloadError(ValueError):
    """--prompt-tokens / --output-tokens that do not fit the context: a usage error."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    _add_workload_arguments(parser)
    _add_step_cost_arguments(parser)
    _add_redis_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and accelerator")
    group.add_argument("--params", type=arg_types.positive_count, default=None,
                       help="model parameters, e.g. 20e9 or 20B (default: 20e9, or the count "
                            "estimated from --from-model)")
    group.add_argument("--bytes-per-param", type=arg_types.positive_float, default=2.0,
                       help="bytes per weight (default: 2, bf16)")
    group.add_argument("--gpu-memory", type=arg_types.size_bytes, default="80GB",
                       help="accelerator memory, decimal units (default: 80GB)")
    group.add_argument("--kv-bytes-per-token", type=arg_types.size_bytes, default="0.5MB",
                       help="KV cache bytes per token of context at a 2-byte dtype "
                            "(default: 0.5MB = 500,000 bytes)")
    group.add_argument("--from-model", metavar="PATH_OR_CONFIG", default=None,
                       help="derive KV bytes per token (and parameters) from a transformers "
                            "config.json, a model directory, inline JSON or a local model id")
    group.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_BYTES), default="bf16",
                       help="KV cache element type; scales bytes per token (default: bf16). "
                            "fp8/int8 count kvfleet's fp16 scale per token and KV head")
    group.add_argument("--tensor-parallel-size", type=arg_types.positive_int, default=1,
                       help="accelerators per worker, the model split over them (default: 1); "
                            "memory is counted per rank: layers split, embeddings and LM head "
                            "whole on each (known with --from-model), KV heads split")
    group.add_argument("--head-dim", type=arg_types.positive_int, default=None,
                       help="values per KV head, for the fp8/int8 scale overhead (default: "
                            f"from --from-model, else {DEFAULT_HEAD_DIM})")


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload and fleet")
    contexts = group.add_mutually_exclusive_group()
    contexts.add_argument("--context", type=arg_types.positive_int_list, default=None,
                          help="context lengths in tokens, comma-separated (default: "
                               "--prompt-tokens + --output-tokens when both are given, else "
                               "2000,8000,16000)")
    contexts.add_argument("--context-mix", type=arg_types.context_mix, default=None,
                          help="weighted mix TOKENS:WEIGHT,..., e.g. 2000:0.5,8000:0.4,16000:0.1")
    group.add_argument("--demand", type=arg_types.positive_count, default=2893519,
                       help="output tokens/s the fleet must serve (default: 2893519)")
    group.add_argument("--gpu-tokens-per-s", type=arg_types.positive_count, default=None,
                       help="output tokens/s of one accelerator at --streams (default: "
                            f"{DEFAULT_GPU_TOKENS_PER_S}; from the curve with --step-cost)")
    group.add_argument("--streams", type=arg_types.positive_int, default=None,
                       help=f"streams batched together for that rate (default: {DEFAULT_STREAMS}"
                            "; from the curve with --step-cost)")
    group.add_argument("--cost-per-hour", type=arg_types.non_negative_float, default=None,
                       help="$ per accelerator-hour, e.g. 2.5 (default: not priced)")
    group.add_argument("--prompt-tokens", type=arg_types.non_negative_int, default=None,
                       help="prompt tokens a request; with --step-cost a worker at pace also "
                            "prefills the prompts of the streams replacing those that end "
                            "(default: the context the pace is counted at less --output-tokens)")
    group.add_argument("--output-tokens", type=arg_types.positive_int, default=None,
                       help="output (answer) tokens a request (default: the context less "
                            f"--prompt-tokens when that is given, else the seed's "
                            f"{SEED_OUTPUT_TOKENS}, at most the context)")
    group.add_argument("--prefix-share", type=arg_types.fraction, default=None,
                       help="fraction of prompt tokens served from a shared cached opening "
                            "(with --step-cost: not prefilled)")
    group.add_argument("--prefix-prompts", type=arg_types.positive_int, default=1000,
                       help="prompts sharing one opening, for the what-if (default: 1000)")
    group.add_argument("--prefix-tokens", type=arg_types.non_negative_int, default=2000,
                       help="tokens in that shared opening (default: 2000)")


def _add_step_cost_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "measured pace (a worker's step-cost curve instead of --streams and --gpu-tokens-per-s)")
    group.add_argument("--step-cost", metavar="SOURCE", default=None,
                       help="a StepCostCurve JSON file (a heartbeat's step_cost field), or "
                            "redis://host:port[/db]: read from the fleet's live heartbeats")
    group.add_argument("--worker", metavar="ID", default=None,
                       help="with a Redis source: this worker's curve (default: the first "
                            "worker of --model with one)")
    group.add_argument("--model", metavar="NAME", default=None,
                       help="with a Redis source: the served model whose workers to read "
                            "(default: any)")
    group.add_argument("--key-prefix", default=None,
                       help="with a Redis source: default KVFLEET_KEY_PREFIX or kvf:")
    group.add_argument("--target-itl-ms", type=arg_types.positive_float, default=None,
                       help="the promised time between two tokens of a stream, p99 (default: "
                            "the worker's --target-itl-ms, read from its heartbeat)")


def _add_redis_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Redis side (docs/BENCHMARKS.md, Redis Cluster scale)")
    group.add_argument("--requests-per-s", type=arg_types.positive_count,
                       default=DEFAULT_REQUESTS_PER_S,
                       help=f"requests/s the fleet admits (default: {DEFAULT_REQUESTS_PER_S:g})")
    group.add_argument("--tokens-per-event", type=arg_types.positive_int, default=1,
                       help="tokens per token event (default: 1, one per request per step; "
                            "more with the workers' --publish-interval-ms)")
    group.add_argument("--redis-us-per-event", type=arg_types.positive_float,
                       default=DEFAULT_REDIS_US_PER_EVENT,
                       help="measured Redis CPU per delivered event, µs (default: "
                            f"{DEFAULT_REDIS_US_PER_EVENT:g})")
    group.add_argument("--gateway-events-per-s", type=arg_types.positive_float,
                       default=DEFAULT_GATEWAY_EVENTS_PER_S,
                       help="events/s one gateway process delivers (default: "
                            f"{DEFAULT_GATEWAY_EVENTS_PER_S:g})")
    group.add_argument("--redis-headroom", type=arg_types.fraction, default=DEFAULT_HEADROOM,
                       help=f"share of measured capacity to plan for (default: {DEFAULT_HEADROOM})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet plan", description=__doc__)
    add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.redis_headroom <= 0:
        return _fail("--redis-headroom must be above 0")
    try:
        pace = measured_pace(args)
        inputs = plan_inputs(args, pace)
        plan = make_plan(inputs)
    except StepCostError as exc:
        return _fail(f"--step-cost: {exc}")
    except WorkloadError as exc:
        return _fail(str(exc))
    except ModelShapeError as exc:
        return _fail(f"--from-model: {exc}")
    except WeightsDoNotFit as exc:
        weights_bytes, gpu_memory_bytes = exc.args
        return _fail(f"the weights do not fit: {format_bytes(weights_bytes)} of weights > "
                     f"{format_bytes(gpu_memory_bytes)} of accelerator memory; use more memory "
                     f"(--gpu-memory), fewer bytes per parameter (--bytes-per-param) or split "
                     f"the model across accelerators")
    redis_inputs = RedisInputs(inputs.demand_tokens_per_s, args.requests_per_s,
                               plan.throughput.gpus_needed, args.tokens_per_event,
                               args.redis_us_per_event, args.gateway_events_per_s,
                               args.redis_headroom)
    redis_plan = plan_redis(redis_inputs)
    if args.json:
        document = plan_to_json(plan, inputs, pace)
        document["redis"] = redis_plan_json(redis_plan)
        print(json.dumps(document, indent=2))
    else:
        print(plan_to_text(plan, inputs, pace), end="")
        print()
        print(redis_plan_text(redis_plan, redis_inputs), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def measured_pace(args: argparse.Namespace) -> MeasuredPace | None:
    """With --step-cost: what the curve says a worker serves at the target ITL, for streams of
    the longest --context (the pace must hold for them too) or the --context-mix average."""
    if args.step_cost is None:
        for flag, value in (("--worker", args.worker), ("--model", args.model),
                            ("--target-itl-ms", args.target_itl_ms)):
            if value is not None:
                raise StepCostError(f"{flag} needs --step-cost")
        return None
    if args.streams is not None or args.gpu_tokens_per_s is not None:
        raise StepCostError("the curve gives --streams and --gpu-tokens-per-s: leave them out")
    keys = Keys(args.key_prefix or CommonSettings().key_prefix)
    found = read_curve(args.step_cost, model=args.model, worker=args.worker, keys=keys)
    target_itl_ms = args.target_itl_ms or found.target_itl_ms
    if not target_itl_ms:
        raise StepCostError("give --target-itl-ms (the source states no promised pace)")
    if args.context_mix:
        context = sum(tokens * weight for tokens, weight in args.context_mix)
    else:
        context = max(_context_list(args))
    return measure(found, target_itl_ms, context, prefill(args, context))


def prefill(args: argparse.Namespace, context: float) -> Prefill:
    """The prompts a worker at pace prefills: --prompt-tokens and --output-tokens; one left out
    is the rest of `context` (the context the streams are counted at: a request's prompt and
    answer), both left out the seed's answer (at most the context) and the rest the prompt;
    --prefix-share of each prompt comes from the cache."""
    prompt, output = args.prompt_tokens, args.output_tokens
    if prompt is not None and output is not None:
        source = "--prompt-tokens, --output-tokens"
    elif prompt is not None:
        output = context - prompt
        if output < 1:
            raise WorkloadError(f"--prompt-tokens {prompt:,} leaves no answer in a context of "
                                f"{context:,.0f} tokens: give --output-tokens")
        source = "--prompt-tokens; the answer the rest of the context"
    elif output is not None:
        if output > context:
            raise WorkloadError(f"--output-tokens {output:,} is longer than the context of "
                                f"{context:,.0f} tokens: give --prompt-tokens")
        prompt = context - output
        source = "--output-tokens; the prompt the rest of the context"
    else:
        output = min(SEED_OUTPUT_TOKENS, context)
        prompt = context - output
        source = (f"assumed: the seed's {SEED_OUTPUT_TOKENS}-token answers, the prompt the rest "
                  "of the context; give --prompt-tokens and --output-tokens")
    return Prefill(prompt, output, args.prefix_share or 0.0, source)


def plan_inputs(args: argparse.Namespace, pace: MeasuredPace | None = None) -> PlanInputs:
    """Flags -> PlanInputs; --from-model supplies KV size and (unless --params) parameters, a
    measured pace the streams and tokens/s (the curve's are a worker's: with tensor
    parallelism, its accelerators share its tokens/s)."""
    kv_bytes_per_token, kv_source, model_num_params = _kv_size(args)
    num_params = args.params or model_num_params
    if args.from_model and num_params is None:
        print("kvfleet plan: note: the config gives no parameter count; using "
              f"{DEFAULT_NUM_PARAMS:.0e} (set --params)", file=sys.stderr)
    return PlanInputs(
        num_params=int(num_params or DEFAULT_NUM_PARAMS),
        bytes_per_param=args.bytes_per_param,
        gpu_memory_bytes=args.gpu_memory,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_dtype=args.kv_dtype,
        contexts=_contexts(args),
        demand_tokens_per_s=args.demand,
        gpu_tokens_per_s=(pace.tokens_per_s / args.tensor_parallel_size if pace
                          else args.gpu_tokens_per_s or DEFAULT_GPU_TOKENS_PER_S),
        streams_per_gpu=pace.streams if pace else args.streams or DEFAULT_STREAMS,
        cost_per_gpu_hour=args.cost_per_hour,
        prefix_prompts=args.prefix_prompts,
        prefix_opening_tokens=args.prefix_tokens,
        prefix_share=args.prefix_share,
        kv_source=kv_source,
        head_dim=_head_dim(args),
        tensor_parallel_size=args.tensor_parallel_size,
        **_model_split(args),
    )


def _model_split(args: argparse.Namespace) -> dict:
    """What --from-model tells about splitting the model: replicated weights, KV heads."""
    if not args.from_model:
        return {}
    shape = load_model_shape(args.from_model)
    return {"replicated_params": shape.replicated_params or 0, "num_kv_heads": shape.num_kv_heads}


def _head_dim(args: argparse.Namespace) -> int:
    if args.from_model:
        return load_model_shape(args.from_model).head_dim
    return args.head_dim or DEFAULT_HEAD_DIM


def _kv_size(args: argparse.Namespace) -> tuple[int, str, int | None]:
    """(KV bytes per token at --kv-dtype, where that came from, the model's parameter count)."""
    dtype_bytes = KV_DTYPE_BYTES[args.kv_dtype]
    scale = f" + {SCALE_BYTES_PER_ROW} B scale per {{}} values" if dtype_bytes == 1 else ""
    if args.from_model:
        shape = load_model_shape(args.from_model)
        per_token = shape.kv_bytes_per_token(dtype_bytes)
        if dtype_bytes == 1:
            per_token += 2 * shape.num_layers * shape.num_kv_heads * SCALE_BYTES_PER_ROW
        return (per_token, f"2 × {shape.describe()} × {dtype_bytes} B" + scale.format(shape.head_dim),
                shape.num_params_estimate)
    head_dim = _head_dim(args)
    element = kv_element_bytes(args.kv_dtype, head_dim)
    kv_source = "--kv-bytes-per-token"
    if dtype_bytes != REFERENCE_KV_DTYPE_BYTES:
        kv_source += (f" scaled {REFERENCE_KV_DTYPE_BYTES} B -> {dtype_bytes} B per element"
                      + scale.format(head_dim))
    return round(args.kv_bytes_per_token * element / REFERENCE_KV_DTYPE_BYTES), kv_source, None


def _contexts(args: argparse.Namespace) -> tuple[tuple[int, float | None], ...]:
    if args.context_mix:
        return tuple((tokens, weight) for tokens, weight in args.context_mix)
    return tuple((tokens, None) for tokens in _context_list(args))


def _context_list(args: argparse.Namespace) -> list[int]:
    """--context; without it a request's prompt and answer when both are given, else the
    seed's contexts."""
    if args.context:
        return args.context
    if args.prompt_tokens is not None and args.output_tokens is not None:
        return [args.prompt_tokens + args.output_tokens]
    return DEFAULT_CONTEXTS


def _fail(message: str) -> int:
    print(f"kvfleet plan: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
