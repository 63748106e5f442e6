"""The KV transfer plane: the bytes of a handoff go worker to worker over TCP.

Redis only coordinates a handoff (shared/wire/handoff.py); the taker fetches the stream's KV from
the source's plane, one connection per fetch. Integers are big-endian:

    request  magic (4 bytes) | version (1) | id length (u16) | handoff id (UTF-8)
    reply    magic | version | status (1) | header length (u32) | payload length (u64) | header |
             payload

A reply other than OK carries its reason as the header and no payload; a request that is not the
plane's gets the connection closed. The source sends its buffers back to back without copying
them, and the taker receives the payload into one buffer allocated once, so a fetch runs at a
large share of the wire's own rate (`measure_wire_rate`).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"KVTP"
VERSION = 1
_REQUEST = struct.Struct("!4sBH")  # magic, version, id length
_REPLY = struct.Struct("!4sBBIQ")  # magic, version, status, header length, payload length
OK, GONE, FAILED = 0, 1, 2
_STATUS_WORDS = {GONE: "gone", FAILED: "failed"}
# a handoff id is short (`req_id@worker_id#serial`); a prefix's lists its blocks' hashes
# (worker/handoff/peer_prefixes.py): up to the length field's limit. A plane older than prefix fetches
# took at most 1,024 bytes and closes the connection on a longer id: the fetch fails, the asker
# computes the prefix
MAX_ID_BYTES = 0xFFFF
MAX_HEADER_BYTES = 64 << 20  # a header is a few MB at most: a longer one is a garbled reply
SOCKET_BUFFER_BYTES = 4 << 20
# The source sends its payload this much at a time: the idle timeout bounds each piece, so a
# taker that stops reading frees the source's thread whatever the payload's size.
SEND_CHUNK_BYTES = 8 << 20
ACCEPT_POLL_S = 0.5  # how soon the accept thread sees `close` where shutdown does not wake it
CLOSE_JOIN_S = 2.0  # how long `close` waits for the connection threads
IDLE_TIMEOUT_S = 30.0  # a connection that makes no progress this long is dropped


class TransferError(Exception):
    """A fetch that failed: refused ('gone': the source no longer has it), connection refused or
    reset, timed out, or a short or garbled reply."""


@dataclass
class Outgoing:
    """What a source sends for one handoff: a small header (msgpack or JSON, a few MB at most)
    and the payload, its buffers sent back to back (C-contiguous, any format)."""

    header: bytes
    buffers: list[memoryview]

    @property
    def num_bytes(self) -> int:
        """Payload bytes."""
        return sum(memoryview(buffer).nbytes for buffer in self.buffers)


@dataclass
class TransferStats:
    """A plane's counters since it was made: as a source (sent, served, refused) and as a taker
    (received)."""

    bytes_sent: int = 0  # payload bytes
    bytes_received: int = 0  # payload bytes of successful fetches
    fetches_served: int = 0
    fetches_refused: int = 0  # gone, or the source failed to provide it
    # seconds the successful fetches' payloads took on the wire, from the reply's header to the
    # last byte (not the source's wait for a step to end): bytes_received / this is the rate
    payload_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, count in counts.items():
                setattr(self, name, getattr(self, name) + count)


class TransferPlane(Protocol):
    """What the worker needs from a transfer plane; TCP here, room for NIXL/UCX or NCCL on GPU
    hosts."""

    def start(self, provide: Callable[[str], Outgoing | None]) -> str:
        """Serve handoffs and prefixes, `provide(id)` giving each one's bytes (None: gone);
        returns the advertised "host:port"."""
        ...

    def fetch(self, addr: str, handoff_id: str, timeout_s: float) -> tuple[bytes, memoryview]:
        """The header and payload of `handoff_id` from the plane at `addr`; TransferError
        otherwise."""
        ...

    def close(self) -> None:
        """Stop serving; a taker's fetch in progress fails."""
        ...


def _tune(sock: socket.socket) -> None:
    """No Nagle delay (the request and a reply's head go out at once) and large buffers; set
    before listen or connect, since the TCP window scale is agreed at the handshake."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:  # refused by the host: its default then
            pass


def _prepare(outgoing: Outgoing) -> tuple[bytes, list[memoryview]]:
    """The header and the payload as flat byte views, checked before the reply's head goes out
    (ValueError, TypeError: the source failed)."""
    header = bytes(outgoing.header)
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {len(header)} bytes (at most {MAX_HEADER_BYTES})")
    return header, [memoryview(buffer).cast("B") for buffer in outgoing.buffers]


def _send_payload(sock: socket.socket, views: list[memoryview], stats: TransferStats) -> None:
    for view in views:
        for start in range(0, view.nbytes, SEND_CHUNK_BYTES):
            chunk = view[start:start + SEND_CHUNK_BYTES]
            sock.sendall(chunk)
            stats.add(bytes_sent=chunk.nbytes)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view` from `sock` by `deadline` (time.monotonic); OSError otherwise (TimeoutError,
    or ConnectionError for a peer that closed early)."""
    got = 0
    while got < view.nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left)
        count = sock.recv_into(view[got:])
        if count == 0:
            raise ConnectionError(f"short read: {got} of {view.nbytes} bytes, then the peer "
                                  f"closed")
        got += count


