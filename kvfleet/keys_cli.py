"""`kvfleet keys create|list|revoke`: API keys kept in the fleet's Redis as SHA-256 hashes (the
plaintext key is printed once, at creation, and stored nowhere)."""

from __future__ import annotations

import argparse
import sys
import time

import redis

from kvfleet.gateway.admission.auth import create_key, list_keys, revoke_key
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="the fleet's Redis (default: KVFLEET_REDIS_URL)")
    parser.add_argument("--key-prefix", default=None, help="default: KVFLEET_KEY_PREFIX or kvf:")
    sub = parser.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--name", default="", help="a label for the key (who uses it)")
    create.add_argument("--rpm", type=int, default=None,
                        help="requests per minute (default: the gateway's --rate-limit-rpm)")
    create.add_argument("--tpm", type=int, default=None,
                        help="tokens per minute, prompt + max_tokens (default: --rate-limit-tpm)")
    sub.add_parser("list", help="list keys (ids, names, limits; never the keys)")
    revoke = sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id", metavar="ID")


def _limit(value: int | None) -> str:
    return "default" if value is None else ("unlimited" if value == 0 else str(value))


def run(args: argparse.Namespace) -> int:
    settings = GatewaySettings()
    redis_url = args.redis_url or settings.redis_url
    if not redis_url:
        print("kvfleet keys: needs --redis-url (or KVFLEET_REDIS_URL)", file=sys.stderr)
        return 2
    keys = Keys(args.key_prefix or settings.key_prefix)
    client = connect(redis_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        if args.keys_command == "create":
            record, plaintext = create_key(client, keys, args.name, args.rpm, args.tpm)
            print(f"created {record.id} (name {record.name or '-'}, rpm {_limit(record.rpm)}, "
                  f"tpm {_limit(record.tpm)}); the key, shown only this once:", file=sys.stderr)
            print(plaintext)
            return 0
        if args.keys_command == "list":
            print(f"{'ID':<14} {'NAME':<20} {'RPM':>9} {'TPM':>9}  CREATED (UTC)")
            for r in list_keys(client, keys):
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created))
                print(f"{r.id:<14} {r.name[:20]:<20} {_limit(r.rpm):>9} {_limit(r.tpm):>9}  "
                      f"{created}")
            return 0
        if revoke_key(client, keys, args.key_id):
            print(f"revoked {args.key_id}")
            return 0
        print(f"kvfleet keys: no key with id {args.key_id}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"kvfleet keys: Redis error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
