"""The errors `stepgraph serve` answers with, each a ``StepGraphError`` with its HTTP status,
and ``error_body``: OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from ..errors import ConfigError, StepGraphError


class ApiError(StepGraphError):
    """An error the server answers with: HTTP ``status`` and OpenAI's error object."""

    status, type, code = 500, "server_error", "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class RequestError(ApiError, ConfigError):
    """A request that cannot be served as sent (400); ``param`` names the field."""

    status, type, code = 400, "invalid_request_error", "invalid_value"


class ModelNotFound(RequestError):
    status, code = 404, "model_not_found"


class Unauthorized(ApiError):
    """A ``/v1/`` request without the server's API key (401)."""

    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class ServerBusy(ApiError):
    """More requests wait than ``--max-waiting`` allows (503 with ``Retry-After``)."""

    status, code = 503, "server_overloaded"
    retry_after_s = 1


class EngineFault(ApiError):
    """The engine step failed while this request was in flight (500); the server stays up."""

    code = "engine_fault"


def error_body(err: ApiError) -> dict:
    message = " ".join(str(err).split()) or type(err).__name__
    return {"error": {"message": message, "type": err.type, "param": err.param, "code": err.code}}


__all__ = [
    "ApiError",
    "EngineFault",
    "ModelNotFound",
    "RequestError",
    "ServerBusy",
    "Unauthorized",
    "error_body",
]
