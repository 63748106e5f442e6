"""OpenAI's Files and Batch API on the gateway: upload a JSONL of requests, create a batch that an
rq job runs through the fleet at batch priority, poll it, cancel it, download the results.

Routes are plain `def`: the store and rq are synchronous Redis clients, so FastAPI runs the
handlers in its thread pool and the event loop never waits on them.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import RedisError
from rq import Queue

from kvfleet.batch.jobs import enqueue_batch, window_seconds
from kvfleet.batch.store import BatchStore
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.http.errors import APIError, bad_request
from kvfleet.gateway.openai.request_schemas import ChatCompletionRequest, CompletionRequest
from kvfleet.shared.settings import BatchApiSettings
from kvfleet.shared.wire import BatchRecord, BatchStatus, FileRecord

BODY_SCHEMAS = {"/v1/chat/completions": ChatCompletionRequest,
                "/v1/completions": CompletionRequest}
ENDPOINTS = tuple(BODY_SCHEMAS)  # what a batch line may call
UPLOAD_PURPOSES = ("batch",)


class CreateBatchRequest(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)


class BatchFileError(Exception):
    """A batch file line that cannot be run; `line` counts from 1, as editors do."""

    def __init__(self, line: int, message: str):
        super().__init__(f"Line {line}: {message}")
        self.line = line


def validate_batch_file(content: bytes, max_lines: int) -> tuple[int, list[str]]:
    """(number of requests, endpoints they call); raises BatchFileError on the first bad line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchFileError(text_line(content, exc.start), "not valid UTF-8.") from None
    seen: dict[str, int] = {}
    urls: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(seen) >= max_lines:
            raise BatchFileError(number, f"a batch file holds at most {max_lines} requests.")
        line = _check_line(number, raw)
        if line["custom_id"] in seen:
            raise BatchFileError(number, f"custom_id `{line['custom_id']}` is also on line "
                                 f"{seen[line['custom_id']]}; each must be unique.")
        seen[line["custom_id"]] = number
        urls.add(line["url"])
    if not seen:
        raise BatchFileError(1, "the file holds no requests.")
    return len(seen), sorted(urls)


def text_line(content: bytes, offset: int) -> int:
    return content[:offset].count(b"\n") + 1


def _check_line(number: int, raw: str) -> dict[str, Any]:
    try:
        line = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BatchFileError(number, f"not valid JSON ({exc.msg}).") from None
    if not isinstance(line, dict):
        raise BatchFileError(number, "expected a JSON object.")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchFileError(number, "`custom_id` must be a non-empty string.")
    if line.get("method") != "POST":
        raise BatchFileError(number, "`method` must be \"POST\".")
    if line.get("url") not in BODY_SCHEMAS:
        raise BatchFileError(number, f"`url` must be one of {', '.join(ENDPOINTS)}.")
    body = line.get("body")
    if not isinstance(body, dict):
        raise BatchFileError(number, "`body` must be a JSON object.")
    try:
        BODY_SCHEMAS[line["url"]].model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise BatchFileError(number, f"invalid `body.{where}`: {message}.") from None
    return line


def file_not_found(file_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param=param, code="file_not_found")


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", code="batch_not_found")


