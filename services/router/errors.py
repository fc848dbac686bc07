"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class ApiError(Exception):
    """Not frozen: Python sets ``__traceback__`` on exceptions it re-raises (``contextlib`` does)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, detail: str) -> ApiError:
    return ApiError(400, f"Unsupported value for parameter '{param}': {detail}", param=param,
                    code="unsupported_parameter")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def unavailable(message: str, retry_after_s: int | None = None) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="no_worker_available",
                    retry_after_s=retry_after_s)


def overloaded(message: str, code: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code=code, retry_after_s=retry_after_s)


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'",
                    type="invalid_request_error", code="invalid_api_key")
