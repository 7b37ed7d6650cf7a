"""OpenAI's Responses API (`POST /v1/responses`) over the chat route's pipeline.

A request becomes a chat request: `instructions` the system message, `input` the messages
(a text, or message, `function_call` and `function_call_output` items), function tools and
`text.format` chat's `tools` and `response_format`. So it is validated, limited, templated,
constrained and generated as chat is, and a bad field is a 400 naming the Responses field.
The answer is shaped as a Response: a `message` item with the text, then a `function_call`
item per call the model made; streamed, as the typed events OpenAI sends (`response.created`,
each item added, its text or arguments as deltas, done, then `response.completed`, or
`response.incomplete` when `max_output_tokens` cut it short).

kvray keeps no responses: `store` is taken and ignored, and what needs a stored response
or conversation (`previous_response_id`, `conversation`, `background`) is refused, as are
tools other than functions and inputs other than text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cluster.errors import ApiError, from_validation
from cluster.formats import (
    NAME_PATTERN,
    JsonObject,
    JsonObjectFormat,
    JsonSchemaFormat,
    TextFormat,
)
from cluster.generation import ChoiceDelta
from cluster.protocol import ChatCompletionRequest, PositiveInt, Usage, text_only
from cluster.reasoning import ReasoningParser, ReasoningParserName
from cluster.tools import CallParser, ParsedCall

_STRICT = ConfigDict(extra="allow", strict=True)


class InputText(BaseModel):
    model_config = _STRICT
    # an assistant turn replayed holds output_text
    type: Annotated[Literal["input_text", "output_text"], text_only("input_text", "output_text")]
    text: str


class InputMessage(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class FunctionCallItem(BaseModel):
    """A call the model made earlier, replayed."""

    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """What the caller's function returned for `call_id`."""

    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(BaseModel):
    """Earlier thinking replayed with the output it came with: left out of the prompt, as
    chat templates leave past thinking out."""

    model_config = _STRICT
    type: Literal["reasoning"]


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


class FunctionTool(BaseModel):
    """A function tool as this API writes it: flat, where chat nests it under `function`
    (`type` first, so a tool of another kind is named by its type)."""

    model_config = _STRICT
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormatJsonSchema(JsonSchemaFormat):
    """A JSON schema format as this API writes it: flat, where chat nests it."""

    type: Literal["json_schema"]


class TextConfig(BaseModel):
    model_config = _STRICT
    format: Annotated[
        TextFormat | JsonObjectFormat | TextFormatJsonSchema, Field(discriminator="type")
    ] = TextFormat(type="text")


class ResponsesRequest(BaseModel):
    model_config = _STRICT
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # taken; kvray keeps no responses
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _typed_items(cls, value: Any) -> Any:
        """An item without `type` is a message (`{"role": "user", "content": "..."}`)."""
        if isinstance(value, list):
            return [
                {**item, "type": "message"}
                if isinstance(item, dict) and "type" not in item
                else item
                for item in value
            ]
        return value

    def refused_field(self) -> str | None:
        """What needs a stored response or conversation, or a feature kvray lacks."""
        extra = self.model_extra or {}
        for name in ("previous_response_id", "conversation", "prompt"):
            if extra.get(name) is not None:
                return name
        if extra.get("background"):
            return "background"
        if extra.get("include"):
            return "include"
        return None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request for the chat route; a field it refuses is named as this API
        names it."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if self.tools is not None:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None:
            body["response_format"] = _response_format(self.text.format)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise renamed(from_validation(exc)) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # calls of one turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        return messages


def _response_format(fmt: TextFormat | JsonObjectFormat | TextFormatJsonSchema) -> Any:
    if isinstance(fmt, TextFormatJsonSchema):
        schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.type}


# a union member's tag in a validation error's path: `input.0.function_call.call_id`
_KIND_IN_PATH = re.compile(
    r"^(input\.\d+|text\.format)\.(?:message|function_call|function_call_output|reasoning"
    r"|text|json_object|json_schema)(?=\.|$)"
)
# chat's field paths -> this API's (a prefix each; the rest of the path is kept)
_RENAMES = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function.name", "tool_choice.name"),
)


