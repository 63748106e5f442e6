"""The batch API's records in Redis: OpenAI's file object (`Keys.file`, its bytes under
`Keys.file_content`) and batch object (`Keys.batch`, each line's result under
`Keys.batch_results`), with the batch's status machine. The gateway writes and reads them, the
batch jobs (batch/) drive them; the scripts that change them are in batch_scripts.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar


class BatchStatus(str, Enum):
    """OpenAI's batch statuses, stored in Redis as their string value."""

    VALIDATING = "validating"  # created, its job not started yet
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"  # results frozen, output files being written
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"  # the completion window passed first
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED,
                        BatchStatus.CANCELLED)

    @property
    def timestamp_field(self) -> str:
        """The batch hash field of when the batch entered this status (`in_progress_at`)."""
        return f"{self.value}_at"


# OpenAI's batch object has one timestamp per status a batch can enter after creation.
TIMESTAMP_FIELDS = tuple(status.timestamp_field for status in BatchStatus
                         if status is not BatchStatus.VALIDATING)


@dataclass
class FileRecord:
    """OpenAI's file object, plus what validation learnt about a batch input file. Stored as
    JSON in the one field RECORD of the file hash."""

    RECORD: ClassVar[str] = "record"

    id: str
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str  # batch (uploaded) | batch_output (written by a batch job)
    num_lines: int = 0
    urls: list[str] = field(default_factory=list)  # endpoints the lines call

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "expires_at": self.expires_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None}

    def encode(self) -> dict[str, str]:
        return {self.RECORD: json.dumps(self.__dict__)}

    @classmethod
    def decode(cls, data: dict[bytes, bytes]) -> FileRecord:
        return cls(**json.loads(data[cls.RECORD.encode()]))


@dataclass
class BatchRecord:
    """OpenAI's batch object: the fixed part written at creation (JSON in RECORD), the rest one
    hash field each, changed as the job goes (counters by the RECORD_RESULT script, the status
    by TRANSITION and BEGIN_FINALIZE)."""

    RECORD: ClassVar[str] = "record"
    STATUS: ClassVar[str] = "status"
    FINAL_STATUS: ClassVar[str] = "final_status"  # what `finalizing` will end in
    COMPLETED: ClassVar[str] = "completed"  # lines that succeeded
    FAILED: ClassVar[str] = "failed"  # lines that failed
    ATTEMPTS: ClassVar[str] = "attempts"  # job runs so far
    JOB_ID: ClassVar[str] = "job_id"  # the rq job enqueued last
    ERRORS: ClassVar[str] = "errors"  # JSON list of OpenAI error objects
    OUTPUT_FILE_ID: ClassVar[str] = "output_file_id"
    ERROR_FILE_ID: ClassVar[str] = "error_file_id"

    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    total: int
    metadata: dict[str, str] | None = None
    status: BatchStatus = BatchStatus.VALIDATING
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    timestamps: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    job_id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        errors = {"object": "list", "data": self.errors} if self.errors else None
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": errors,
                "input_file_id": self.input_file_id,
                "completion_window": self.completion_window, "status": self.status.value,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at,
                **{name: self.timestamps.get(name) for name in TIMESTAMP_FIELDS},
                "request_counts": {"total": self.total, "completed": self.completed,
                                   "failed": self.failed},
                "metadata": self.metadata}

    def encode(self) -> dict[str, str]:
        """The hash of a new batch."""
        fixed = {"id": self.id, "input_file_id": self.input_file_id, "endpoint": self.endpoint,
                 "completion_window": self.completion_window, "created_at": self.created_at,
                 "expires_at": self.expires_at, "total": self.total, "metadata": self.metadata}
        return {self.RECORD: json.dumps(fixed), self.STATUS: self.status.value,
                self.COMPLETED: "0", self.FAILED: "0", self.ATTEMPTS: "0"}

    @classmethod
    def decode(cls, data: dict[bytes, bytes]) -> BatchRecord:
        text = {k.decode(): v.decode() for k, v in data.items()}
        record = cls(**json.loads(text[cls.RECORD]))
        record.status = BatchStatus(text[cls.STATUS])
        record.completed = int(text.get(cls.COMPLETED, 0))
        record.failed = int(text.get(cls.FAILED, 0))
        record.attempts = int(text.get(cls.ATTEMPTS, 0))
        record.output_file_id = text.get(cls.OUTPUT_FILE_ID) or None
        record.error_file_id = text.get(cls.ERROR_FILE_ID) or None
        record.errors = json.loads(text[cls.ERRORS]) if text.get(cls.ERRORS) else None
        record.job_id = text.get(cls.JOB_ID) or None
        record.timestamps = {name: int(float(text[name])) for name in TIMESTAMP_FIELDS
                             if name in text}
        return record
