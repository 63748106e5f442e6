"""Settings of the batch API and of `kvfleet batch-worker`: defaults, overridden by KVFLEET_*
environment variables, overridden by command-line flags (as for shared/settings.py)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import CommonSettings

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # what a batch line may call


class BatchSettings(CommonSettings):
    gateway_url: str = "http://127.0.0.1:8000"  # where batch jobs send their lines
    batch_api_key: str = ""  # sent as `Authorization: Bearer` when the gateway requires keys
    batch_max_in_flight: int = Field(32, ge=1)  # lines of one batch being generated at once
    batch_max_file_bytes: int = Field(100 * 1024**2, ge=1)  # an upload larger than this is a 413
    batch_max_lines: int = Field(50_000, ge=1)  # OpenAI's limit per batch file
    batch_ttl_s: int = Field(7 * 24 * 3600, ge=60)  # files and batch records expire after this
    batch_line_retries: int = Field(5, ge=0)  # 5xx / connection errors before a line fails
    batch_request_timeout_s: float = Field(600.0, gt=0)  # one line's HTTP request
    batch_lease_ttl_s: float = Field(10.0, gt=0)  # a job silent this long has died
    batch_poll_s: float = Field(0.5, gt=0)  # how often a job checks for cancel / lost lease
    batch_max_attempts: int = Field(5, ge=1)  # job runs of one batch before it fails
