"""OpenAI models of structured output and tool calls: `response_format` (and vLLM's
`structured_outputs`), function tools and `tool_choice`, past calls in a chat's history, and
the calls of a reply (whole, or as stream deltas). `cluster/protocol.py` puts them into its
requests and responses.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(extra="allow", strict=True)


JsonObject = dict[str, Any]
Choice = Annotated[str, Field(min_length=1)]  # one string a choice-constrained output may be
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


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its `guided_*` fields since v0.12): one of `json` (a
    schema or its text), `regex`, `choice`, `grammar` or `json_object: true`. Its hints
    (`whitespace_pattern`, `disable_*`) are ignored; `structural_tag` is refused."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    json_: JsonObject | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[Choice] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        if (self.model_extra or {}).get("structural_tag") is not None:
            raise ValueError("structural_tag is not supported by this server")
        if len(self.kinds()) > 1:
            raise ValueError(f"set one of {', '.join(_KINDS)}, not {list(self.kinds())}")
        return self

    def kinds(self) -> dict[str, Any]:
        """The kinds set (at most one once validated), each with its value."""
        values = (self.json_, self.regex, self.choice, self.grammar, self.json_object)
        return {k: v for k, v in zip(_KINDS, values, strict=True) if v not in (None, False)}


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


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