def renamed(error: ApiError) -> ApiError:
    """`error` with its `param` as this API names the field (`tools.0.function.parameters`
    is `tools.0.parameters`, an item's kind is no part of `input.0.call_id`); its message
    too, where it starts with the param."""
    param = error.param
    if not param:
        return error
    new = _KIND_IN_PATH.sub(r"\1", param)
    if new.startswith("tools."):
        parts = new.split(".")
        new = ".".join(p for i, p in enumerate(parts) if not (i == 2 and p == "function"))
    for old, ours in _RENAMES:
        if new == old or new.startswith(old + "."):
            new = ours + new[len(old) :]
            break
    if new == param:
        return error
    message = error.message
    if message.startswith(param):
        message = new + message[len(param) :]
    return ApiError(error.status, message, new, error.code, error.retry_after)


# ---- the answer ------------------------------------------------------------------------


def item_id(prefix: str) -> str:
    """An id as OpenAI's Responses API writes them (`resp_...`, `msg_...`, `fc_...`)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's thinking (with `ClusterConfig.reasoning_parser`)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A Response as OpenAI's API returns it (the fields kvray has)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[Annotated[OutputItem, Field(discriminator="type")]]
    parallel_tool_calls: bool
    temperature: float | None
    tool_choice: Any
    tools: list[Any]
    top_p: float | None
    text: Any
    metadata: dict[str, str]
    store: bool = False
    usage: ResponseUsage | None = None


class ResponseWriter:
    """One response's output items, built from its choice's deltas (its thinking split out
    with a `reasoning` parser, calls parsed out of the text when the model was given tools);
    `add` returns the stream's events for a delta."""

    def __init__(
        self,
        rid: str,
        created: int,
        req: ResponsesRequest,
        parses_calls: bool,
        reasoning: ReasoningParserName = "none",
    ):
        self.rid, self.created, self.req = rid, created, req
        self._parser = CallParser() if parses_calls else None
        self._thinking = ReasoningParser.of(reasoning)
        self._items: list[OutputItem] = []
        self._reasoning: OutputReasoning | None = None  # the open reasoning item
        self._message: OutputMessage | None = None  # the open message, text still coming
        self._finish: str | None = None
        self._seq = 0

    def start(self) -> list[str]:
        started = self.response("in_progress")
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]  # fmt: skip

    def deltas(self, deltas: list[ChoiceDelta]) -> list[str]:
        return [event for delta in deltas for event in self.add(delta)]

    def add(self, delta: ChoiceDelta) -> list[str]:
        events, text = [], delta.text
        if delta.finish_reason is not None:
            self._finish = delta.finish_reason
        if self._thinking is not None:
            thought, text = self._thinking.push(delta.text)
            if delta.finish_reason is not None:
                more, rest = self._thinking.finish()
                thought, text = thought + more, text + rest
            events += self._reason(thought) if thought else []
            if text or delta.finish_reason is not None:
                events += self._close_reasoning()
        content, calls = text, list[ParsedCall]()
        if self._parser is not None:
            content, calls = self._parser.push(text)
            if delta.finish_reason is not None:
                more, last = self._parser.finish()
                content, calls = content + more, calls + last
        events += self._text(content) if content else []
        for call in calls:
            events += self._close_message(before_call=True) + self._call(call)
        if delta.finish_reason is not None:
            events += self._close_message()
        return events

    def finish(self, usage: Usage) -> list[str]:
        done = self.response(usage=usage)
        kind = "response.incomplete" if done.status == "incomplete" else "response.completed"
        return [self._event(kind, response=done)]

    def response(self, status: str | None = None, usage: Usage | None = None) -> ResponseObject:
        if status is None:
            status = "incomplete" if self._finish == "length" else "completed"
        req, fmt = self.req, (self.req.text or TextConfig()).format
        return ResponseObject(
            id=self.rid,
            created_at=self.created,
            status=status,  # type: ignore[arg-type]
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=req.model,
            output=list(self._items) if status != "in_progress" else [],
            parallel_tool_calls=req.parallel_tool_calls,
            temperature=req.temperature,
            tool_choice=_dump(req.tool_choice) if req.tool_choice is not None else "auto",
            tools=[_dump(t) for t in req.tools or []],
            top_p=req.top_p,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            metadata=req.metadata or {},
            usage=_usage(usage) if usage is not None else None,
        )

    def _text(self, text: str) -> list[str]:
        events = []
        if self._message is None:
            self._message = OutputMessage(
                id=item_id("msg"), status="in_progress", content=[OutputText(text="")]
            )
            events = self._open(self._message, OutputText(text=""))
        return [*events, self._grow(self._message, "response.output_text.delta", text, logprobs=[])]

    def error(self, error: ApiError) -> str:
        """A failure after the stream began, as OpenAI's `error` event."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _reason(self, text: str) -> list[str]:
        events = []
        if self._reasoning is None:
            self._reasoning = OutputReasoning(
                id=item_id("rs"), status="in_progress", content=[ReasoningText(text="")]
            )
            events = self._open(self._reasoning, ReasoningText(text=""))
        return [*events, self._grow(self._reasoning, "response.reasoning_text.delta", text)]

    def _close_reasoning(self) -> list[str]:
        item, self._reasoning = self._reasoning, None
        return [] if item is None else self._done(item, "response.reasoning_text.done")

    def _close_message(self, before_call: bool = False) -> list[str]:
        message, self._message = self._message, None
        if message is None:
            return []
        if before_call:  # the line break before a call is no content (as chat's replies)
            message.content[0].text = message.content[0].text.rstrip()
        return self._done(message, "response.output_text.done", logprobs=[])

    def _grow(
        self, item: OutputMessage | OutputReasoning, kind: str, text: str, **more: Any
    ) -> str:
        """`text` added to the item's one part, and its delta event `kind`."""
        item.content[0].text += text
        index = self._items.index(item)
        return self._event(
            kind, item_id=item.id, output_index=index, content_index=0, delta=text, **more
        )

    def _done(self, item: OutputMessage | OutputReasoning, kind: str, **more: Any) -> list[str]:
        """The item's part done (`kind` with its whole text), then the part, then the item."""
        item.status = "incomplete" if self._finish == "length" else "completed"
        index, part = self._items.index(item), item.content[0]
        at = {"item_id": item.id, "output_index": index, "content_index": 0}
        return [
            self._event(kind, **at, text=part.text, **more),
            self._event("response.content_part.done", **at, part=part.model_dump()),
            self._item_event("response.output_item.done", item),
        ]

    def _call(self, call: ParsedCall) -> list[str]:
        item = OutputFunctionCall(
            id=item_id("fc"), call_id=call.id, name=call.name, arguments="", status="in_progress"
        )
        self._items.append(item)
        index = len(self._items) - 1
        added = self._item_event("response.output_item.added", item)
        item.arguments, item.status = call.arguments, "completed"
        return [
            added,
            self._event("response.function_call_arguments.delta", item_id=item.id,
                        output_index=index, delta=call.arguments),
            self._event("response.function_call_arguments.done", item_id=item.id,
                        output_index=index, arguments=call.arguments),
            self._item_event("response.output_item.done", item),
        ]  # fmt: skip

    def _open(self, item: OutputMessage | OutputReasoning, part: BaseModel) -> list[str]:
        """An item added, still empty (as OpenAI adds one), then its one content part."""
        self._items.append(item)
        index = len(self._items) - 1
        return [
            self._event("response.output_item.added", output_index=index,
                        item=item.model_dump() | {"content": []}),
            self._event("response.content_part.added", item_id=item.id, output_index=index,
                        content_index=0, part=part.model_dump()),
        ]  # fmt: skip

    def _item_event(self, kind: str, item: OutputItem) -> str:
        return self._event(kind, output_index=self._items.index(item), item=item.model_dump())

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        payload = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in data.items()}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _dump(value: BaseModel | str) -> Any:
    return (
        value.model_dump(by_alias=True, exclude_none=True)
        if isinstance(value, BaseModel)
        else value
    )


def _usage(usage: Usage) -> ResponseUsage:
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details={"cached_tokens": cached},
        output_tokens=usage.completion_tokens,
        output_tokens_details={"reasoning_tokens": 0},
        total_tokens=usage.total_tokens,
    )
