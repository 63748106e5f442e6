"""`kvfleet drain WORKER_ID`: ask one worker to drain, through the fleet's Redis (the key the
gateway's `POST /admin/workers/{id}/drain` sets): within a heartbeat it stops taking work, hands
its running streams with their KV to peers with room, finishes the rest and exits (code 0)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvfleet.gateway.admin import request_drain
from kvfleet.gateway.fleet.load import read_heartbeats
from kvfleet.shared.redis_connect import REDIS_FAILURES, connect_async
from kvfleet.shared.settings import CommonSettings
from kvfleet.shared.wire import Heartbeat, Keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("worker_id", metavar="WORKER_ID",
                        help="the worker's id, as the dashboard and GET /admin/workers list it")
    parser.add_argument("--redis-url", default=None,
                        help="the fleet's Redis (default: KVFLEET_REDIS_URL)")
    parser.add_argument("--key-prefix", default=None, help="default: KVFLEET_KEY_PREFIX or kvf:")


async def _drain(redis_url: str, keys: Keys, worker_id: str) -> tuple[Heartbeat | None, list[str]]:
    """The worker's heartbeat (None: no such live worker, then the live workers' ids)."""
    client = connect_async(redis_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        beat = await request_drain(client, keys, worker_id)
        return beat, [] if beat is not None else list(await read_heartbeats(client, keys))
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    settings = CommonSettings()
    redis_url = args.redis_url or settings.redis_url
    if not redis_url:
        print("kvfleet drain: needs --redis-url (or KVFLEET_REDIS_URL)", file=sys.stderr)
        return 2
    keys = Keys(args.key_prefix or settings.key_prefix)
    try:
        beat, live = asyncio.run(_drain(redis_url, keys, args.worker_id))
    except (*REDIS_FAILURES, OSError) as exc:
        print(f"kvfleet drain: Redis error: {exc}", file=sys.stderr)
        return 1
    if beat is None:
        print(f"kvfleet drain: no live worker {args.worker_id} (no heartbeat); live workers: "
              f"{', '.join(live) or 'none'}", file=sys.stderr)
        return 1
    print(f"asked worker {args.worker_id} ({beat.model}, role {beat.role}, {beat.running} "
          "running) to drain: it hands its streams to peers and exits within its drain timeout")
    return 0
