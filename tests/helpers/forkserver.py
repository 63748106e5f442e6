"""Fork servers for the processes the tests start (`python -m kvfleet worker ...`, `python -m
tests.integration.slow_worker ...`): a server process imports a command's modules once (5 s of
CPU for a worker: torch, transformers, the engine), then forks a child for each process a test
starts, which runs `python -m MODULE ARGS` from there as a fresh interpreter would: its own
session, environment, working directory and log file, the module run as `__main__`, its exit
status the interpreter's. Only imports happen before the fork (no model, no thread of ours, no
connection); a child loads its model, reads its settings and environment itself.

    server = ForkServer("worker", ["kvfleet.worker.process.main"], log_dir)    # starts importing at once
    process = server.spawn("kvfleet", ["worker", ...], env, log_path)  # Popen's calls

The children are the server's: it reaps them and writes each exit status (Popen's returncode:
-N for a signal) to a file, which `ForkedProcess` reads.

tests/conftest.py installs the session's servers (`install`); `server(name)` is None where none
is installed (benchmarks, scripts: every process a fresh interpreter).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class ForkedProcess:
    """The Popen calls the tests make (`pid`, `poll`, `wait`, `send_signal`, `kill`,
    `terminate`, `returncode`) on a process a ForkServer forked: not this process's child, its
    exit status comes from the status file the server writes when it reaps it."""

    def __init__(self, pid: int, args: list[str], status_path: Path):
        self.pid, self.args, self._status_path = pid, args, status_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._status_path.read_text())
            except FileNotFoundError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited and reaped, its status not yet written
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """The test side of one server: it imports `preload` (module names) at once, in the
    background, then forks on request; `spawn` waits for the imports the first time."""

    def __init__(self, name: str, preload: list[str], log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"forkserver-{name}.log"
        with open(self.log_path, "wb") as log:
            self._server = subprocess.Popen([sys.executable, "-m", __name__, *preload],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, start_new_session=True)
        self._lock = threading.Lock()
        self._count = 0

    def spawn(self, module: str, args: list[str], env: dict[str, str], log_path: Path,
              cwd: Path | str | None = None) -> ForkedProcess:
        """`python -m module *args` with exactly `env` as its environment, stdout and stderr to
        `log_path` (created here), in `cwd` (default: this process's working directory)."""
        log_path.write_bytes(b"")
        with self._lock:
            self._count += 1
            status_path = log_path.with_name(f"{log_path.name}.exit-{self._count}")
            request = {"module": module, "args": args, "env": env, "cwd": str(cwd or os.getcwd()),
                       "log": str(log_path), "status": str(status_path)}
            self._server.stdin.write(json.dumps(request).encode() + b"\n")
            self._server.stdin.flush()
            reply = self._server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server exited:\n{self.log_path.read_text()[-4000:]}")
        return ForkedProcess(json.loads(reply)["pid"], [module, *args], status_path)

    def close(self) -> None:
        """SIGKILL the server: nothing of its own to finish, and a clean exit would spend a second
        in its last garbage collection (children it forked live on, orphans)."""
        self._server.kill()
        self._server.wait()
        self._server.stdin.close()
        self._server.stdout.close()


class ForkServers:
    """Fork servers by name (`preload`: each one's modules), each started at the first request
    for it, none before: a test that times something on a quiet CPU before it starts its
    processes finds no server importing (`start` several at once: they import side by side)."""

    def __init__(self, preload: dict[str, list[str]], log_dir: Path):
        self._preload, self._log_dir = preload, log_dir
        self._servers: dict[str, ForkServer] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> ForkServer | None:
        if name not in self._preload:
            return None
        with self._lock:
            if name not in self._servers:
                self._servers[name] = ForkServer(name, self._preload[name], self._log_dir)
            return self._servers[name]

    def start(self, *names: str) -> None:
        for name in names:
            self.get(name)

    def close(self) -> None:
        with self._lock:
            for server in self._servers.values():
                server.close()
            self._servers.clear()


_installed: ForkServers | None = None


def install(servers: ForkServers | None) -> None:
    """The fork servers `server` gives from now on (None: none)."""
    global _installed
    _installed = servers


def server(name: str) -> ForkServer | None:
    """The installed fork server `name` (started now if it was not), None without one."""
    return _installed.get(name) if _installed is not None else None


def start(*names: str) -> None:
    """Start the installed servers `names` (those not yet started), to import side by side."""
    if _installed is not None:
        _installed.start(*names)


# The server side: `python -m tests.helpers.forkserver MODULE...`.

def _reap(children: dict[int, str]) -> None:
    """Write the exit status of every child that has exited (atomically: a reader never sees a
    partial file)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            Path(path + ".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)


def _serve(preload: list[str]) -> dict:
    """Import `preload`, then fork a child for each request line on stdin, answering its pid on
    stdout. Returns in a child only (its request); the server exits at the end of its input.
    Idle, it sleeps in select() until a request comes or a child exits (SIGCHLD)."""
    replies = os.dup(1)  # the answers' pipe; whatever an import prints goes to the server's log
    os.dup2(2, 1)
    for name in preload:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # handled: the wakeup fd hears of it
    children: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            while True:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    break
        _reap(children)
        if 0 not in readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            raise SystemExit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # as a fresh interpreter: SIGCHLD by default, none of our pipes
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (replies, wake_r, wake_w):
                    os.close(fd)
                return request
            children[pid] = request["status"]
            os.write(replies, json.dumps({"pid": pid}).encode() + b"\n")


def _become(request: dict) -> None:
    """In the child: what `subprocess.Popen([python, -m, module, ...], env=..., stdout=log,
    stderr=STDOUT, start_new_session=True)` would have given it."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]  # run_module sets argv[0] to its path


if __name__ == "__main__":
    _request = _serve(sys.argv[1:])
    _become(_request)
    import runpy

    runpy.run_module(_request["module"], run_name="__main__", alter_sys=True)
