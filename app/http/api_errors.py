"""Errors of the `/v1/` API in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`
with a 4xx (`param`: the offending field, or null).

Stock OpenAI clients read `error.message`, raise by status (400 `BadRequestError`, 401
`AuthenticationError`, 404 `NotFoundError`, 409 `ConflictError`, 413, 429 `RateLimitError`) and
retry 409, 429 and 5xx on their own, honouring `Retry-After`.

    status  type                    code                                   raised by
    400     invalid_request_error   invalid_request                        bad JSON, wrong types, `InvalidInput`
    400     invalid_request_error   unsupported_parameter                  n != 1, tools, images, ...
    400     invalid_request_error   unrecognized_request_argument          a body field the route does not know
                                                                           (OpenAI's "Unrecognized request
                                                                           argument supplied: foo")
    404     invalid_request_error   unknown_url                            no route has the path (an API path sent
                                                                           without `/v1`: the message names it
                                                                           under `/v1`)
    405     invalid_request_error   method_not_allowed                     the path's routes take other methods
                                                                           (`Allow` names them)
    401     invalid_request_error   invalid_api_key                        missing or wrong bearer key
    404     invalid_request_error   model_not_found / session_not_found    `model`, `SessionNotFound`
    404     invalid_request_error   response_not_found                     `ResponseNotFound` (Responses API)
    404     invalid_request_error   conversation_not_found / item_not_found  `ConversationNotFound`, an item id
    409     invalid_request_error   session_busy                           `SessionBusy`
    409     invalid_request_error   session_owned_elsewhere                `SessionOwnedElsewhere` (replicas;
                                                                           `X-ChatKV-Owner-URL` names the owner;
                                                                           `Retry-After`)
    400     invalid_request_error   idempotency_key_reused                 an `Idempotency-Key` sent with another
                                                                           request before
    400     invalid_request_error   array_above_max_length                 over 2,048 `messages`
    400     invalid_request_error   conversation_too_large                 `ConversationTooLarge`: items past a
                                                                           conversation's caps (10,000 items,
                                                                           16 MiB)
    409     invalid_request_error   idempotency_key_in_use                 the first request with the key still
                                                                           runs (`Retry-After`)
    413     invalid_request_error   request_too_large                      body over the `/v1/` limit
    413     invalid_request_error   context_length_exceeded                `ContextTooLong`, `HistoryTooLong`
    429     rate_limit_error        rate_limit_exceeded                    the tenant's concurrent requests
    503     server_error            replica_retired                        `ReplicaRetired` (this process was
                                                                           replaced under its replica id)
    503     server_error            database_unavailable                   the database cannot be reached
                                                                           (`Retry-After`; nothing stored)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException

from sessions import (
    ChatKVError,
    ContextTooLong,
    ConversationNotFound,
    ConversationTooLarge,
    HistoryTooLong,
    ReplicaRetired,
    ResponseNotFound,
    SessionBusy,
    SessionNotFound,
    SessionOwnedElsewhere,
)

log = logging.getLogger(__name__)

DATABASE_ERRORS = (OperationalError, InterfaceError)
"""SQLAlchemy's errors for a database that cannot be reached or dropped the connection (an outage,
not a bug): answered 503 with `Retry-After`. The turn they interrupt stores nothing."""

DATABASE_RETRY_AFTER_S = 5

UNAUTHORIZED_MESSAGE = "missing or wrong API key: send Authorization: Bearer <your tenant's API key>"

OWNER_URL_HEADER = "X-ChatKV-Owner-URL"
OWNED_ELSEWHERE_RETRY_AFTER_S = 1

_CODES: dict[type[ChatKVError], str] = {
    SessionNotFound: "session_not_found",
    ResponseNotFound: "response_not_found",
    ConversationNotFound: "conversation_not_found",
    ConversationTooLarge: "conversation_too_large",
    SessionOwnedElsewhere: "session_owned_elsewhere",
    SessionBusy: "session_busy",
    ContextTooLong: "context_length_exceeded",
    HistoryTooLong: "context_length_exceeded",
    ReplicaRetired: "replica_retired",
}


class ApiError(Exception):
    """An error the `/v1/` routes answer as it is (an OpenAI-specific refusal, say)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.headers = headers


def unsupported(what: str, param: str) -> ApiError:
    return ApiError(400, f"{what} not supported by chatkv", "unsupported_parameter", param=param)


def error_response(
    status: int, message: str, code: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param=param), status_code=status, headers=headers)


