"""Errors, and how each becomes an OpenAI-shaped HTTP error.

Exception tree::

    GatewayError                  status_code, type, code, param
     ├── InvalidRequest           400 invalid_request_error
     │    └── ContextLengthExceeded   400 code=context_length_exceeded
     ├── AuthenticationFailed     401 invalid_request_error code=invalid_api_key (as OpenAI)
     ├── PermissionDenied         403 permission_error
     ├── ModelNotFound            404 invalid_request_error code=model_not_found
     ├── NotFound                 404 invalid_request_error
     ├── MethodNotAllowed         405
     ├── PayloadTooLarge          413
     ├── UnsupportedMediaType     415 (a body that is not JSON)
     ├── CatalogInvalid           422 code=catalog_invalid (a reload's catalog; never raised)
     ├── HeadersTooLarge          431
     ├── RateLimited              429 rate_limit_exceeded (Retry-After)
     ├── EngineUnavailable        503 service_unavailable
     ├── EngineFailed             500 server_error (engine raised mid-request)
     └── StoreFailed              500 server_error (the /v1/responses store could not read or write)
    ConfigError                   a setting or catalog entry is invalid (never an HTTP error)

Raise these in catalog, service and engine; ``app`` renders them in one handler.
"""

from __future__ import annotations

from typing import Any


class ConfigError(Exception):
    """A setting or catalog entry is invalid. The message is one line, naming the field."""


class GatewayError(Exception):
    status_code = 500
    error_type = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    default_code = "context_length_exceeded"


class AuthenticationFailed(GatewayError):
    status_code = 401
    error_type = "invalid_request_error"  # OpenAI's type for a missing or wrong key
    default_code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status_code = 403
    error_type = "permission_error"


class ModelNotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"

    def __init__(self, name: str, *, param: str = "model") -> None:
        shown = name if len(name) <= 80 else name[:77] + "..."
        if param == "task":
            message = f"No model serves the task '{shown}', or you do not have access to it."
        else:
            message = f"The model '{shown}' does not exist or you do not have access to it."
        super().__init__(message, param=param)


class NotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(GatewayError):
    status_code = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class RequestTimeout(GatewayError):
    status_code = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class PayloadTooLarge(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class UnsupportedMediaType(GatewayError):
    status_code = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class CatalogInvalid(GatewayError):
    """``POST /admin/adapters/reload`` read a catalog it could not use; the last good one
    serves. Not raised: the route adds its reload report (``reloaded``, ``routes``) beside
    the error, so a client's OpenAI error handling shows the message."""

    status_code = 422
    error_type = "invalid_request_error"
    default_code = "catalog_invalid"


class HeadersTooLarge(GatewayError):
    status_code = 431
    error_type = "invalid_request_error"
    default_code = "headers_too_large"


class RateLimited(GatewayError):
    status_code = 429
    error_type = "rate_limit_exceeded"
    default_code = "rate_limit_exceeded"


class EngineUnavailable(GatewayError):
    status_code = 503
    error_type = "service_unavailable"
    default_code = "engine_unavailable"


class EngineFailed(GatewayError):
    status_code = 500
    error_type = "server_error"
    default_code = "engine_error"


class StoreFailed(GatewayError):
    """The ``/v1/responses`` store could not read or write (disk full, locked, unreadable)."""

    status_code = 500
    error_type = "server_error"
    default_code = "store_error"

    def __init__(self, reason: str) -> None:
        super().__init__(f"the response store failed: {reason}")
        self.reason = reason
