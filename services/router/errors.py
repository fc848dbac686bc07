"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, detail: str) -> ApiError:
    return ApiError(400, f"Unsupported value for parameter '{param}': {detail}", param=param,
                    code="unsupported_parameter")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="no_worker_available")


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'",
                    type="invalid_request_error", code="invalid_api_key")