def error_body(status: int, message: str, code: str, *, param: str | None = None) -> dict[str, Any]:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def unknown_url(method: str, path: str, api_path: str | None = None) -> JSONResponse:
    """404 for a path no route has (OpenAI's `unknown_url`); `api_path`: the route under `/v1`
    that the path names without its prefix, pointed at in the message."""
    if api_path is not None:
        message = f"Unknown request URL: {method} {path}. The API is under /v1: {method} {api_path}."
        return error_response(404, message, "unknown_url")
    message = f"Unknown request URL: {method} {path}. Please check the URL for typos; the routes are listed at "
    return error_response(404, message + "/openapi.json.", "unknown_url")


def method_not_allowed(method: str, path: str, allowed: list[str]) -> JSONResponse:
    """405 for a `/v1/` path whose routes take other methods, named in `Allow`."""
    return error_response(
        405,
        f"Invalid method for URL ({method} {path}): it takes {', '.join(allowed)}",
        "method_not_allowed",
        headers={"Allow": ", ".join(allowed)},
    )


def unauthorized() -> JSONResponse:
    return error_response(401, UNAUTHORIZED_MESSAGE, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def response_for(exc: Exception) -> JSONResponse:
    """The answer to an error a route raised: ours, a domain error, or FastAPI's parsing errors.

    Raises:
        TypeError: for any other exception (a bug: the caller lets it through).
    """
    if isinstance(exc, ApiError):
        return error_response(exc.status, str(exc), exc.code, param=exc.param, headers=exc.headers)
    if isinstance(exc, SessionOwnedElsewhere):
        # The owner is running turns on it; it hands the session over between them.
        headers = {"Retry-After": str(OWNED_ELSEWHERE_RETRY_AFTER_S)}
        if exc.owner_url:
            headers[OWNER_URL_HEADER] = exc.owner_url
        return error_response(exc.http_status, str(exc), _code(exc), headers=headers)
    if isinstance(exc, ChatKVError):
        return error_response(exc.http_status, str(exc), _code(exc))
    if isinstance(exc, RequestValidationError):
        unknown = unrecognized_fields(exc)
        if unknown:
            noun = "argument" if len(unknown) == 1 else "arguments"
            message = f"Unrecognized request {noun} supplied: {', '.join(unknown)}"
            return error_response(400, message, "unrecognized_request_argument", param=unknown[0])
        message, param = validation_message(exc)
        return error_response(400, message, "invalid_request", param=param)
    if isinstance(exc, DATABASE_ERRORS):
        return error_response(
            503,
            database_outage(exc),
            "database_unavailable",
            headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        )
    if isinstance(exc, HTTPException):  # a body that is not UTF-8 JSON, or over the size limit
        code = "request_too_large" if exc.status_code == 413 else "invalid_request"
        return error_response(exc.status_code, str(exc.detail), code, headers=exc.headers)
    raise TypeError(f"not an API error: {type(exc).__name__}")


def database_outage(exc: OperationalError | InterfaceError) -> str:
    """Log a request's database error in one line; the message to answer it with (a 503)."""
    log.warning("the database is unavailable: %s", str(exc.orig or exc).splitlines()[0])
    return "the database is unavailable; retry shortly"


def _code(exc: ChatKVError) -> str:
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            return code
    return "invalid_request" if exc.http_status < 500 else "server_error"


def unrecognized_fields(exc: RequestValidationError) -> list[str]:
    """The body fields a route's model does not declare (`extra="forbid"`), as dotted paths."""
    return [
        ".".join(str(p) for p in error.get("loc", ()) if not _is_location_noise(p))
        for error in exc.errors()
        if error.get("type") == "extra_forbidden"
    ]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line for pydantic's errors (`messages.0.content: Input should be a valid string`), and
    the first offending parameter. The errors of a union's alternatives share one line."""
    problems: dict[str, list[str]] = {}
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if not _is_location_noise(p))
        message = str(error.get("msg", "invalid"))
        if error.get("type") == "json_invalid":
            where, message = "", f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})"
        elif not where and error.get("type") == "missing":  # the whole body: its location is all noise
            message = "the request needs a JSON body"
        problems.setdefault(where, [])
        if message not in problems[where]:
            problems[where].append(message)
    parts = [
        f"{where}: {' or '.join(messages)}" if where else " or ".join(messages) for where, messages in problems.items()
    ]
    return "; ".join(parts) or "invalid request", next((where for where in problems if where), None)


def _is_location_noise(part: object) -> bool:
    """Where FastAPI found a value (`body`), and the alternative of a union pydantic tried (`str`)."""
    text = str(part)
    return text in ("query", "body", "path", "header", "str", "int", "float", "bool", "none") or "[" in text