def _allocate(num_bytes: int) -> memoryview:
    """A buffer of `num_bytes` for the payload to land in. Not a bytearray: that one writes
    zeros over every page first, which on loopback took longer than the transfer itself; numpy
    leaves the pages untouched and asks for huge pages, so the first write (the receive) is
    cheap; only where memory is fragmented may the kernel stall once to assemble them."""
    return memoryview(np.empty(num_bytes, dtype=np.uint8))


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port,
                                                               type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            _tune(sock)
            sock.settimeout(timeout_s)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _tune(listener)  # accepted connections inherit it
        listener.bind(sockaddr)
        listener.listen(64)
    except OSError:
        listener.close()
        raise
    return listener


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 literal
    if not host or not port.isdigit():
        raise TransferError(f"not a host:port address: {addr!r}")
    return host, int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TcpTransferPlane:
    """The transfer plane over TCP. As a source it serves from daemon threads: one accepts, one
    per connection answers that connection's one fetch (calling `provide` there, which may block
    for a while). As a taker, `fetch` works whether or not the plane was started, from several
    threads at once."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, advertise_host: str = "",
                 idle_timeout_s: float = IDLE_TIMEOUT_S):
        """`port` 0: a free port; `advertise_host` "": this machine's hostname. A taker that
        sends nothing, or reads nothing, for `idle_timeout_s` loses its connection."""
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.idle_timeout_s = idle_timeout_s
        self.stats = TransferStats()
        self._provide: Callable[[str], Outgoing | None] | None = None
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards what follows, and the accept thread's adds
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()

    def start(self, provide: Callable[[str], Outgoing | None]) -> str:
        """Serve handoffs, `provide(handoff_id)` giving each one's bytes (None: gone); returns
        the advertised "host:port"."""
        if self._listener is not None or self._closed:
            raise RuntimeError("a transfer plane starts once")
        self._provide = provide
        self._listener = _listen(self.host, self.port)
        self._listener.settimeout(ACCEPT_POLL_S)
        self._accept_thread = threading.Thread(target=self._accept_loop, args=(self._listener,),
                                               daemon=True, name="kv-transfer-accept")
        self._accept_thread.start()
        port = self._listener.getsockname()[1]
        return _join_host_port(self.advertise_host or socket.gethostname(), port)

    def fetch(self, addr: str, handoff_id: str, timeout_s: float) -> tuple[bytes, memoryview]:
        """The header and payload of `handoff_id` from the plane at `addr` ("host:port"), the
        whole fetch (connecting, the source's `provide`, the transfer) within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        host, port = _split_addr(addr)
        shown = (handoff_id if len(handoff_id) <= 80  # a prefix's id lists its hashes
                 else f"{handoff_id[:72]}... ({len(handoff_id)} bytes)")
        what = f"handoff {shown} from {addr}"
        raw_id = handoff_id.encode()
        if not 0 < len(raw_id) <= MAX_ID_BYTES:
            raise TransferError(f"{what}: the id must be 1 to {MAX_ID_BYTES} bytes")
        try:
            with _connect(host, port, timeout_s) as sock:
                sock.sendall(_REQUEST.pack(MAGIC, VERSION, len(raw_id)) + raw_id)
                head = bytearray(_REPLY.size)
                _recv_into(sock, memoryview(head), deadline)
                magic, version, status, header_len, payload_len = _REPLY.unpack(head)
                if (magic != MAGIC or version != VERSION or header_len > MAX_HEADER_BYTES
                        or status not in (OK, *_STATUS_WORDS)):
                    raise TransferError(f"{what}: garbled reply {bytes(head)!r}")
                header = bytearray(header_len)
                _recv_into(sock, memoryview(header), deadline)
                if status != OK:
                    reason = header.decode(errors="replace")
                    raise TransferError(f"{what}: {_STATUS_WORDS[status]}: {reason}")
                try:
                    payload = _allocate(payload_len)
                except MemoryError:
                    raise TransferError(f"{what}: no memory for {payload_len} bytes") from None
                started = time.perf_counter()
                _recv_into(sock, payload, deadline)
                seconds = time.perf_counter() - started
        except TimeoutError as e:
            raise TransferError(f"{what}: timed out after {timeout_s:g} s") from e
        except OSError as e:
            raise TransferError(f"{what}: {e}") from e
        self.stats.add(bytes_received=payload.nbytes, payload_seconds=seconds)
        return bytes(header), payload

    def close(self) -> None:
        """Stop accepting, cut every connection (a fetch in progress fails with TransferError),
        and wait a little for the threads: one still inside `provide` ends when it returns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        deadline = time.monotonic() + CLOSE_JOIN_S
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept on Linux
            except OSError:
                pass
            self._accept_thread.join(ACCEPT_POLL_S + CLOSE_JOIN_S)
            self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv or send
            except OSError:
                pass
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed:
                    return
                log.warning("kv transfer plane: accept failed: %s", e)
                time.sleep(ACCEPT_POLL_S)  # out of descriptors, say: no busy loop
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                          name="kv-transfer-conn")
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # not inherited everywhere
            handoff_id = self._read_request(conn)
            if handoff_id is not None:
                conn.settimeout(self.idle_timeout_s)
                self._reply(conn, handoff_id)
        except OSError as e:  # the taker went away, stalled, or the plane closed
            log.debug("kv transfer plane: connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def _read_request(self, conn: socket.socket) -> str | None:
        """The requested handoff id; None for a request that is not the plane's."""
        deadline = time.monotonic() + self.idle_timeout_s
        head = bytearray(_REQUEST.size)
        _recv_into(conn, memoryview(head), deadline)
        magic, version, id_len = _REQUEST.unpack(head)
        if magic != MAGIC or version != VERSION or not 0 < id_len <= MAX_ID_BYTES:
            log.warning("kv transfer plane: not a fetch request: %r", bytes(head))
            return None
        raw_id = bytearray(id_len)
        _recv_into(conn, memoryview(raw_id), deadline)
        try:
            return raw_id.decode()
        except UnicodeDecodeError:
            log.warning("kv transfer plane: a handoff id that is not UTF-8: %r", bytes(raw_id))
            return None

    def _reply(self, conn: socket.socket, handoff_id: str) -> None:
        try:
            outgoing = self._provide(handoff_id)
            prepared = None if outgoing is None else _prepare(outgoing)
        except Exception as e:
            log.exception("kv transfer plane: providing handoff %s failed", handoff_id)
            self._refuse(conn, FAILED, f"the source could not provide it: {e!r}")
            return
        if prepared is None:
            self._refuse(conn, GONE, "the source no longer has it")
            return
        header, views = prepared
        num_bytes = sum(view.nbytes for view in views)
        conn.sendall(_REPLY.pack(MAGIC, VERSION, OK, len(header), num_bytes) + header)
        _send_payload(conn, views, self.stats)
        self.stats.add(fetches_served=1)

    def _refuse(self, conn: socket.socket, status: int, reason: str) -> None:
        self.stats.add(fetches_refused=1)
        raw = reason.encode()
        conn.sendall(_REPLY.pack(MAGIC, VERSION, status, len(raw), 0) + raw)


def measure_wire_rate(num_bytes: int = 256 << 20, host: str = "127.0.0.1") -> float:
    """Bytes per second of one raw TCP transfer of `num_bytes` over `host` with the same socket
    options and chunking as the plane (an iperf-like reference the benchmark prints beside the
    handoff rate). Both ends' buffers are allocated and written before the clock starts: the
    wire alone is timed, where a fetch also pays for its payload's fresh pages."""
    source, sink = _allocate(num_bytes), _allocate(num_bytes)
    for buffer in (source, sink):
        np.frombuffer(buffer, dtype=np.uint8).fill(0)
    stats = TransferStats()
    with _listen(host, 0) as listener:
        listener.settimeout(IDLE_TIMEOUT_S)
        errors: list[OSError] = []

        def send() -> None:
            try:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(IDLE_TIMEOUT_S)
                    _send_payload(conn, [source], stats)
            except OSError as e:
                errors.append(e)

        sender = threading.Thread(target=send, daemon=True, name="kv-wire-rate")
        sender.start()
        started = time.perf_counter()
        with _connect(host, listener.getsockname()[1], IDLE_TIMEOUT_S) as sock:
            _recv_into(sock, sink, time.monotonic() + IDLE_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        sender.join()
    if errors:
        raise errors[0]
    return num_bytes / elapsed
