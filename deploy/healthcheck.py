#!/usr/bin/env python3
"""Container health check for every kvfleet role, the role read from PID 1's command line:
gateway -> GET /health; worker -> GET its Prometheus /metrics (served once the model is loaded);
batch-worker -> Redis answers. Exit 0 = healthy."""

from __future__ import annotations

import os
import sys
import urllib.request


def command_line() -> list[str]:
    try:
        with open("/proc/1/cmdline", "rb") as cmdline:
            return [arg.decode() for arg in cmdline.read().split(b"\0") if arg]
    except OSError:
        return sys.argv[1:]


def flag(args: list[str], name: str, env: str, default: str) -> str:
    if name in args and args.index(name) + 1 < len(args):
        return args[args.index(name) + 1]
    return os.environ.get(env, default)


def main(args: list[str] | None = None) -> int:
    args = command_line() if args is None else args
    if "batch-worker" in args or "kvfleet.batch_worker" in args:
        import redis

        return 0 if redis.Redis.from_url(os.environ["KVFLEET_REDIS_URL"],
                                         socket_timeout=3).ping() else 1
    if "worker" in args:
        port = int(flag(args, "--metrics-port", "KVFLEET_METRICS_PORT", "0"))
        if port <= 0:
            return 0  # no fixed metrics port: nothing to probe (the heartbeat is in Redis)
        url = f"http://127.0.0.1:{port}/metrics"
    else:  # gateway, or `kvfleet up`
        url = f"http://127.0.0.1:{flag(args, '--port', 'KVFLEET_PORT', '8000')}/health"
    with urllib.request.urlopen(url, timeout=3) as response:
        return 0 if response.status == 200 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy", with a reason
        print(f"unhealthy: {exc!r}", file=sys.stderr)
        sys.exit(1)
