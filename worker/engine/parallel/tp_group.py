"""The ranks of one tensor-parallel worker: their process group, start-up, the step messages rank 0
broadcasts, and the rule that one rank's death ends the whole worker.

Rank 0 is the worker process (scheduler, sampler, Redis I/O); ranks 1..N-1 are its child
processes (`tp_rank.py`), one per device. Each step rank 0 broadcasts one `StepMessage` (the
block copies of swapping, then the forward's plan) and every rank applies it in the same order,
so every rank's KV pool holds its heads of the same blocks. Messages go over a gloo group (host
memory, as vLLM's metadata does); the layers' all_reduces over the device group (NCCL on CUDA,
gloo on CPU).

Failure rule: a child that exits while the worker runs, or a collective that fails, takes rank 0
down with a non-zero status (its requests stay pending in Redis and resume on another worker);
a child whose parent is gone exits too, so no rank outlives its worker.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from kvfleet.worker.engine.memory.device import DeviceFailure, is_cuda
from kvfleet.worker.engine.core.model_runner import PlannedChunk, StepPlan

log = logging.getLogger(__name__)

EXIT_RANK_DIED = 3  # rank 0's exit status when a child rank died under it
_STOP, _STEP = 0, 1
# A worker may sit idle for days between requests while ranks 1.. wait in a broadcast: the group's
# timeout must not end that wait. A dead peer is noticed by its closed connection or sentinel.
_IDLE_TIMEOUT = timedelta(days=365)


class RankFailure(DeviceFailure):
    """A rank or the communication between ranks failed: the worker must exit."""


class CommTimer:
    """Seconds spent in collectives (host time; on CUDA that is the launch, not the transfer)."""

    def __init__(self):
        self.seconds = 0.0
        self._started = 0.0

    def __enter__(self):
        self._started = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._started


@dataclass
class StepMessage:
    """One step for every rank: host-swap copies, then a forward (no chunks: none this step).

    Swapped-out KV is held per rank under an integer handle rank 0 assigns; `drops` are handles
    whose host copies are no longer needed (their request was aborted while swapped out).
    """

    plan: StepPlan
    swap_out: list[tuple[int, list[int]]] = field(default_factory=list)  # (handle, blocks)
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)  # (handle, new blocks)
    drops: list[int] = field(default_factory=list)

    def encode(self) -> list[int]:
        """Flat ints: counts, chunk records, tokens, block tables, swap ops, drops, adapter
        loads (slot, then name and path as UTF-8 bytes, each after its length)."""
        chunks, loads = self.plan.chunks, self.plan.lora_loads
        out = [len(chunks), len(self.plan.token_ids), len(self.swap_out), len(self.swap_in),
               len(self.drops), len(loads)]
        for c in chunks:
            out += [c.start, c.num_tokens, len(c.block_table), int(c.emits_token), c.num_draft,
                    c.lora_slot]
        out += self.plan.token_ids
        for c in chunks:
            out += c.block_table
        for handle, blocks in self.swap_out + self.swap_in:
            out += [handle, len(blocks), *blocks]
        out += self.drops
        for slot, name, path in loads:
            out.append(slot)
            for text in (name.encode(), path.encode()):
                out += [len(text), *text]
        return out

    @classmethod
    def decode(cls, values: list[int]) -> StepMessage:
        num_chunks, num_tokens, num_out, num_in, num_drops, num_loads = values[:6]
        fields = 6  # per chunk record
        at = 6 + fields * num_chunks
        records = [values[6 + fields * i:6 + fields * (i + 1)] for i in range(num_chunks)]
        token_ids = values[at:at + num_tokens]
        at += num_tokens
        chunks = []
        for start, n, table_len, emits, num_draft, lora_slot in records:
            chunks.append(PlannedChunk(start, n, values[at:at + table_len], bool(emits),
                                       num_draft, lora_slot))
            at += table_len
        ops = []
        for _ in range(num_out + num_in):
            handle, n = values[at:at + 2]
            ops.append((handle, values[at + 2:at + 2 + n]))
            at += 2 + n
        drops = values[at:at + num_drops]
        at += num_drops
        loads = []
        for _ in range(num_loads):
            slot, texts = values[at], []
            at += 1
            for _ in range(2):
                n = values[at]
                texts.append(bytes(values[at + 1:at + 1 + n]).decode())
                at += 1 + n
            loads.append((slot, *texts))
        return cls(StepPlan(chunks, token_ids, loads), ops[:num_out], ops[num_out:], drops)


def rank_device(device_name: str, rank: int) -> torch.device:
    """Rank r's device: cuda:(base + r) on CUDA (base from `cuda:N`, else 0), else the CPU."""
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if not is_cuda(device):
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class RankGroup:
    """This process's place in a tensor-parallel worker: its rank, device and process groups."""

    def __init__(self, rank: int, world_size: int, device: torch.device, init_method: str,
                 children=()):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.comm_timer = CommTimer()  # the layers' all_reduces
        self.message_timer = CommTimer()  # rank 0's step broadcasts
        self._children = list(children)  # rank 0: multiprocessing.Process of ranks 1..N-1
        self._stopping = False
        self._failed = False  # a collective failed: the ranks are out of step
        if self._children:
            threading.Thread(target=self._watch_children, daemon=True,
                             name="tp-rank-watch").start()
        backend = "nccl" if is_cuda(device) else "gloo"
        if is_cuda(device):  # NCCL binds each rank's communicator to the current device
            torch.cuda.set_device(device)
        # a rank that dies before the rendezvous is caught by the watcher, not by a timeout
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=_IDLE_TIMEOUT)
        self.group = dist.group.WORLD
        self.control = dist.new_group(backend="gloo") if backend != "gloo" else self.group
        self._next_handle = 0
        self._handles: dict[str, int] = {}  # rank 0: swapped-out req_id -> handle
        self._drops: list[int] = []

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- agreement ----------------------------------------------------------------------------

    def agree_min(self, value: int) -> int:
        """The smallest `value` over all ranks (the KV pool size every rank can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        self._collective(dist.all_reduce, tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    # ---- rank 0: sending ----------------------------------------------------------------------

    def send_step(self, plan: StepPlan, swap_out: list[tuple[str, list[int]]],
                  swap_in: list[tuple[str, list[int]]]) -> None:
        """Broadcast one step (scheduler swap lists by req_id; handles stand in for them)."""
        out = [(self._handle_for(req_id), blocks) for req_id, blocks in swap_out]
        into = [(self._handles.pop(req_id), blocks) for req_id, blocks in swap_in]
        message = StepMessage(plan, out, into, self._drops)
        self._drops = []
        self._broadcast(_STEP, message.encode())

    def discard_swapped(self, req_id: str) -> None:
        """A swapped-out request left: the ranks drop its host copies with the next step."""
        handle = self._handles.pop(req_id, None)
        if handle is not None:
            self._drops.append(handle)

    def _handle_for(self, req_id: str) -> int:
        self._next_handle += 1
        self._handles[req_id] = self._next_handle
        return self._next_handle

    def _broadcast(self, op: int, values: list[int]) -> None:
        header = torch.tensor([op, len(values)], dtype=torch.int64)
        with self.message_timer:
            self._collective(dist.broadcast, header, src=0, group=self.control)
            if values:
                self._collective(dist.broadcast, torch.tensor(values, dtype=torch.int64), src=0,
                                 group=self.control)

    # ---- ranks 1..: receiving -----------------------------------------------------------------

    def receive(self) -> StepMessage | None:
        """The next step from rank 0, or None when the worker stops."""
        header = torch.empty(2, dtype=torch.int64)
        self._collective(dist.broadcast, header, src=0, group=self.control)
        op, length = header.tolist()
        if op == _STOP:
            return None
        body = torch.empty(length, dtype=torch.int64)
        if length:
            self._collective(dist.broadcast, body, src=0, group=self.control)
        return StepMessage.decode(body.tolist())

    # ---- lifecycle ----------------------------------------------------------------------------

    def _collective(self, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as exc:
            self._failed = True
            raise RankFailure(f"tensor-parallel rank {self.rank}: {exc}") from exc

    def _watch_children(self) -> None:
        """Rank 0: a child that exits before `stop` ends the worker at once."""
        sentinels = {p.sentinel: p for p in self._children}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return
        child = sentinels[ready[0]]
        child.join(timeout=1)
        log.critical("tensor-parallel rank process %s exited (status %s): the worker exits; its "
                     "requests resume on another worker", child.name, child.exitcode)
        os._exit(EXIT_RANK_DIED)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Rank 0: tell the other ranks to exit, wait for them, leave the group."""
        if self._stopping:
            return
        self._stopping = True
        if not self._failed:
            try:
                self._broadcast(_STOP, [])
            except RankFailure as exc:
                log.warning("stopping tensor-parallel ranks: %s", exc)
        for child in self._children:
            child.join(timeout=timeout_s if not self._failed else 1.0)
            if child.is_alive():
                child.kill()
                child.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Ranks 1..: exit when the worker process (our parent) is gone."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(EXIT_RANK_DIED)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()
