"""`kvfleet batch-worker` (also `python -m kvfleet.batch_worker`): flags of the batch worker process
(batch/worker.py), which runs the jobs of `/v1/batches`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvfleet.batch.worker import run_batch_worker
from kvfleet.flags import add_settings_flags, given_flags, settings_from_args
from kvfleet.shared.settings import BatchSettings

NOT_FLAGS = ("model", "cache_dir")  # settings the batch worker does not use


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, BatchSettings, skip=NOT_FLAGS)
    parser.add_argument("--burst", action="store_true",
                        help="exit once the queue is empty (for tests and cron-style runs)")


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(BatchSettings, args)
    # Jobs read their settings from the environment: flags given here must reach them.
    os.environ.update(given_flags(BatchSettings, args))
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_batch_worker(settings, burst=args.burst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet batch-worker",
                                     description="rq worker that runs batch jobs (/v1/batches)")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
