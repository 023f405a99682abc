"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the status its client maps
to an exception (400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError,
404 NotFoundError, 413, 429 RateLimitError, ...)."""

from __future__ import annotations

from dataclasses import dataclass

# status -> OpenAI's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error", 499: "request_cancelled", 500: "server_error", 502: "server_error",
               503: "server_error", 504: "timeout_error"}


@dataclass
class ApiError(Exception):
    """A request the API answers with an error: what to say, with which status, about which field."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)
