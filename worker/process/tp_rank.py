"""Starting a tensor-parallel worker's ranks, and what ranks 1..N-1 do: follow rank 0's steps.

Every rank builds the same `Engine` on its shard (so sharding, the pool's size agreement and the
start-up profile run the same way on all of them); only rank 0 schedules and samples. The others
loop: receive a step, apply its swap copies to their own pool, run the forward, repeat.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable

import torch

from kvfleet.shared.redis_server import free_port
from kvfleet.worker.engine.core.config import EngineConfig
from kvfleet.worker.engine.memory.kv_cache import HostBlocks
from kvfleet.worker.engine.parallel.tp_group import RankGroup, rank_device, watch_parent

log = logging.getLogger(__name__)

ModelLoader = Callable[[], torch.nn.Module]  # picklable: the ranks load their copy themselves


def launch_engine(load_model: ModelLoader, config: EngineConfig, tokenizer=None,
                  num_threads: int | None = None):
    """An engine over `config.parallel.tensor_parallel_size` ranks: this process is rank 0, the
    others are started here and load the model with `load_model` (picklable) themselves."""
    from kvfleet.worker.engine.engine import Engine

    if config.parallel.tensor_parallel_size == 1:
        return Engine(load_model(), config, tokenizer=tokenizer)
    ranks = launch_ranks(load_model, config, num_threads)
    try:
        return Engine(load_model(), config, tokenizer=tokenizer, ranks=ranks)
    except BaseException:
        ranks.stop()
        raise


def launch_ranks(load_model: ModelLoader, config: EngineConfig,
                 num_threads: int | None = None) -> RankGroup:
    """Start ranks 1..N-1 (spawned processes) and join them as rank 0."""
    if torch.distributed.is_initialized():  # checked before any rank is started
        raise RuntimeError("a process holds one tensor-parallel group at a time")
    world_size = config.parallel.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")  # no CUDA or OpenMP state forked into ranks
    children = []
    for rank in range(1, world_size):
        child = context.Process(
            target=rank_main, name=f"tp-rank-{rank}",
            args=(rank, init_method, load_model, config, num_threads, os.getpid(),
                  logging.getLogger().level))
        child.start()
        children.append(child)
    log.info("tensor parallel: started ranks 1..%d (pids %s)", world_size - 1,
             ", ".join(str(c.pid) for c in children))
    return RankGroup(0, world_size, rank_device(config.model.device, 0), init_method, children)


def rank_main(rank: int, init_method: str, load_model: ModelLoader, config: EngineConfig,
              num_threads: int | None, parent_pid: int, log_level: int) -> None:
    """Entry point of rank `rank` > 0."""
    # Ctrl-C reaches the whole process group: rank 0 handles it and stops us in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    watch_parent(parent_pid)
    if num_threads:
        torch.set_num_threads(num_threads)
    from kvfleet.worker.engine.engine import Engine

    group = RankGroup(rank, config.parallel.tensor_parallel_size,
                      rank_device(config.model.device, rank), init_method)
    engine = Engine(load_model(), config, ranks=group)
    follow(engine, group)
    # leave the group before the interpreter tears down: a gloo group still alive at exit can
    # end the process in std::terminate from its threads' destructors
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    log.info("rank %d stopped", rank)


def follow(engine, group: RankGroup) -> None:
    """Apply rank 0's steps to this rank's pool and model until it says stop."""
    swapped: dict[int, HostBlocks] = {}
    while (message := group.receive()) is not None:
        for handle in message.drops:
            swapped.pop(handle, None)
        for handle, blocks in message.swap_out:
            swapped[handle] = engine.pool.copy_out(blocks)
        for handle, blocks in message.swap_in:
            engine.pool.copy_in(swapped.pop(handle), blocks)
        if message.plan.chunks:
            engine.runner.forward(message.plan, keep_logits=False)
