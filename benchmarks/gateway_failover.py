"""Gateway failover: SIGKILL the gateway serving streamed answers; each client re-attaches through
the other gateway (`GET /v1/requests/{id}/stream?after=N`, N = tokens it received, counted from one
logprobs entry per token) and must end with exactly the uninterrupted text.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.gateway_failover --trials 10

Two gateways and two workers on one Redis. Each trial: `--requests` streams through gateway A; once
each has `--kill-after` tokens, A is SIGKILLed; every client re-attaches through B; A is restarted
and the gateways swap roles. Optionally `--background` closed-loop clients keep streaming through
the gateway that survives. Reported: answers identical to the reference, tokens lost or repeated
(from the re-attached chunks' `token_index`), and the client-visible gap (last chunk before the
kill to the first re-attached chunk) p50/max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.fleet_load import ClosedLoop, References, start_two_workers
from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.redis_server import EmbeddedRedis
from tests.helpers.processes import ProcessFleet


@dataclass
class Stream:
    prompt: int
    req_id: str = ""
    text: str = ""
    tokens: int = 0  # received before the kill
    last_at: float = 0.0
    resumed_at: float = 0.0
    lost_or_repeated: int = 0
    finish_reason: str | None = None
    pieces: list[str] = field(default_factory=list)


def body(prompt: int, max_tokens: int) -> dict:
    return {"model": DEFAULT_MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "logprobs": True,
            "messages": [{"role": "user", "content": f"Tell story number {prompt} about a bridge."}]}


def first_part(url: str, stream: Stream, max_tokens: int) -> None:
    """Stream until the gateway dies (or the answer ends)."""
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body(stream.prompt, max_tokens),
                          timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                stream.req_id = stream.req_id or chunk["id"]
                for choice in chunk["choices"]:
                    stream.pieces.append(choice["delta"].get("content") or "")
                    stream.tokens += len((choice.get("logprobs") or {}).get("content") or [])
                    stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
                stream.last_at = time.monotonic()
    except httpx.HTTPError:
        pass


def reattach(url: str, stream: Stream) -> None:
    """The rest of the answer from token `stream.tokens` on, through another gateway."""
    expected = stream.tokens
    with httpx.stream("GET", f"{url}/v1/requests/{stream.req_id}/stream",
                      params={"after": stream.tokens}, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            stream.resumed_at = stream.resumed_at or time.monotonic()
            stream.lost_or_repeated += abs(choice["token_index"] - expected)
            expected = choice["token_index"] + len(choice["token_ids"])
            stream.pieces.append(choice["text"])
            stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    stream.text = "".join(stream.pieces)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--kill-after", type=int, default=10)
    parser.add_argument("--background", type=int, default=0)
    args = parser.parse_args()
    flags = ["--kv-memory", "512MiB", "--num-threads", "1"]
    references = References()
    gaps, lost, identical, total = [], 0, 0, 0
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as logs:
        fleets = [ProcessFleet(server.url, Path(logs), worker_flags=flags) for _ in range(2)]
        fleets[1].prefix = fleets[0].prefix  # two gateways of one fleet
        background = None
        try:
            start_two_workers(fleets[0])
            fleets[1].start_gateway()
            reference = {}
            for i in range(args.requests):
                stream = Stream(i)
                first_part(fleets[0].url, stream, args.max_tokens)
                reference[i] = "".join(stream.pieces)
            for trial in range(args.trials):
                victim, survivor = fleets[trial % 2], fleets[(trial + 1) % 2]
                if args.background:
                    background = ClosedLoop(survivor.url, args.background, 48).start()
                streams = [Stream(i) for i in range(args.requests)]
                threads = [threading.Thread(target=first_part,
                                            args=(victim.url, s, args.max_tokens))
                           for s in streams]
                for thread in threads:
                    thread.start()
                while not all(s.tokens >= args.kill_after for s in streams):
                    time.sleep(0.01)
                victim.gateway.kill()
                for thread in threads:
                    thread.join()
                resumers = [threading.Thread(target=reattach, args=(survivor.url, s))
                            for s in streams]
                for thread in resumers:
                    thread.start()
                for thread in resumers:
                    thread.join()
                if background is not None:
                    references.check(background.stop())
                for s in streams:
                    total += 1
                    identical += s.text == reference[s.prompt] and s.finish_reason == "length"
                    lost += s.lost_or_repeated
                    gaps.append(s.resumed_at - s.last_at)
                victim.start_gateway()
                print(f"trial {trial + 1}: identical {identical}/{total}, tokens lost or repeated "
                      f"{lost}, gap p50 {statistics.median(gaps):.2f} s", flush=True)
        finally:
            for fleet in fleets:
                fleet.stop()
    print(f"\nanswers identical to the uninterrupted run: {identical}/{total}; tokens lost or "
          f"repeated: {lost}")
    print(f"client-visible gap (last chunk before the kill -> first re-attached chunk): "
          f"p50 {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s")
    if references.checked:
        print(f"background answers identical to their prompt's first: "
              f"{references.identical}/{references.checked}")
    return 0 if identical == total and lost == 0 and not references.mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
