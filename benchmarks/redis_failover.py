"""Redis Cluster primary failover: a fleet (real gateway, two real workers on the default model,
3 stream shards) on a local cluster of 3 primaries + 3 replicas; each trial SIGKILLs one primary
while greedy streams are in flight, lets the cluster promote its replica, and checks every
accepted request.

    .venv/bin/python -m benchmarks.redis_failover --trials 10 --requests 6 --max-tokens 40

Per trial, primaries are killed in rotation. Every request's outcome is one of:
- identical: finished, text equal to the uninterrupted reference of its prompt;
- error: ended with an error the client can retry (an SSE error chunk or an HTTP error status);
- lost: anything else (no final answer, no error; or a finished text that differs).
Reported: outcomes over all trials (target: 0 lost), and the time from the kill to serving
again: until a new short request (probed every 100 ms from the moment of the kill) completes.
After each trial the killed node restarts and rejoins as its promoted replica's replica, so every
trial starts with 3 primaries that each have a replica. The cluster's node timeout is 1 s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import redis

from benchmarks.fleet_load import Answer, start_two_workers, stream_answer
from kvfleet.shared.redis_cluster import EmbeddedCluster
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire.checkpoint import TOKEN_BYTES
from tests.helpers.processes import ProcessFleet


def run_requests(url: str, prompts: list[int], max_tokens: int, on_started=None
                 ) -> list[Answer]:
    answers = [Answer(p, max_tokens) for p in prompts]
    threads = [threading.Thread(target=stream_answer, args=(url, p, max_tokens, a, 120))
               for p, a in zip(prompts, answers)]
    for thread in threads:
        thread.start()
    if on_started:
        on_started(answers)
    for thread in threads:
        thread.join(timeout=300)
    return answers


def wait_streaming(client, keys, answers: list[Answer], min_tokens: int, timeout_s=120) -> None:
    """Until every request has at least `min_tokens` checkpointed tokens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = [a.req_id for a in answers]
        if all(ids):
            try:
                if min(client.strlen(keys.checkpoint(i)) for i in ids) >= min_tokens * TOKEN_BYTES:
                    return
            except redis.RedisError:
                pass
        time.sleep(0.05)
    raise RuntimeError("the requests never started streaming")


def time_to_serving(url: str, killed_at: float, timeout_s: float = 60) -> float:
    """Seconds from the kill until a new short request completes."""
    while time.monotonic() - killed_at < timeout_s:
        answer = stream_answer(url, 999, 2, timeout_s=10)
        if answer.finish_reason and not answer.error:
            return time.monotonic() - killed_at
        time.sleep(0.1)
    return float("inf")


def classify(answer: Answer, reference: dict[int, str]) -> str:
    if answer.error:
        return "error"
    if answer.finish_reason and answer.text == reference[answer.prompt]:
        return "identical"
    return "lost"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    prompts = list(range(args.requests))
    outcomes: dict[str, int] = {"identical": 0, "error": 0, "lost": 0}
    recovery_s: list[float] = []
    errors: list[str] = []
    with EmbeddedCluster(num_primaries=3, replicas=1) as cluster, \
            tempfile.TemporaryDirectory() as logs:
        fleet = ProcessFleet(cluster.url, Path(logs), queue_shards=3,
                             worker_flags=["--kv-memory", "256MiB", "--num-threads", "1",
                                           "--heartbeat-ttl-s", "2",
                                           "--heartbeat-interval-s", "0.5"])
        try:
            start_two_workers(fleet)
            client = connect(cluster.url)
            reference = {a.prompt: a.text for a in run_requests(fleet.url, prompts,
                                                               args.max_tokens)}
            for trial in range(args.trials):
                victim = cluster.primaries()[trial % 3]
                killed = {}

                def kill(answers, victim=victim, killed=killed):
                    wait_streaming(client, fleet.keys, answers, 5)
                    killed["at"] = time.monotonic()
                    victim.kill()

                answers = run_requests(fleet.url, prompts, args.max_tokens, on_started=kill)
                recovery_s.append(time_to_serving(fleet.url, killed["at"]))
                for answer in answers:
                    outcome = classify(answer, reference)
                    outcomes[outcome] += 1
                    if outcome != "identical":
                        errors.append(f"trial {trial}: {outcome}: {answer.error or answer.text[:60]}")
                print(f"trial {trial}: killed :{victim.port}; "
                      f"{[classify(a, reference) for a in answers]}; serving again after "
                      f"{recovery_s[-1]:.2f} s", flush=True)
                victim.start()  # rejoins as a replica of the promoted node
                cluster.wait_ok()
                cluster.wait_replicated()
        finally:
            fleet.stop()
    print(f"outcomes over {args.trials} trials x {args.requests} requests: {outcomes}")
    print(f"time from kill to serving again: median {statistics.median(recovery_s):.2f} s, "
          f"max {max(recovery_s):.2f} s")
    for line in errors[:20]:
        print("  ", line)


if __name__ == "__main__":
    main()
