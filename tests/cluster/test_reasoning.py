"""Reasoning split from the answer without a server: the parser on whole texts and on
streams cut anywhere, for both ways a think block opens, the chat and Responses bodies
built with it (beside tool calls), and grammars that hold after the thinking."""

from __future__ import annotations

import json

import pytest

from cluster.generation import ChoiceDelta
from cluster.openai_responses import ResponsesRequest, ResponseWriter
from cluster.protocol import Usage
from cluster.reasoning import ReasoningParser, ReasoningParserName, split_reasoning, thinking
from cluster.responses import ChunkWriter, Collector
from cluster.tools import Function, calls_grammar
from worker.guided import GuidedDecoding
from worker.sampling import SamplingParams

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USAGE = Usage(prompt_tokens=5, completion_tokens=9, total_tokens=14)

CASES: list[tuple[ReasoningParserName, str, str | None, str]] = [
    ("qwen3", "<think>\nParis is the capital.\n</think>\n\nParis.", "\nParis is the capital.\n", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),  # thinking off: no block
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<think>cut short", "cut short", ""),  # max_tokens inside the block
    ("qwen3", "<thinking>x", None, "<thinking>x"),  # not the tag
    ("qwen3", "a </think> b", None, "a </think> b"),  # a close without an open is text
    ("deepseek_r1", "Paris is the capital.\n</think>\n\nParis.", "Paris is the capital.\n", "Paris."),
    ("deepseek_r1", "<think>x</think>y", "x", "y"),  # the model opened it anyway
    ("deepseek_r1", "still thinking", "still thinking", ""),  # never closed: all thinking
    ("deepseek_r1", "", None, ""),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "reasoning", "answer"), CASES)
def test_whole_and_streamed_texts_split_alike(name, text, reasoning, answer) -> None:
    assert split_reasoning(text, name) == (reasoning, answer)
    for size in (1, 2, 3, 5, 8):
        parser = ReasoningParser.of(name)
        assert parser is not None
        parts = [parser.push(text[i : i + size]) for i in range(0, len(text), size)]
        parts.append(parser.finish())
        assert "".join(r for r, _ in parts) == (reasoning or "")
        assert "".join(a for _, a in parts) == answer


def test_no_parser_keeps_the_text_whole() -> None:
    assert ReasoningParser.of("none") is None
    assert split_reasoning("<think>x</think>y", "none") == (None, "<think>x</think>y")


def test_a_tag_is_held_back_only_while_it_may_be_one() -> None:
    parser = ReasoningParser(opened=True)
    assert parser.push("step one </th") == ("step one ", "")
    assert parser.push("ink>Answer") == ("", "Answer")
    parser = ReasoningParser(opened=False)
    assert parser.push("<thi") == ("", "")
    assert parser.push("s is text") == ("", "<this is text")


def _chat_body(reasoning: ReasoningParserName, text: str, tool_calls: bool):
    collector = Collector(1, False, tool_calls=tool_calls, reasoning=reasoning)
    collector.add(ChoiceDelta(0, text, [], None, finish_reason="stop"))
    return collector.chat("chatcmpl-1", 0, "demo", USAGE, str).choices[0]


def test_chat_replies_carry_reasoning_content_then_content_and_calls() -> None:
    choice = _chat_body("qwen3", "<think>Look it up.</think>\n" + CALL, tool_calls=True)
    assert choice.message.reasoning_content == "Look it up."
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    plain = _chat_body("none", "<think>x</think>y", tool_calls=False)
    assert (
        "reasoning_content" not in plain.message.model_dump()
        and plain.message.content == "<think>x</think>y"
    )

    writer = ChunkWriter("chatcmpl-2", 0, "demo", True, str, False, reasoning="deepseek_r1")
    text = "Two plus two.</think>\n\nFour."
    deltas = []
    for i in range(0, len(text), 4):
        last = i + 4 >= len(text)
        lines = writer.deltas([ChoiceDelta(0, text[i : i + 4], [], None, "stop" if last else None)])
        deltas += [json.loads(line[6:])["choices"][0]["delta"] for line in lines]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Two plus two."
    assert "".join(d.get("content") or "" for d in deltas) == "Four."


def test_responses_put_the_thinking_in_a_reasoning_item_first() -> None:
    req = ResponsesRequest.model_validate({"model": "demo", "input": "2 + 2?"})
    writer = ResponseWriter("resp-1", 0, req, parses_calls=False, reasoning="qwen3")
    lines = writer.add(ChoiceDelta(0, "<think>Add them.", [], None))
    lines += writer.add(ChoiceDelta(0, "</think>Four.", [], None, finish_reason="stop"))
    kinds = [json.loads(line.split("\n")[1][6:])["type"] for line in lines]
    assert kinds[:3] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"
    ]  # fmt: skip
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    reasoning, message = writer.response(usage=USAGE).output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Add them."
    assert message.type == "message" and message.content[0].text == "Four."


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SPECS = {
    "schema": GuidedDecoding.from_schema(SCHEMA),
    "regex": GuidedDecoding.from_regex("[0-9]+"),
    "grammar": GuidedDecoding.from_grammar('start: "yes" | "no"'),
    "tool": calls_grammar([Function(name="get_weather", parameters=None)], one_call=True),
}
ANSWERS = {
    "schema": '{"a": 1}',
    "regex": "42",
    "grammar": "yes",
    "tool": '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
}


@pytest.mark.parametrize("kind", list(SPECS))
def test_a_grammar_holds_after_the_thinking_block_its_parser_reads(accepts, kind) -> None:
    """qwen3: a block may come first (or none: thinking off); deepseek_r1: the output starts
    inside the block. Either way the block ends at its first </think>, and the answer after
    it (a few blanks allowed) must match the grammar; without a parser, no block at all."""
    answer = ANSWERS[kind]

    def shaped(name: ReasoningParserName) -> GuidedDecoding:
        guided = thinking(SamplingParams(guided=SPECS[kind]), name).guided
        assert guided is not None
        return guided

    qwen3, r1, plain = shaped("qwen3"), shaped("deepseek_r1"), shaped("none")
    block = "<think>\nFirst {the} facts.\n</think>\n\n"
    assert accepts(qwen3, block + answer) and accepts(qwen3, answer)
    assert not accepts(qwen3, "Just text. " + answer)
    assert not accepts(qwen3, block + "Well, " + answer)
    assert not accepts(qwen3, "<think>a</think> b </think>" + answer)  # one block only
    assert accepts(r1, "I will answer.</think>\n" + answer)
    assert not accepts(r1, answer)  # the block opened in the prompt must close
    assert accepts(plain, answer) and not accepts(plain, block + answer)


def test_only_chat_with_a_parser_and_a_grammar_gets_thinking_room() -> None:
    guided = SamplingParams(guided=GuidedDecoding.any_object())
    assert thinking(guided, "qwen3").guided.thinking == "optional"  # type: ignore[union-attr]
    assert thinking(guided, "deepseek_r1").guided.thinking == "open"  # type: ignore[union-attr]
    assert thinking(guided, "none") is guided
    free = SamplingParams()
    assert thinking(free, "qwen3") is free
