"""The rq job that runs a batch: it feeds the input lines to the gateway's own HTTP API (with
`priority: "batch"`) at most `batch_max_in_flight` at a time, records each line's result once, and
writes the output files. A job that dies is replaced (`requeue_orphans`) and resumes from what was
recorded.

Why HTTP and not the Redis stream directly: the gateway is the one place that validates, applies
the chat template, tokenises, enforces backpressure (429) and shapes OpenAI responses, so a batch
line gets exactly the answer an online client would; the job stays a thin client and needs no
tokenizer. The price: the gateway picks each request's id, so a line that was in flight when its
job died is generated again (the gateway cancels the abandoned request when the connection
drops). Lines never repeat or go missing in the output: each is recorded once, by index.

Ownership: a job holds the batch's lease (a Redis key with a short TTL, renewed by a thread) while
it feeds it; a second job for the same batch leaves at once. The lease, not rq's registries,
decides whether a batch has a live job: rq notices a killed worker only after its heartbeat TTL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx
from rq import Queue
from rq.job import JobStatus

from kvfleet.batch.store import BatchStore, OutputFile, request_lines
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.settings import BatchSettings
from kvfleet.shared.wire import BatchRecord, BatchStatus, FileRecord

log = logging.getLogger(__name__)

JOB_FUNCTION = "kvfleet.batch.jobs.run_batch"
RETRY_STATUSES = (429, 502, 503, 504)  # the fleet is busy or briefly away: try the line again
MAX_BACKOFF_S = 30.0
JOB_RESULT_TTL_S = 24 * 3600

_LOST = "lost"  # a stop reason: leave the batch to whoever owns it now

_WINDOW_UNITS_S = {"m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> int:
    """'24h' -> 86400; raises ValueError for anything but a positive number of m, h or d."""
    number, unit = window[:-1], window[-1:]
    if not number.isdigit() or int(number) <= 0 or unit not in _WINDOW_UNITS_S:
        raise ValueError(f"not a completion window: {window!r} (use e.g. 24h)")
    return int(number) * _WINDOW_UNITS_S[unit]


def enqueue_batch(queue: Queue, store: BatchStore, batch: BatchRecord) -> str:
    """One rq job for the batch; its id is recorded so the reaper can tell a waiting job."""
    job_id = f"{batch.id}-{uuid.uuid4().hex[:8]}"
    # The job enforces the completion window itself; rq's timeout is only a backstop. (A finite
    # timeout also keeps rq's started-registry entry alive for the whole run.)
    timeout_s = max(batch.expires_at - int(time.time()), 60) + 3600
    queue.enqueue(JOB_FUNCTION, batch.id, store.keys.prefix, job_id=job_id,
                  job_timeout=timeout_s, result_ttl=JOB_RESULT_TTL_S,
                  failure_ttl=JOB_RESULT_TTL_S, description=f"batch {batch.id}")
    store.set_job(batch.id, job_id)
    return job_id


def run_batch(batch_id: str, key_prefix: str) -> str:
    """The rq job. Settings other than the prefix come from the environment
    (`kvfleet batch-worker` puts its flags there)."""
    settings = BatchSettings(key_prefix=key_prefix)
    if not settings.redis_url:
        raise RuntimeError("the batch job needs KVFLEET_REDIS_URL")
    redis = connect(settings.redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        store = BatchStore(redis, settings.keys(), settings.batch_ttl_s)
        return BatchRunner(store, settings).run(batch_id)
    finally:
        redis.close()


def requeue_orphans(store: BatchStore, queue: Queue, lease_ttl_s: float) -> list[str]:
    """Enqueue a job for every unfinished batch that has no live job: no lease, and its last job
    is neither waiting in the queue nor just started. Returns the batch ids requeued."""
    requeued = []
    for batch_id in store.active_ids():
        batch = store.get_batch(batch_id)
        if batch is None or batch.status.is_final:
            store.drop_active(batch_id)  # expired or finished
            continue
        if store.lease_holder(batch_id) is not None or _job_pending(queue, batch.job_id,
                                                                    lease_ttl_s):
            continue
        log.warning("batch %s has no live job (last: %s): requeueing it", batch_id, batch.job_id)
        enqueue_batch(queue, store, batch)
        requeued.append(batch_id)
    return requeued


def _job_pending(queue: Queue, job_id: str | None, lease_ttl_s: float) -> bool:
    """True while the job will still take the lease: queued, or started a moment ago."""
    job = queue.fetch_job(job_id) if job_id else None
    if job is None:
        return False
    status = job.get_status(refresh=False)
    if status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
        return True
    started_at = job.started_at.timestamp() if job.started_at else 0.0
    return status == JobStatus.STARTED and time.time() - started_at < 2 * lease_ttl_s


class LeaseKeeper:
    """Renews the job's lease every third of its TTL in a thread; `lost` is set when another job
    holds it (this one was presumed dead) or Redis stays away for a whole TTL."""

    def __init__(self, store: BatchStore, batch_id: str, token: str, ttl_s: float):
        self._store = store
        self._batch_id = batch_id
        self._token = token
        self._ttl_s = ttl_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{batch_id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._store.release_lease(self._batch_id, self._token)
        except Exception:  # noqa: BLE001 - it expires by itself
            log.warning("could not release the lease of %s", self._batch_id, exc_info=True)

    def _run(self) -> None:
        last_renewed = time.monotonic()
        while not self._stop.wait(self._ttl_s / 3):
            try:
                if not self._store.renew_lease(self._batch_id, self._token, self._ttl_s):
                    self.lost.set()
                    return
                last_renewed = time.monotonic()
            except Exception:  # noqa: BLE001 - Redis away: keep trying until the TTL is gone
                if time.monotonic() - last_renewed > self._ttl_s:
                    self.lost.set()
                    return


class BatchRunner:
    """Feeds one batch's pending lines and finalises it; one instance per job run."""

    def __init__(self, store: BatchStore, settings: BatchSettings,
                 transport: httpx.BaseTransport | None = None):
        self.store = store
        self.settings = settings
        self._transport = transport  # tests put a fake gateway here
        self._stopping = threading.Event()  # set on cancel, expiry or a lost lease

    def run(self, batch_id: str) -> str:
        token = uuid.uuid4().hex
        if not self.store.acquire_lease(batch_id, token, self.settings.batch_lease_ttl_s):
            return "another job holds the batch"
        with LeaseKeeper(self.store, batch_id, token, self.settings.batch_lease_ttl_s) as lease:
            batch = self.store.get_batch(batch_id)
            if batch is None or batch.status.is_final:
                return "nothing to do"
            if self.store.count_attempt(batch_id) > self.settings.batch_max_attempts:
                self.store.fail(batch_id, "too_many_attempts", "The batch's job failed "
                                f"{self.settings.batch_max_attempts} times.", time.time())
                return "failed: too many attempts"
            self.store.transition(batch_id, BatchStatus.IN_PROGRESS, (BatchStatus.VALIDATING,),
                                  time.time())
            outcome = BatchStatus.COMPLETED
            if self.store.status(batch_id) in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
                outcome = self._feed(batch, lease)
            if outcome is None:  # another job owns the batch now, or it failed
                status = self.store.status(batch_id)
                return f"left the batch ({status.value if status else 'expired'})"
            return self._finalize(batch, outcome).value

    # Feeding.

    def _feed(self, batch: BatchRecord, lease: LeaseKeeper) -> BatchStatus | None:
        """Send every line without a result; the status to end in (None: leave the batch)."""
        content = self.store.file_content(batch.input_file_id)
        if content is None:
            self.store.fail(batch.id, "input_file_expired",
                            f"The input file {batch.input_file_id} no longer exists.", time.time())
            return None
        lines = request_lines(content)
        done = self.store.done_indices(batch.id)
        pending = deque(i for i in range(len(lines)) if i not in done)
        log.info("batch %s: %d lines, %d done before this run", batch.id, len(lines), len(done))
        limit = self.settings.batch_max_in_flight
        headers = {"Authorization": f"Bearer {self.settings.batch_api_key}"} \
            if self.settings.batch_api_key else {}
        http = httpx.Client(base_url=self.settings.gateway_url, headers=headers,
                            timeout=self.settings.batch_request_timeout_s,
                            limits=httpx.Limits(max_connections=limit),
                            transport=self._transport)
        stop: BatchStatus | str | None = None
        with http, ThreadPoolExecutor(limit, thread_name_prefix=f"{batch.id}-") as pool:
            in_flight: set[Future] = set()
            while pending or in_flight:
                if stop is None:
                    stop = self._stop_reason(batch, lease)
                    if stop is not None:  # in-flight lines finish; the others stay pending
                        self._stopping.set()
                        pending.clear()
                while pending and len(in_flight) < limit:
                    index = pending.popleft()
                    in_flight.add(pool.submit(self._run_line, http, batch, index, lines[index]))
                finished, in_flight = wait(in_flight, timeout=self.settings.batch_poll_s,
                                           return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()  # a bug in _run_line fails the job; the reaper retries it
        if stop == _LOST or lease.lost.is_set():
            return None
        return stop if isinstance(stop, BatchStatus) else BatchStatus.COMPLETED

    def _stop_reason(self, batch: BatchRecord, lease: LeaseKeeper) -> BatchStatus | str | None:
        """Why to stop feeding now: CANCELLED, EXPIRED, or _LOST (another job owns the batch, or
        it failed meanwhile); None to go on."""
        if lease.lost.is_set():
            return _LOST
        status = self.store.status(batch.id)
        if status == BatchStatus.CANCELLING:
            return BatchStatus.CANCELLED
        if status != BatchStatus.IN_PROGRESS:
            return _LOST
        if time.time() >= batch.expires_at:
            return BatchStatus.EXPIRED
        return None

    def _run_line(self, http: httpx.Client, batch: BatchRecord, index: int,
                  line: dict[str, Any]) -> None:
        """Send one line until it has an answer to record, or the batch stops feeding."""
        line_id = line_request_id(batch.id, index)
        body = {**line["body"], "priority": "batch", "stream": False}
        body.pop("stream_options", None)
        retries = 0
        while not self._stopping.is_set():
            try:
                response = http.post(line["url"], json=body, headers={"Idempotency-Key": line_id})
            except httpx.HTTPError as exc:
                error, delay_s = {"code": "request_failed", "message": repr(exc)}, None
            else:
                if response.status_code not in RETRY_STATUSES:
                    self._record(batch, index, line, _answer(line_id, line, response))
                    return
                error = {"code": f"http_{response.status_code}", "message": response.text[:500]}
                delay_s = _retry_after_s(response)
                if response.status_code == 429:  # a busy fleet is no failure of the line
                    self._stopping.wait(delay_s or 1.0)
                    continue
            if retries >= self.settings.batch_line_retries:
                self._record(batch, index, line, {"id": line_id, "custom_id": line["custom_id"],
                                                  "response": None, "error": error})
                return
            retries += 1
            self._stopping.wait(delay_s or min(0.5 * 2**retries, MAX_BACKOFF_S))

    def _record(self, batch: BatchRecord, index: int, line: dict[str, Any],
                output: dict[str, Any]) -> None:
        if self.store.record_result(batch.id, index, output, _succeeded(output)) < 0:
            log.info("batch %s: result of line %d (%s) came after the results were frozen",
                     batch.id, index, line["custom_id"])

    # Finalising.

    def _finalize(self, batch: BatchRecord, outcome: BatchStatus) -> BatchStatus:
        now = time.time()
        final = self.store.begin_finalize(batch.id, outcome, now)
        if final is None:  # failed meanwhile, or finished by another job
            current = self.store.status(batch.id)
            return current if current is not None else BatchStatus.FAILED
        results = self.store.results(batch.id)
        succeeded = [results[i] for i in sorted(results) if _succeeded(results[i])]
        failed = [results[i] for i in sorted(results) if not _succeeded(results[i])]
        output = self._output_file(batch, "output", succeeded, now)
        errors = self._output_file(batch, "errors", failed, now)
        self.store.finish(batch.id, final, output, errors, now)
        log.info("batch %s %s: %d succeeded, %d failed", batch.id, final.value, len(succeeded),
                 len(failed))
        return final

    def _output_file(self, batch: BatchRecord, kind: str, outputs: list[dict[str, Any]],
                     now: float) -> OutputFile | None:
        if not outputs:
            return None
        content = "".join(json.dumps(o, separators=(",", ":")) + "\n" for o in outputs).encode()
        record = FileRecord(id=f"file-{batch.id}-{kind}", bytes=len(content),
                            created_at=int(now), expires_at=int(now) + self.store.ttl_s,
                            filename=f"{batch.id}_{kind}.jsonl", purpose="batch_output",
                            num_lines=len(outputs))
        return OutputFile(record, content)


def line_request_id(batch_id: str, index: int) -> str:
    """The fixed id of one line's request (`id` in the output line), the same on every re-run."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{index}".encode()).hexdigest()[:24]


def _answer(line_id: str, line: dict[str, Any], response: httpx.Response) -> dict[str, Any]:
    """OpenAI's batch output line for an HTTP answer (any status but a retried one)."""
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text[:500], "type": "server_error"}}
    request_id = body.get("id") if isinstance(body, dict) else None
    return {"id": line_id, "custom_id": line["custom_id"],
            "response": {"status_code": response.status_code,
                         "request_id": request_id or response.headers.get("x-request-id", ""),
                         "body": body},
            "error": None}


def _succeeded(output: dict[str, Any]) -> bool:
    response = output.get("response")
    return output.get("error") is None and response is not None \
        and 200 <= response["status_code"] < 300


def _retry_after_s(response: httpx.Response) -> float | None:
    try:
        return min(float(response.headers["retry-after"]), MAX_BACKOFF_S)
    except (KeyError, ValueError):
        return None
