"""HTTP errors of the router, each rendered in OpenAI's error shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with the status the
OpenAI API uses for the same failure, so clients (the official ``openai`` package included) map
them onto their own exception types.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

_QUOTE = reprlib.Repr()  # keyword arguments need Python 3.12
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict = 3, 8, 8
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = 80


def quote_value(value: Any) -> str:
    """A client's value quoted in an error message: its repr, cut short in length and depth
    (a plain repr of a value nested as deep as the JSON parser allows overflows the stack)."""
    return _QUOTE.repr(value)


class ApiError(Exception):
    """A request the router answers with an error; subclasses fix status and type."""

    status: int = 500
    error_type: str = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequestError(ApiError):
    """400: the body is not JSON, or a parameter is missing, mistyped or out of range."""

    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_value"


class AuthenticationError(ApiError):
    """401: the router has an API key and the request did not bring it."""

    status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class PayloadTooLargeError(ApiError):
    """413: the body is larger than the router accepts. The connection is closed after the
    answer: the rest of the body is not read."""

    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class RequestTimeoutError(ApiError):
    """408: the body did not arrive within --body-timeout-s."""

    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class ModelNotFoundError(ApiError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class RouteNotFoundError(ApiError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "unknown_url"


class MethodNotAllowedError(ApiError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class RetryLaterError(ApiError):
    """An error the client may retry after ``retry_after_s`` (the Retry-After header, whole
    seconds, at least 1)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class OverloadedError(RetryLaterError):
    """429: the mesh has no room now; the client should retry after ``retry_after_s``."""

    status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class ServiceUnavailableError(RetryLaterError):
    """503: a part of the mesh the request needs is missing (no registry, no decode worker)."""

    status = 503
    error_type = "server_error"
    default_code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class MeshError(ApiError):
    """502: a mesh peer answered with garbage or failed the request."""

    status = 502
    error_type = "server_error"
    default_code = "mesh_error"


class GatewayTimeoutError(ApiError):
    """504: a mesh peer did not answer within the configured timeout."""

    status = 504
    error_type = "server_error"
    default_code = "timeout"


class InternalError(ApiError):
    status = 500
    error_type = "server_error"
    default_code = "internal_error"


class ClientGoneError(ConnectionError):
    """The client of a stream went away, or was cut off for not reading (``cutoff`` says which
    limit it passed; client_stream.py): nothing more can reach it, and its request is aborted
    on the mesh with ``reason``."""

    def __init__(self, message: str, *, cutoff: str = "") -> None:
        super().__init__(message)
        self.cutoff = cutoff
        self.reason = "client too slow" if cutoff else "client disconnected"
