"""Structured output and tool calling against the running app, with the official `openai`
client: `chat.completions.parse` with a pydantic model, JSON schemas and regexes on both
endpoints, streamed and not, a choice of strings, a constrained and an unconstrained request
in one batch, and a tool-calling round trip."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests.cluster.conftest import Served
from worker.guided import GuidedDecoding

MAX_TOKENS = 48
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Capital(BaseModel):
    country: str = Field(max_length=20)
    city: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="demo",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        response_format=Capital,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Capital), message.content
    assert Capital.model_validate_json(message.content or "") == message.parsed


def test_schemas_and_regexes_on_both_endpoints_streamed_or_not(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": schema}}
    question = [{"role": "user", "content": "Is the sky blue?"}]
    whole = client.chat.completions.create(
        model="demo", messages=question, response_format=fmt, temperature=0, max_tokens=24
    )
    chunks = client.chat.completions.create(
        model="demo",
        messages=question,
        response_format=fmt,
        temperature=0,
        max_tokens=24,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), schema)
    completion = client.completions.create(
        model="demo",
        prompt="The year the Eiffel Tower opened:",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_regex": r" [0-9]{4}\."},
    )
    assert completion.choices[0].finish_reason == "stop"
    text = completion.choices[0].text
    assert len(text) == 6 and text[1:5].isdigit() and text.endswith("."), text
    json_mode = client.completions.create(
        model="demo",
        prompt="A JSON object describing a cat:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"guided_json": schema},
    )
    jsonschema.validate(json.loads(json_mode.choices[0].text), schema)
    options = ["Yes, it is.", "No."]
    picked = client.chat.completions.create(
        model="demo",
        messages=question,
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": options},
    )
    assert picked.choices[0].message.content in options
    current_vllm = client.completions.create(  # vLLM's name for the same since v0.12
        model="demo",
        prompt="The year the Eiffel Tower opened:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}\."}},
    )
    assert current_vllm.choices[0].text == completion.choices[0].text


def test_a_constrained_and_a_free_request_in_one_batch(served: Served) -> None:
    """The batching window (25 ms in the test app) sends both in one submit: each comes out
    as it would alone."""
    free = dict(model="demo", messages=ASK_WEATHER, temperature=0, max_tokens=16)
    constrained = dict(free, response_format={"type": "json_object"}, max_tokens=MAX_TOKENS)

    async def run() -> list:
        client = AsyncOpenAI(
            base_url=f"{served.base_url}/v1", api_key=served.api_key, max_retries=0, timeout=120
        )
        create = client.chat.completions.create
        alone = await create(**free)  # type: ignore[call-overload]
        together = await asyncio.gather(create(**constrained), create(**free))  # type: ignore[call-overload]
        await client.close()
        return [alone, *together]

    alone, json_reply, free_reply = asyncio.run(run())
    assert free_reply.choices[0].message.content == alone.choices[0].message.content
    reply = json_reply.choices[0]
    assert reply.finish_reason == "stop", reply.message.content
    assert isinstance(json.loads(reply.message.content or ""), dict)


def test_a_tool_calling_round_trip(client: OpenAI) -> None:
    first = client.chat.completions.create(
        model="demo",
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # this small model would call again and again
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = [
        *ASK_WEATHER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    answer = client.chat.completions.create(
        model="demo",
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=8,
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_named_tool_streams_as_one_call_delta(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function and t.function.name) for t in calls] == [(0, "get_weather")]
    assert calls[0].function and calls[0].function.arguments
    json.loads(calls[0].function.arguments)
    assert "".join(d.content or "" for d in deltas) == ""
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["tool_calls"]


def test_an_invalid_schema_is_a_400_naming_the_field(client: OpenAI) -> None:
    bad: dict[str, Literal["json_schema"] | dict] = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
    }
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="demo", messages=ASK_WEATHER, response_format=bad, max_tokens=4
        )  # type: ignore[call-overload]
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "response_format.json_schema.schema"
    assert "uniqueItems" in error["message"]


def test_a_choice_admits_exactly_its_strings_whatever_they_hold(accepts) -> None:
    choices = ["yes", 'say "hi"\\n', "naïve café", "a|b", "tab\there\nline", "/x?/", "🎉"]
    spec = GuidedDecoding.from_choices(choices)
    assert all(accepts(spec, c) for c in choices)
    assert not any(accepts(spec, c) for c in ("ye", "yesyes", "a", "naive café", "x"))
