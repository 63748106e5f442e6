"""Errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, and the exception
handlers that make every failure one of them (a bad input is a 4xx, never a 500)."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfleet.gateway.fleet.client import EngineError

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 429: "rate_limit_error"}


_LOCATIONS = {"body", "query", "path", "header"}  # where FastAPI found a value: not in the name


class APIError(Exception):
    """An error the client gets as it is: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


MAX_RETRY_AFTER_S = 3600


class TooManyRequests(APIError):
    """429 with a Retry-After header (whole seconds, at least 1)."""

    def __init__(self, message: str, retry_after_s: float, code: str):
        super().__init__(429, message, code=code)
        self.retry_after_s = min(max(math.ceil(retry_after_s), 1), MAX_RETRY_AFTER_S)

    def response(self):
        response = super().response()
        response.headers["Retry-After"] = str(self.retry_after_s)
        return response


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


def from_engine_error(exc: EngineError) -> APIError:
    return APIError(exc.status, exc.message, error_type=exc.error_type)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error, naming the parameter (`messages.0.role`, `temperature`)."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "malformed JSON")
        return bad_request(f"The request body is not valid JSON: {reason}.", code="invalid_json")
    param = _field_path(first, up_to_union=True)
    if param is None:
        return bad_request(f"Invalid request body: {_message(first)}.")
    # A union reports one error per member: the deepest one says most (`...content.0.type`).
    same_field = [e for e in errors if _field_path(e, up_to_union=True) == param]
    deepest = max(same_field, key=lambda e: len(e.get("loc", ())))
    where = _field_path(deepest, up_to_union=False)
    detail = f" (at `{where}`)" if where and where != param else ""
    return bad_request(f"Invalid value for `{param}`: {_message(deepest)}{detail}.", param=param)


def _field_path(error: dict, up_to_union: bool) -> str | None:
    """`messages.0.role` from pydantic's loc; union member names (`str`, `list[int]`) dropped,
    or the path cut at the first of them."""
    parts = []
    for part in (str(p) for p in error.get("loc", ()) if p not in _LOCATIONS):
        if _is_type_tag(part):
            if up_to_union:
                break
            continue
        parts.append(part)
    return ".".join(parts) or None


def _message(error: dict) -> str:
    return str(error.get("msg", "invalid value")).removeprefix("Value error, ")


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(EngineError)
    async def _engine_error(_request: Request, exc: EngineError) -> JSONResponse:
        return from_engine_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        error = APIError(status, str(exc.detail), error_type=_TYPE_BY_STATUS.get(status))
        return JSONResponse(error.body(), status_code=status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body(f"Internal error: {exc!r}", "server_error"), status_code=500)
