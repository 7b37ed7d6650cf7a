"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cluster.dispatch import CallError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}

# CallError.kind -> HTTP status
CALL_STATUS = {"full": 429, "invalid": 400, "internal": 500, "unavailable": 503}


class ApiError(Exception):
    """Raised anywhere in a request; the ingress turns it into the error body and status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def error_type(status: int) -> str:
    """OpenAI's error `type` of a status: any other 4xx is the client's invalid request."""
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


def from_validation(exc: ValidationError) -> ApiError:
    """The first validation problem, naming its field (`messages.0.role`).

    Of the problems of the first field, the deepest wins: for a union (`content` is a
    string or a list of parts) that is the member the input came closest to matching.
    """
    errors = exc.errors()
    field = errors[0].get("loc", ())[:1]
    first = max(
        (e for e in errors if e.get("loc", ())[:1] == field), key=lambda e: len(e.get("loc", ()))
    )
    loc = [str(p) for i, p in enumerate(first.get("loc", ())) if not _is_type_tag(p, i)]
    if first.get("type") in ("union_tag_not_found", "union_tag_invalid"):
        loc.append(str(first.get("ctx", {}).get("discriminator", "")).strip("'"))
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return ApiError(
            400, f"request body is not valid JSON: {first.get('msg')}", code="invalid_json"
        )
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return ApiError(400, message, param=param, code="invalid_value")


def _is_type_tag(part: str | int, position: int) -> bool:
    """Union members in an error's location (`prompt.list[int].2`, a message's role in
    `messages.0.user.content`, a response format's type in `response_format.json_schema.
    json_schema`) are no part of the field."""
    if isinstance(part, int):
        return False
    if position == 2 and part in _MESSAGE_ROLES:
        return True
    if position == 1 and part in _FORMAT_TAGS:  # response_format's `type`
        return True
    # a model's class name (`tool_choice.NamedToolChoice.function`): fields are lower case
    return part in _TYPE_TAGS or "[" in part or "(" in part or part[:1].isupper()


_TYPE_TAGS = frozenset({"body", "str", "int", "float", "bool", "list", "dict", "none"})
_MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_FORMAT_TAGS = frozenset({"text", "json_object", "json_schema"})


def from_call(error: CallError, retry_after: int) -> ApiError:
    status = CALL_STATUS[error.kind]
    retry = retry_after if status in (429, 503) else None
    return ApiError(status, error.message, code=error.kind, retry_after=retry)
