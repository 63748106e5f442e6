"""`kvfleet timelines`: where finished requests' time went, read from the fleet's Redis (the
timelines its workers keep: `--timelines-kept`, shared/wire/timeline.py).

    kvfleet timelines --redis-url redis://127.0.0.1:6379/0             # every model, last 1000
    kvfleet timelines --model SmolLM2-135M-Instruct --since 1796550000 --worst 10
    kvfleet timelines --json                                           # the summary as JSON

It prints each phase's p50, p99 and max over the requests (queue, admit, prefill, ttft, tpot and
the longest gap between two of a request's publications), then the requests with the latest
first tokens, each with its phases.
"""

from __future__ import annotations

import argparse
import json
import sys

import redis

from kvfleet.shared.redis_connect import REDIS_FAILURES, connect
from kvfleet.shared.settings import CommonSettings
from kvfleet.shared.wire import Keys
from kvfleet.shared.wire.timeline import PHASES, RequestTimeline, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="the fleet's Redis (default: KVFLEET_REDIS_URL)")
    parser.add_argument("--key-prefix", default=None, help="default: KVFLEET_KEY_PREFIX or kvf:")
    parser.add_argument("--model", default=None,
                        help="one served model's timelines (default: every model's)")
    parser.add_argument("--since", type=float, default=0.0,
                        help="only requests that ended at or after this unix time")
    parser.add_argument("--last", type=int, default=1000,
                        help="at most this many of the latest requests per model (0: all kept)")
    parser.add_argument("--worst", type=int, default=5,
                        help="list this many requests with the latest first tokens")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def timeline_streams(client: redis.Redis, keys: Keys, model: str | None) -> list[str]:
    if model is not None:
        return [keys.timelines(model)]
    pattern = keys.timelines("*")
    return sorted(k.decode() if isinstance(k, bytes) else k
                  for k in client.scan_iter(match=pattern, count=1000))


def read_timelines(client: redis.Redis, keys: Keys, model: str | None, since: float,
                   last: int) -> list[RequestTimeline]:
    """The kept timelines of `model` (or every model), newest last, that ended at `since` or
    later, at most `last` per model (0: all)."""
    found = []
    for stream in timeline_streams(client, keys, model):
        entries = (client.xrevrange(stream, count=last) if last else client.xrevrange(stream))
        timelines = [RequestTimeline.decode(fields) for _, fields in reversed(entries)]
        found += [t for t in timelines if t.end >= since]
    return found


def phase_line(phases: dict) -> str:
    return "; ".join(f"{name} {value:.0f}" for name, value in phases.items())


def report(timelines: list[RequestTimeline], worst: int) -> str:
    summary = summarize(timelines)
    lines = [f"{summary['count']} requests on {len(summary['workers'])} worker(s); "
             f"{summary['prompt_tokens']} prompt tokens ({summary['cached_tokens']} cached), "
             f"{summary['output_tokens']} output tokens; {summary['resumed']} resumed",
             "", "| phase | p50 (ms) | p99 (ms) | max (ms) |", "|---|---:|---:|---:|"]
    for phase in PHASES:
        if stats := summary["phases"].get(phase):
            lines.append(f"| {phase} | {stats['p50_ms']:.0f} | {stats['p99_ms']:.0f} | "
                         f"{stats['max_ms']:.0f} |")
    latest = sorted((t for t in timelines if "ttft" in t.phases_ms()),
                    key=lambda t: t.phases_ms()["ttft"], reverse=True)[:worst]
    if latest:
        lines += ["", "latest first tokens (ms):"]
        lines += [f"  {t.req_id} on {t.worker}: {phase_line(t.phases_ms())}; "
                  f"{t.prompt_tokens} prompt ({t.cached_tokens} cached), {t.output_tokens} out"
                  for t in latest]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    settings = CommonSettings()
    redis_url = args.redis_url or settings.redis_url
    if not redis_url:
        print("kvfleet timelines: needs --redis-url (or KVFLEET_REDIS_URL)", file=sys.stderr)
        return 2
    if args.last < 0 or args.worst < 0:
        print("kvfleet timelines: --last and --worst must be 0 or more", file=sys.stderr)
        return 2
    keys = Keys(args.key_prefix or settings.key_prefix)
    try:
        client = connect(redis_url, socket_connect_timeout=5, socket_timeout=30)
        timelines = read_timelines(client, keys, args.model, args.since, args.last)
    except (*REDIS_FAILURES, OSError) as exc:
        print(f"kvfleet timelines: Redis error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summarize(timelines)))
    elif not timelines:
        print("no timelines kept (none finished yet, or the workers run with "
              "--timelines-kept 0)")
    else:
        print(report(timelines, args.worst))
    return 0
