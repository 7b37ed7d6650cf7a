"""OpenAI models of structured output and tool calls: `response_format`, function tools
and `tool_choice`, past calls in a chat's history, and the calls of a reply (whole, or as
stream deltas). `cluster/protocol.py` puts them into its requests and responses.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="allow", strict=True)


JsonObject = dict[str, Any]
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: JsonObject | bool = Field(alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    """Output valid under `json_schema.schema`; enforced whether or not `strict` is set."""

    model_config = _STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


def schema_text(schema: JsonObject | bool | str) -> str:
    """A schema as the JSON text the engine keys its grammars by (key order kept: it is the
    order of the output's keys)."""
    if isinstance(schema, str):
        return schema
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class FunctionCallParam(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCallParam(BaseModel):
    """A call an assistant turn made, replayed in the history."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class FunctionParam(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ToolParam(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionParam


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    """Call exactly this function."""

    model_config = _STRICT
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def template_call(call: ToolCallParam) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def is_none(value: Any) -> bool:
    return value is None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A tool call in a stream: `index` orders the calls of a choice; kvray sends each call
    whole, in one delta."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
