"""The router's API as an OpenAPI 3 document, served at `/openapi.json` (and used to fuzz it).

It describes what the router accepts, the subset of OpenAI's API it serves; anything else in a
request is refused with a 400 that names it, which the document states as the error response."""
from __future__ import annotations

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}},
}

SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0.01, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "stop": {"oneOf": [{"type": "string", "maxLength": 16},
                       {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "ignore_eos": {"type": "boolean"},
}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": "OpenAI-shaped error", "content": {"application/json": {"schema": ERROR}}}
            for s in statuses}


def _post(summary: str, body: dict) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {"description": "the completion (JSON, or server-sent events with `stream`)"},
                      **_errors(400, 401, 413, 429, 503)},
    }}


def document(model_name: str, max_body_bytes: int) -> dict:
    model = {"type": "string", "enum": [model_name]}
    completion = {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": model,
        "prompt": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 200},
                             {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                              "minItems": 1, "maxItems": 64}]},
        **SAMPLING}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
        "content": {"type": "string", "maxLength": 200}}}
    chat = {"type": "object", "required": ["model", "messages"], "properties": {
        "model": model,
        "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": 4},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
        **SAMPLING}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "PrfaaS router", "version": "1",
                 "description": f"OpenAI-compatible subset; bodies over {max_body_bytes} bytes are answered 413."},
        "paths": {
            "/v1/models": {"get": {"summary": "the served model", "responses": {
                "200": {"description": "model list"}, **_errors(401)}}},
            "/v1/completions": _post("text completion", completion),
            "/v1/chat/completions": _post("chat completion", chat),
            "/health": {"get": {"summary": "workers' health", "responses": {
                "200": {"description": "serving"}, "503": {"description": "no healthy worker"}}}},
        },
    }
