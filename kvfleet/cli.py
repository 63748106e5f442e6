"""The `kvfleet` command: up, gateway, worker, plan, bench, batch-worker, keys.

Every setting of `GatewaySettings` / `WorkerSettings` becomes a flag (`kv_memory` -> `--kv-memory`);
a flag left out falls back to its `KVFLEET_*` environment variable, then to the default.
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from pathlib import Path

from pydantic import ValidationError

from shared.settings import CommonSettings, GatewaySettings, WorkerSettings


def _flag_type(annotation):
    """The argparse type of a settings field (Optional[X] -> X)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0]
    return annotation if annotation in (int, float, str, bool, Path) else str


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls, skip=()) -> None:
    """One flag per settings field; defaults None so unset flags defer to env and defaults."""
    group = parser.add_argument_group(f"{settings_cls.__name__} (env KVFLEET_<NAME>)")
    for name, field in settings_cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _flag_type(field.annotation)
        help_text = f"default: {field.default!s}" if field.default not in (None, "") else None
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        elif typing.get_origin(field.annotation) is typing.Literal:
            group.add_argument(flag, dest=name, choices=typing.get_args(field.annotation),
                               default=None, help=help_text)
        else:
            group.add_argument(flag, dest=name, type=kind, default=None, help=help_text)


def settings_from_args(settings_cls, args: argparse.Namespace):
    given = {name: getattr(args, name) for name in settings_cls.model_fields
             if getattr(args, name, None) is not None}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}"
                             for e in exc.errors())
        raise SystemExit(f"kvfleet: invalid setting: {problems}") from None


def given_flags(settings_cls, args: argparse.Namespace) -> dict[str, str]:
    """Flags the user gave, as KVFLEET_* environment entries for child processes."""
    env = {}
    for name in settings_cls.model_fields:
        value = getattr(args, name, None)
        if value is not None:
            env[f"KVFLEET_{name.upper()}"] = str(value).lower() if isinstance(value, bool) \
                else str(value)
    return env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a local fleet: Redis (embedded if none) + gateway + workers")
    up.add_argument("--workers", type=int, default=1, help="number of worker processes")
    add_settings_flags(up, GatewaySettings)
    add_settings_flags(up, WorkerSettings, skip=CommonSettings.model_fields)

    gateway = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    add_settings_flags(gateway, GatewaySettings)

    worker = sub.add_parser("worker", help="run one worker (one accelerator)")
    add_settings_flags(worker, WorkerSettings)

    from kvfleet import batch_worker, bench, keys_cli, plan

    plan.add_arguments(sub.add_parser("plan", help="capacity planner (the seed's numbers)"))
    bench.add_arguments(sub.add_parser("bench", help="replay a request trace against a fleet"))
    batch_worker.add_arguments(sub.add_parser("batch-worker",
                                              help="rq worker that runs batch jobs (/v1/batches)"))
    keys_cli.add_arguments(sub.add_parser("keys", help="API keys: create, list, revoke"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("up", "gateway", "worker"):
        level = getattr(args, "log_level", None) or CommonSettings().log_level
        logging.basicConfig(level=level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "up":
        from kvfleet.fleet import run_fleet

        return run_fleet(args.workers, given_flags(GatewaySettings, args)
                         | given_flags(WorkerSettings, args))
    if args.command == "gateway":
        from gateway.app import serve

        serve(settings_from_args(GatewaySettings, args))
        return 0
    if args.command == "worker":
        from worker.main import run_worker

        run_worker(settings_from_args(WorkerSettings, args))
        return 0
    from kvfleet import batch_worker, bench, keys_cli, plan

    commands = {"plan": plan.run, "bench": bench.run, "batch-worker": batch_worker.run,
                "keys": keys_cli.run}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
