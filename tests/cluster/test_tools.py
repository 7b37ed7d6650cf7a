"""Tool calls without a server: the grammar of a required or named tool_choice, the parser
(whole replies, and streams cut anywhere), the prompt of a template without tools, and the
response bodies built from parsed calls."""

from __future__ import annotations

import json

import pytest

from cluster import tools
from cluster.generation import ChoiceDelta
from cluster.protocol import ChatCompletionRequest, FieldError, Usage
from cluster.responses import ChunkWriter, Collector
from cluster.tools import CallParser, Function, split_calls

WEATHER = Function(
    "get_weather",
    "The weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Function("get_time", None, None)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLY = f"Let me look.\n{CALL}\n{CALL.replace('Paris', 'Rome')}\n"


def test_the_grammar_of_a_required_choice_admits_only_calls_of_the_tools(accepts) -> None:
    several = tools.calls_grammar([WEATHER, TIME], one_call=False)
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(several, CALL)
    assert accepts(several, f"{CALL}\n{time_call}")
    assert not accepts(several, "Sure. " + CALL)
    assert not accepts(several, CALL.replace("get_weather", "get_wether"))
    assert not accepts(several, CALL.replace('{"city": "Paris"}', '{"town": "Paris"}'))
    one = tools.calls_grammar([WEATHER], one_call=True)
    assert accepts(one, CALL) and not accepts(one, f"{CALL}\n{CALL}")


def test_a_reply_splits_into_content_and_calls_however_it_streams() -> None:
    content, calls = split_calls(REPLY)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert len({c.id for c in calls}) == 2
    for size in (1, 2, 5, 13):
        parser = CallParser()
        pieces = [parser.push(REPLY[i : i + size]) for i in range(0, len(REPLY), size)]
        pieces.append(parser.finish())
        streamed = "".join(p[0] for p in pieces)
        assert streamed.strip() == "Let me look." and "<" not in streamed
        assert [c.arguments for p in pieces for c in p[1]] == [c.arguments for c in calls]
    content, [only] = split_calls(CALL)
    assert content is None and only.arguments == '{"city": "Paris"}'


def test_text_that_is_no_call_stays_content() -> None:
    assert split_calls("a < b, and <tool") == ("a < b, and <tool", [])
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert split_calls(broken) == (broken, [])
    content, [call] = split_calls('<tool_call>\n{"name": "f", "arguments": {}}')  # unclosed
    assert content is None and call.name == "f"
    for cut in (1, 5, len("</tool_call>") - 1):  # max_tokens ended inside the closing tag
        content, calls = split_calls(f"{CALL}\n{CALL[:-cut]}")
        assert content is None and [c.arguments for c in calls] == ['{"city": "Paris"}'] * 2
    assert split_calls("  \n") == ("  \n", [])


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    shown, tool_dicts = tools.template_inputs(messages, [WEATHER], takes_tools=False)
    assert tool_dicts is None and shown[0]["role"] == "system" and shown[1:] == messages
    assert '"name": "get_weather"' in shown[0]["content"] and "<tool_call>" in shown[0]["content"]
    system = [{"role": "system", "content": "Be brief."}, *messages]
    shown, _ = tools.template_inputs(system, [WEATHER], takes_tools=False)
    assert shown[0]["content"].startswith("Be brief.\n\n") and len(shown) == 2
    shown, tool_dicts = tools.template_inputs(messages, [WEATHER], takes_tools=True)
    assert shown == messages and tool_dicts == [WEATHER.template_dict()]
    assert tools.template_inputs(messages, [], takes_tools=True) == (messages, None)


def _chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def test_tool_choice_decides_what_is_shown_parsed_and_enforced() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    assert _chat().functions == [] and _chat().guided() is None
    auto = _chat(tools=[tool])
    assert auto.parses_tool_calls and auto.guided() is None
    assert _chat(tools=[tool], tool_choice="none").functions == []
    required = _chat(tools=[tool], tool_choice="required").guided()
    assert required is not None and required.kind == "grammar"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _chat(tools=[tool], tool_choice=named).guided() is not None
    with pytest.raises(FieldError) as caught:
        _chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "nope"}}).guided()
    assert caught.value.param == "tool_choice.function.name"
    for choice, says in (("required", "tool_choice is 'required'"), (named, "names a tool")):
        with pytest.raises(FieldError, match=f"{says}, but no tools are given"):
            _chat(tool_choice=choice).guided()


def _delta(text: str, finish=None) -> ChoiceDelta:
    return ChoiceDelta(0, text, [], None, finish)


def test_responses_carry_calls_and_finish_with_tool_calls() -> None:
    collector = Collector(1, False, tool_calls=True)
    collector.add(_delta(REPLY, "stop"))
    body = collector.chat("r", 0, "m", usage=_usage(), token_text=str).model_dump()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"] * 2
    plain = Collector(1, False)
    plain.add(_delta("Hello", "stop"))
    message = plain.chat("r", 0, "m", usage=_usage(), token_text=str).model_dump()
    assert message["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}

    writer = ChunkWriter("r", 0, "m", True, str, False, tool_calls=True)
    lines = [
        line for i in range(0, len(REPLY), 7) for line in writer.deltas([_delta(REPLY[i : i + 7])])
    ]
    lines += writer.deltas([_delta("", "length")])
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [(t["index"], t["function"]["name"]) for t in calls] == [
        (0, "get_weather"),
        (1, "get_weather"),
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # cut off: not tool_calls
    for chunk in chunks[:-1]:  # text held back inside a call sends nothing, not empty chunks
        delta = chunk["choices"][0]["delta"]
        assert delta.get("content") or delta.get("tool_calls")
    assert "tool_calls" not in ChunkWriter("r", 0, "m", True, str, False).deltas([_delta("x")])[0]


def _usage() -> Usage:
    return Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
