"""The Responses API without a server: requests as the chat requests they become (and their
errors under this API's field names), and the output items and stream events built from a
choice's deltas."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cluster.errors import ApiError, from_validation
from cluster.generation import ChoiceDelta
from cluster.openai_responses import ResponsesRequest, ResponseWriter, renamed
from cluster.protocol import AssistantMessageParam, FieldError, ToolMessageParam, Usage

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USAGE = Usage(prompt_tokens=9, completion_tokens=4, total_tokens=13)


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "demo", "input": "Hi", **fields})


def _error(**fields) -> ApiError:
    try:
        body = ResponsesRequest.model_validate({"model": "demo", "input": "Hi", **fields})
        body.chat_request().sampling_params()
    except ApiError as exc:
        return exc
    except FieldError as exc:  # as the ingress turns it into a 400, then names the field
        return renamed(ApiError(400, exc.message, exc.param))
    except ValidationError as exc:  # of the Responses body itself
        return renamed(from_validation(exc))
    raise AssertionError("accepted")


def test_instructions_and_items_become_the_chat_messages() -> None:
    chat = _request(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_1", "summary": []},  # replayed output: left out
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "It is sunny."}]},
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=7,
        temperature=0.5,
    ).chat_request()  # fmt: skip
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    calls = chat.messages[2]
    assert isinstance(calls, AssistantMessageParam) and calls.tool_calls is not None
    assert [c.id for c in calls.tool_calls] == ["c1", "c2"]  # two calls of one turn
    tool = chat.messages[3]
    assert isinstance(tool, ToolMessageParam) and (tool.tool_call_id, tool.content) == (
        "c1",
        "sunny",
    )
    assert chat.messages[4].text() == "It is sunny."
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"
    params = chat.sampling_params()
    assert (params.max_tokens, params.temperature) == (7, 0.5)
    assert params.guided is not None  # a named tool_choice is enforced by a grammar


def test_a_json_schema_format_constrains_the_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    guided = _request(text={"format": fmt}).chat_request().sampling_params().guided
    assert guided is not None and json.loads(guided.spec) == schema
    assert (
        _request(text={"format": {"type": "text"}}).chat_request().sampling_params().guided is None
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "url": "x"}]}]},
         "input.0.content.0.type"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.name"),
        ({"text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}},
         "text.format"),
        ({"input": []}, "input"),
    ],
)  # fmt: skip
def test_a_bad_field_is_named_as_this_api_names_it(fields, param) -> None:
    error = _error(**fields)
    assert error.status == 400 and error.param is not None and error.param.startswith(param)


def test_what_needs_a_stored_response_is_refused() -> None:
    assert _request(previous_response_id="resp_1").refused_field() == "previous_response_id"
    assert _request(background=True).refused_field() == "background"
    assert _request(store=True, background=False).refused_field() is None


def _events(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        kind, data = line.strip().split("\n")
        assert kind == f"event: {json.loads(data[6:])['type']}"
        out.append(json.loads(data[6:]))
    return out


def test_text_streams_as_one_message_item() -> None:
    writer = ResponseWriter("resp-1", 0, _request(), parses_calls=False)
    lines = writer.start()
    lines += writer.add(ChoiceDelta(0, "Hel", [1], None))
    lines += writer.add(ChoiceDelta(0, "lo", [2], None, finish_reason="stop"))
    lines += writer.finish(USAGE)
    events = _events(lines)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[2]["item"]["content"] == []  # added empty; its part comes next, as OpenAI's
    assert "".join(e["delta"] for e in events if e["type"].endswith("text.delta")) == "Hello"
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == 4
    assert done["output"] == [
        {"type": "message", "id": events[2]["item"]["id"], "role": "assistant",
         "status": "completed", "content": [{"type": "output_text", "text": "Hello",
                                             "annotations": []}]},
    ]  # fmt: skip


def test_calls_become_function_call_items_after_the_text() -> None:
    writer = ResponseWriter("resp-2", 0, _request(tools=[WEATHER]), parses_calls=True)
    writer.add(ChoiceDelta(0, "Let me look.\n" + CALL[:20], [1], None))
    events = _events(writer.add(ChoiceDelta(0, CALL[20:], [2], None, finish_reason="tool_calls")))
    assert "response.function_call_arguments.done" in [e["type"] for e in events]
    out = writer.response(usage=USAGE)
    message, call = out.output
    assert message.type == "message" and message.content[0].text == "Let me look."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"


def test_a_failure_mid_stream_is_the_next_numbered_event() -> None:
    writer = ResponseWriter("resp-4", 0, _request(), parses_calls=False)
    writer.start()
    (event,) = _events([writer.error(ApiError(503, "the worker died", code="unavailable"))])
    assert event == {"type": "error", "sequence_number": 2, "code": "unavailable",
                     "message": "the worker died", "param": None}  # fmt: skip


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    writer = ResponseWriter("resp-3", 0, _request(max_output_tokens=2), parses_calls=False)
    writer.add(ChoiceDelta(0, "Hi there", [1, 2], None, finish_reason="length"))
    (line,) = writer.finish(USAGE)
    done = _events([line])[0]
    assert done["type"] == "response.incomplete"
    assert done["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["response"]["output"][0]["status"] == "incomplete"
