"""The `kvfleet` command: up, gateway, worker, plan, bench, batch-worker, keys, drain.

Every setting of `GatewaySettings` / `WorkerSettings` becomes a flag (`kv_memory` -> `--kv-memory`);
a flag left out falls back to its `KVFLEET_*` environment variable, then to the default.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvfleet.flags import add_settings_flags, given_flags, settings_from_args
from kvfleet.shared.settings import CommonSettings, GatewaySettings, UpSettings, WorkerSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a local fleet: Redis (embedded if none) + gateway + workers")
    up.add_argument("--workers", type=int, default=None,
                    help="worker processes of each model (--worker-models, else --model), of "
                         "--role (default both) (default: 1; 0 with --prefill-workers or "
                         "--decode-workers)")
    add_settings_flags(up, UpSettings)
    # A setting both sides read (`max_lora_rank`) is one flag, and one variable for both.
    add_settings_flags(up, WorkerSettings, skip=UpSettings.model_fields)

    gateway = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    add_settings_flags(gateway, GatewaySettings)

    worker = sub.add_parser("worker", help="run one worker (one accelerator)")
    add_settings_flags(worker, WorkerSettings)

    from kvfleet import batch_worker, drain_cli, keys_cli, timelines_cli
    from kvfleet.bench import command as bench
    from kvfleet.plan import command as plan

    plan.add_arguments(sub.add_parser("plan", help="capacity planner (the seed's numbers)"))
    bench.add_arguments(sub.add_parser("bench", help="replay a request trace against a fleet"))
    batch_worker.add_arguments(sub.add_parser("batch-worker",
                                              help="rq worker that runs batch jobs (/v1/batches)"))
    keys_cli.add_arguments(sub.add_parser("keys", help="API keys: create, list, revoke"))
    drain_cli.add_arguments(sub.add_parser(
        "drain", help="ask one worker to drain: hand its streams to peers, finish, exit"))
    timelines_cli.add_arguments(sub.add_parser(
        "timelines", help="where finished requests' time went: queue, prefill, gaps"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("up", "gateway", "worker"):
        level = getattr(args, "log_level", None) or CommonSettings().log_level
        logging.basicConfig(level=level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # settings are checked before the service's modules load (the worker's pull in torch: seconds),
    # so a bad flag is reported at once
    if args.command == "up":
        settings_from_args(UpSettings, args)  # here, not in each child (a worker is restarted)
        settings_from_args(WorkerSettings, args)
        from kvfleet.up import run_fleet

        return run_fleet(args.workers, given_flags(UpSettings, args)
                         | given_flags(WorkerSettings, args))
    if args.command == "gateway":
        settings = settings_from_args(GatewaySettings, args)
        from kvfleet.gateway.app import serve

        serve(settings)
        return 0
    if args.command == "worker":
        settings = settings_from_args(WorkerSettings, args)
        from kvfleet.worker.sim.checks import check_sim_settings

        check_sim_settings(settings)  # before the engine's modules load
        if settings.simulated:  # the forward replaced by a cost model (worker/sim/host.py)
            from kvfleet.worker.sim.host import run_sim_workers

            run_sim_workers(settings)
            return 0
        from kvfleet.worker.process.main import run_worker

        run_worker(settings)
        return 0
    from kvfleet import batch_worker, drain_cli, keys_cli, timelines_cli
    from kvfleet.bench import command as bench
    from kvfleet.plan import command as plan

    commands = {"plan": plan.run, "bench": bench.run, "batch-worker": batch_worker.run,
                "keys": keys_cli.run, "drain": drain_cli.run, "timelines": timelines_cli.run}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