class BatchService:
    """What the routes do; Redis errors become 503s."""

    def __init__(self, store: BatchStore, queue: Queue, settings: BatchApiSettings):
        self.store = store
        self.queue = queue
        self.settings = settings

    def upload(self, upload: UploadFile, purpose: str) -> dict[str, Any]:
        if purpose not in UPLOAD_PURPOSES:
            raise bad_request(f"Invalid purpose `{purpose}`: this server accepts "
                              f"{', '.join(UPLOAD_PURPOSES)}.", param="purpose")
        content = upload.file.read(self.settings.batch_max_file_bytes + 1)
        if len(content) > self.settings.batch_max_file_bytes:
            raise APIError(413, f"The file is larger than the limit of "
                           f"{self.settings.batch_max_file_bytes} bytes.", param="file",
                           code="file_too_large")
        try:
            num_lines, urls = validate_batch_file(content, self.settings.batch_max_lines)
        except BatchFileError as exc:
            raise bad_request(str(exc), param="file", code="invalid_batch_file") from None
        now = int(time.time())
        record = FileRecord(id=f"file-{uuid.uuid4().hex[:24]}", bytes=len(content),
                            created_at=now, expires_at=now + self.store.ttl_s,
                            filename=upload.filename or "batch.jsonl", purpose=purpose,
                            num_lines=num_lines, urls=urls)
        self.store.save_file(record, content)
        return record.to_openai()

    def get_file(self, file_id: str) -> FileRecord:
        record = self.store.get_file(file_id)
        if record is None:
            raise file_not_found(file_id)
        return record

    def file_content(self, file_id: str) -> bytes:
        content = self.store.file_content(file_id)
        if content is None:
            raise file_not_found(file_id)
        return content

    def delete_file(self, file_id: str) -> dict[str, Any]:
        if not self.store.delete_file(file_id):
            raise file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def create_batch(self, request: CreateBatchRequest) -> dict[str, Any]:
        if request.endpoint not in ENDPOINTS:
            raise bad_request(f"Invalid endpoint `{request.endpoint}`: use one of "
                              f"{', '.join(ENDPOINTS)}.", param="endpoint")
        try:
            window_s = window_seconds(request.completion_window)
        except ValueError as exc:
            raise bad_request(str(exc), param="completion_window") from None
        source = self.store.get_file(request.input_file_id)
        if source is None:
            raise file_not_found(request.input_file_id, param="input_file_id")
        if source.purpose != "batch":
            raise bad_request(f"File {source.id} has purpose `{source.purpose}`; a batch needs "
                              "a file uploaded with purpose `batch`.", param="input_file_id")
        if source.urls != [request.endpoint]:
            raise bad_request(f"File {source.id} has requests for {', '.join(source.urls)}; the "
                              f"batch endpoint is {request.endpoint}.", param="endpoint")
        now = int(time.time())
        batch = BatchRecord(id=f"batch_{uuid.uuid4().hex[:24]}", input_file_id=source.id,
                            endpoint=request.endpoint,
                            completion_window=request.completion_window, created_at=now,
                            expires_at=now + window_s, total=source.num_lines,
                            metadata=request.metadata)
        self.store.create_batch(batch)
        enqueue_batch(self.queue, self.store, batch)
        return self.get_batch(batch.id)

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        batch = self.store.get_batch(batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        return batch.to_openai()

    def list_batches(self, limit: int, after: str | None) -> dict[str, Any]:
        records, has_more = self.store.list_batches(limit, after)
        data = [record.to_openai() for record in records]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        batch = self.store.get_batch(batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        cancellable = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
        if not self.store.transition(batch_id, BatchStatus.CANCELLING, cancellable, time.time()):
            status = self.store.status(batch_id)
            if status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
                raise bad_request(f"Batch {batch_id} is {status.value if status else 'gone'} "
                                  "and can no longer be cancelled.", code="batch_not_cancellable")
        return self.get_batch(batch_id)


class LazyBatchService:
    """The service, built at the first request (the app may be created before Redis is up), on the
    gateway's Redis context; without one (an app built without Redis) every route is a 503."""

    def __init__(self, redis: RedisContext | None, settings: BatchApiSettings):
        self._redis = redis
        self._settings = settings
        self._service: BatchService | None = None
        self._lock = threading.Lock()  # the routes run in FastAPI's thread pool

    def get(self) -> BatchService:
        if self._redis is None:
            raise APIError(503, "The batch API needs Redis (--redis-url).",
                           error_type="service_unavailable")
        with self._lock:
            if self._service is None:
                client, keys = self._redis.sync(), self._redis.keys
                self._service = BatchService(
                    BatchStore(client, keys, self._settings.batch_ttl_s),
                    Queue(keys.batch_queue(), connection=self._redis.batch_queue()),
                    self._settings)
            return self._service


@contextmanager
def redis_errors_as_503() -> Iterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise APIError(503, f"Redis does not answer: {exc!r}",
                       error_type="service_unavailable") from exc


def batch_router(redis: RedisContext | None, settings: BatchApiSettings) -> APIRouter:
    """The Files and Batch routes, on the gateway's Redis context with the gateway's limits."""
    services = LazyBatchService(redis, settings)
    router = APIRouter()

    @router.post("/v1/files")
    def upload_file(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
                    ) -> dict[str, Any]:
        with redis_errors_as_503():
            return services.get().upload(file, purpose)

    @router.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str) -> dict[str, Any]:
        with redis_errors_as_503():
            return services.get().get_file(file_id).to_openai()

    @router.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> Response:
        with redis_errors_as_503():
            content = services.get().file_content(file_id)
        return Response(content, media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict[str, Any]:
        with redis_errors_as_503():
            return services.get().delete_file(file_id)

    @router.post("/v1/batches")
    def create_batch(body: CreateBatchRequest) -> dict[str, Any]:
        with redis_errors_as_503():
            return services.get().create_batch(body)

    @router.get("/v1/batches")
    def list_batches(limit: Annotated[int, Query(ge=1, le=100)] = 20,
                     after: str | None = None) -> dict[str, Any]:
        with redis_errors_as_503():
            return services.get().list_batches(limit, after)

    @router.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str) -> dict[str, Any]:
        with redis_errors_as_503():
            return services.get().get_batch(batch_id)

    @router.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        with redis_errors_as_503():
            return services.get().cancel_batch(batch_id)

    return router
