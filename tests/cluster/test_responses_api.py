"""The Responses API against the running app with the official `openai` client: the same
text as the chat route for the same conversation, streamed as OpenAI's typed events,
`responses.parse` with a pydantic model, a function-calling round trip, and what needs a
stored response refused."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class Capital(BaseModel):
    country: str = Field(max_length=20)
    city: str = Field(max_length=20)


def test_a_response_says_what_chat_says_streamed_or_not(client: OpenAI) -> None:
    chat = client.chat.completions.create(
        model="demo",
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
        temperature=0,
        max_tokens=16,
    )
    whole = client.responses.create(
        model="demo", instructions=INSTRUCTIONS, input=QUESTION, temperature=0, max_output_tokens=16
    )
    assert whole.status in ("completed", "incomplete")
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage is not None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert whole.usage.output_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]
    if chat.choices[0].finish_reason == "length":
        assert whole.status == "incomplete"
        assert whole.incomplete_details is not None
        assert whole.incomplete_details.reason == "max_output_tokens"

    events = list(
        client.responses.create(
            model="demo",
            instructions=INSTRUCTIONS,
            input=QUESTION,
            temperature=0,
            max_output_tokens=16,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_")

    with client.responses.stream(  # the client's helper builds its snapshot from the events
        model="demo", instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
        max_output_tokens=16,
    ) as stream:  # fmt: skip
        texts = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert texts[-1] == whole.output_text == final.output_text


def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    parsed = client.responses.parse(
        model="demo", input=QUESTION, text_format=Capital, temperature=0, max_output_tokens=48
    )
    assert parsed.status == "completed", parsed.output_text
    assert isinstance(parsed.output_parsed, Capital)
    assert Capital.model_validate_json(parsed.output_text) == parsed.output_parsed


def test_function_calling_round_trip(client: OpenAI) -> None:
    """A required tool_choice makes a call (its arguments valid under the tool's schema);
    its output sent back as a function_call_output gets an answer in text."""
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(
        model="demo", input=asked, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type, list-item]
        temperature=0, max_output_tokens=64,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls), first.output
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    # the first output replayed as it came (as agent SDKs do), then the calls' results
    history = asked + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"}
        for c in calls
    ]  # fmt: skip
    second = client.responses.create(
        model="demo", input=history, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type]
        temperature=0, max_output_tokens=24,
    )  # fmt: skip
    assert [item.type for item in second.output] == ["message"]
    assert second.output_text

    streamed = list(
        client.responses.create(
            model="demo", input=asked, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type, list-item]
            temperature=0, max_output_tokens=64, stream=True,
        )
    )  # fmt: skip
    done = [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done == [c.arguments for c in calls]


def test_what_needs_a_stored_response_is_refused(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="demo", input=QUESTION, previous_response_id="resp_1")
    assert refused.value.code == "unsupported"
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="demo", input=QUESTION, max_output_tokens=10**9)
    assert bad.value.body["param"] == "max_output_tokens"  # type: ignore[index]
