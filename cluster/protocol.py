"""OpenAI protocol: request and response models of /v1/completions and /v1/chat/completions.

Requests are validated here, so a bad field is a 400 naming that field before anything
reaches a worker. Types are strict, as OpenAI's are (`"n": "2"` or `"n": true` is an
error, not a 2 or a 1); integers that reach a worker are bounded so they fit its wire
format. Unknown fields are ignored (clients send fields of newer API versions); fields
that ask for a feature kvray lacks (suffix, legacy functions, ...) are refused.
Limits an operator sets (stop list size, prompt count, ...) are checked by `cluster.limits`.

Structured output (`response_format`, and vLLM's `guided_json` / `guided_regex` /
`guided_grammar` / `guided_choice`, or its `structured_outputs` since v0.12) and a `required`
or named `tool_choice` become one `GuidedDecoding` for the engine (`guided()`); the ingress
checks that it compiles (cluster/api.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from cluster.formats import (
    Choice,
    DeltaToolCall,
    JsonObject,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    ToolCall,
    ToolCallParam,
    ToolChoice,
    ToolParam,
    is_none,
    schema_text,
    template_call,
)
from cluster.tools import Function, call_text, calls_grammar
from worker.guided import GuidedDecoding
from worker.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

FinishReason = Literal["stop", "length", "tool_calls"]
_INT32 = 2**31  # token ids, top_k and min_tokens stay below this (int32 on the worker)


def _whole_float(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer, so strict parsing takes it as 2 (not 2.5, not true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Bounds go inside the validator, so the JSON schema shows them as minimum / maximum.
_WHOLE = BeforeValidator(_whole_float)
Int = Annotated[int, _WHOLE]
PositiveInt = Annotated[int, Field(ge=1), _WHOLE]
NonNegativeInt = Annotated[int, Field(ge=0), _WHOLE]
Int32 = Annotated[int, Field(ge=0, lt=_INT32), _WHOLE]  # token ids, min_tokens
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63), _WHOLE]
TopK = Annotated[int, Field(ge=-1, lt=_INT32), _WHOLE]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _WHOLE]
NumChoices = Annotated[int, Field(ge=1, le=16), _WHOLE]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]
# checked by `_Request._stop` (one error naming `stop`); the schema still says non-empty
StopString = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]
_STRICT = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


# vLLM's structured_outputs kinds -> the spec each asks for
_VLLM_KINDS: dict[str, Callable[[Any], GuidedDecoding]] = {
    "json": lambda schema: GuidedDecoding.from_schema(schema_text(schema)),
    "regex": GuidedDecoding.from_regex,
    "choice": GuidedDecoding.from_choices,
    "grammar": GuidedDecoding.from_grammar,
    "json_object": lambda _: GuidedDecoding.any_object(),
}


class FieldError(ValueError):
    """A request whose fields are each valid but do not go together; `param` names one."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: PositiveInt | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: NumChoices = 1
    stop: StopString | list[StopString] | None = None
    seed: Seed | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Bias] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description="token id (a string) -> bias added to its logit",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM names)
    top_k: TopK = 0
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    stop_token_ids: list[Int32] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    guided_json: JsonObject | str | None = Field(None, description="a JSON schema (vLLM's name)")
    guided_regex: str | None = Field(None, description="the output matches this regex")
    guided_grammar: str | None = Field(
        None, description="the output matches this grammar (Lark, or GBNF / EBNF)"
    )
    guided_choice: list[Choice] | None = Field(
        None, min_length=1, description="the output is exactly one of these strings"
    )
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: NumLogprobs | None = Field(
        None, description="each prompt token's logprob, with this many alternatives (not streamed)"
    )

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < _INT32):
                raise ValueError(f"logit_bias keys are token ids, not {key[:32]!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def refused_field(self) -> str | None:
        """The first field asking for a feature this server lacks, if any."""
        for name, default in self._refused_extras().items():
            value = (self.model_extra or {}).get(name, default)
            if value not in (default, None):
                return name
        return None

    def _refused_extras(self) -> dict[str, Any]:
        # vLLM's sampling fields for features kvray lacks, set to anything but their default
        vllm = {"use_beam_search": False, "allowed_token_ids": [], "bad_words": []}
        return {"functions": [], "function_call": "none", **vllm, "truncate_prompt_tokens": None}

    def guided(self) -> GuidedDecoding | None:
        """What the output must match, from whichever field asks; FieldError when more than
        one does."""
        asked = self._guided_fields()
        if len(asked) > 1:
            first, second = [name.split(".")[0] for name in list(asked)[:2]]
            raise FieldError(f"'{first}' and '{second}' cannot be combined", param=second)
        if asked and self.min_tokens:  # a finished grammar allows only EOS
            raise FieldError("min_tokens cannot be combined with structured output", "min_tokens")
        return next(iter(asked.values()), None)

    def _guided_fields(self) -> dict[str, GuidedDecoding]:
        """The structured-output fields set, each as a spec, keyed by the field to name."""
        asked: dict[str, GuidedDecoding] = {}
        fmt = self.response_format
        if isinstance(fmt, JsonObjectFormat):
            asked["response_format"] = GuidedDecoding.any_object()
        elif isinstance(fmt, JsonSchemaResponseFormat):
            asked["response_format.json_schema.schema"] = GuidedDecoding.from_schema(
                schema_text(fmt.json_schema.schema_)
            )
        if self.guided_json is not None:
            asked["guided_json"] = GuidedDecoding.from_schema(schema_text(self.guided_json))
        if self.guided_regex is not None:
            asked["guided_regex"] = GuidedDecoding.from_regex(self.guided_regex)
        if self.guided_grammar is not None:
            asked["guided_grammar"] = GuidedDecoding.from_grammar(self.guided_grammar)
        if self.guided_choice is not None:
            asked["guided_choice"] = GuidedDecoding.from_choices(self.guided_choice)
        if self.structured_outputs is not None:
            for kind, value in self.structured_outputs.kinds().items():
                asked[f"structured_outputs.{kind}"] = _VLLM_KINDS[kind](value)
        return asked

    def guided_param(self) -> str | None:
        """The field a bad spec is reported under."""
        return next(iter(self._guided_fields()), None)

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def parses_tool_calls(self) -> bool:
        """Is the output read for tool calls (chat with tools, tool_choice not none)?"""
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling(
        self, max_tokens: int | None, logprobs: int | None, scored: int | None = None
    ) -> SamplingParams:
        """The engine's parameters; `scored`: alternatives a prompt token's logprob comes with
        for the response to show (`prompt_logprobs`, and completions' echo), if any."""
        if self.prompt_logprobs is not None:
            if self.stream:
                raise FieldError("prompt_logprobs is not available with stream", "prompt_logprobs")
            scored = max(self.prompt_logprobs, scored or 0)
        return SamplingParams(
            prompt_logprobs=scored,
            guided=self.guided(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop_list,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
        )


def text_only(*allowed: str) -> BeforeValidator:
    """A content part's `type`: an image, audio or file part is refused saying why (the
    models served are text-only), not as a mere mismatch with the text part's type."""

    def check(value: object) -> object:
        if isinstance(value, str) and value not in allowed:
            raise PydanticCustomError(
                "text_only",
                "content parts of type {got} are not supported: the models served here read "
                "text only (parts of type {want})",
                {"got": repr(value), "want": " or ".join(map(repr, allowed))},
            )
        return value

    return BeforeValidator(check)


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Annotated[Literal["text"], text_only("text")]
    text: str


class _Message(BaseModel):
    model_config = _STRICT
    name: str | None = None

    def text(self) -> str:
        content: str | list[ContentPart] | None = getattr(self, "content", None)
        if isinstance(content, list):
            return "".join(part.text for part in content)
        return content or ""


Content = str | list[ContentPart]


class SystemMessageParam(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessageParam(_Message):
    role: Literal["developer"]
    content: Content


class UserMessageParam(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessageParam(_Message):
    """Content may be null beside `tool_calls`."""

    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallParam] | None = None


class ToolMessageParam(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


# One model per role, told apart by `role`, as OpenAI's schema has them: a user message
# without content is a 400 naming `messages.N.content`, not an empty prompt.
ChatMessage = Annotated[
    SystemMessageParam
    | DeveloperMessageParam
    | UserMessageParam
    | AssistantMessageParam
    | ToolMessageParam,
    Field(discriminator="role"),
]


def shown_functions(tools: list[ToolParam] | None) -> list[Function]:
    """The functions of `tools` as the chat template and the call grammar take them."""
    return [
        Function(t.function.name, t.function.description, t.function.parameters)
        for t in tools or []
    ]


def template_messages(messages: list[ChatMessage], with_tools: bool) -> list[dict[str, Any]]:
    """The messages as chat templates take them: a past call's `arguments` parsed (most
    templates write them out as JSON themselves). `with_tools` False: calls and tool results
    as plain text, for a template that knows neither."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": m.text()}
        if isinstance(m, AssistantMessageParam) and m.tool_calls:
            if with_tools:
                message["tool_calls"] = [template_call(c) for c in m.tool_calls]
            else:
                calls = [call_text(c.function.name, c.function.arguments) for c in m.tool_calls]
                message["content"] = "\n".join([message["content"], *calls]).strip()
        if isinstance(m, ToolMessageParam) and with_tools:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


class ChatTemplateFields(BaseModel):
    """How the chat template renders the messages (vLLM's extensions)."""

    add_generation_prompt: bool = True  # end with the assistant's turn opened
    continue_final_message: bool = False  # the last (assistant) message left open, continued
    chat_template_kwargs: JsonObject | None = None  # more template variables (enable_thinking)

    def check_rendering(self, messages: list[ChatMessage]) -> None:
        if not self.continue_final_message:
            return
        if self.add_generation_prompt:
            message = "continue_final_message needs add_generation_prompt: false"
            raise FieldError(message, "continue_final_message")
        if messages[-1].role != "assistant":
            message = "continue_final_message needs the last message to be the assistant's"
            raise FieldError(message, "continue_final_message")


class ChatCompletionRequest(_Request, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, else none")
    parallel_tool_calls: bool = True

    def refused_field(self) -> str | None:
        """Legacy function calls replayed in the history are refused too: templates drop them."""
        for i, message in enumerate(self.messages):
            if (message.model_extra or {}).get("function_call") not in (None, []):
                return f"messages.{i}.function_call"
        return super().refused_field()

    @property
    def functions(self) -> list[Function]:
        """The tools the model is shown (none with `tool_choice: none`)."""
        return [] if self.tool_choice == "none" else shown_functions(self.tools)

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.functions)

    def _guided_fields(self) -> dict[str, GuidedDecoding]:
        asked = super()._guided_fields()
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return asked
        functions = self.functions
        if not functions:
            asks = "names a tool" if isinstance(choice, NamedToolChoice) else f"is '{choice}'"
            raise FieldError(f"tool_choice {asks}, but no tools are given", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f.name == choice.function.name]
            if not functions:
                message = f"tool_choice names '{choice.function.name}', which is not in tools"
                raise FieldError(message, "tool_choice.function.name")
        one = isinstance(choice, NamedToolChoice) or not self.parallel_tool_calls
        return {"tool_choice": calls_grammar(functions, one_call=one), **asked}

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[Int] | list[list[Int]] = Field(
        description="text, texts, token ids, or lists of token ids"
    )
    max_tokens: NonNegativeInt | None = 16  # 0 with echo: score the prompt only
    logprobs: NumLogprobs | None = None
    echo: bool = False  # the prompt before the text; with logprobs, its tokens' too

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    def _refused_extras(self) -> dict[str, Any]:
        return {**super()._refused_extras(), "suffix": None, "best_of": self.n}

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of texts or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [cast(list[int], list(p))]
        return cast(list[str] | list[list[int]], list(p))

    def sampling_params(self) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens 0 returns nothing without echo", "max_tokens")
        echoed = self.logprobs if self.echo else None
        return self._sampling(self.max_tokens, self.logprobs, echoed)


# ---- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, exclude_if=is_none)  # with a reasoning parser
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=is_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with `prompt_logprobs` (vLLM)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, exclude_if=is_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=is_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class PromptLogprob(BaseModel):
    """vLLM's: a prompt token's (or an alternative's) logprob, its rank among the vocabulary
    (1 = most likely), and its text."""

    logprob: float
    rank: int
    decoded_token: str


# per prompt token: token id (a string) -> its logprob, the alternatives' too; the first is null
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = None  # with `prompt_logprobs` (vLLM)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize body: a prompt as /v1/completions tokenizes it, or chat messages (and
    tools) as /v1/chat/completions renders them with the model's template."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolParam] | None = None
    add_special_tokens: bool = True  # prompt: the tokenizer's own (BOS), as completions adds
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages'")
        return self

    @property
    def functions(self) -> list[Function]:
        return shown_functions(self.tools)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    tokens: list[Annotated[int, Field(ge=0, lt=_INT32), _WHOLE]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvray"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every non-2xx answer of the API has this body."""

    error: ErrorDetail


def openapi_components() -> dict[str, Any]:
    """JSON schemas of the request, response and error bodies, for the OpenAPI document.

    The routes take a raw Request (the body is read under a size limit, then validated
    here), so FastAPI cannot derive these; the ingress references them by name.
    """
    models: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        (ChatCompletionRequest, "validation"),
        (CompletionRequest, "validation"),
        (ChatCompletion, "serialization"),
        (Completion, "serialization"),
        (ModelList, "serialization"),
        (TokenizeRequest, "validation"),
        (TokenizeResponse, "serialization"),
        (DetokenizeRequest, "validation"),
        (DetokenizeResponse, "serialization"),
        (ErrorResponse, "serialization"),
    ]
    from cluster.openai_responses import ResponseObject, ResponsesRequest  # imports this module

    models += [(ResponsesRequest, "validation"), (ResponseObject, "serialization")]
    _, top = models_json_schema(models, ref_template="#/components/schemas/{model}")
    return dict(top["$defs"])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
