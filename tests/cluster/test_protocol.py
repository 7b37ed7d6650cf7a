"""The OpenAI request models: sampling parameters, prompt shapes, refused features."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cluster.errors import from_validation
from cluster.openai_responses import ResponsesRequest
from cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    template_messages,
)
from worker.sampling import SamplingParams


def test_chat_request_maps_onto_sampling_params() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "demo",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": "hi"},
            ],
            "max_completion_tokens": 9,
            "max_tokens": 3,
            "logprobs": True,
            "stop": "END",
            "top_k": -1,
            "seed": 5,
        }
    )
    params = req.sampling_params()
    assert (params.max_tokens, params.logprobs, params.stop, params.top_k, params.seed) == (
        9,
        0,
        ("END",),
        0,
        5,
    )
    assert template_messages(req.messages, True)[0] == {"role": "system", "content": "be brief"}


def test_completion_prompts_take_every_openai_shape() -> None:
    def prompts(p: object) -> object:
        return CompletionRequest.model_validate({"model": "m", "prompt": p}).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).max_tokens == 16


def test_unsupported_features_are_named() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert (
        ChatCompletionRequest.model_validate({**base, "functions": [{"name": "f"}]}).refused_field()
        == "functions"
    )
    assert (
        ChatCompletionRequest.model_validate(
            {**base, "tool_choice": "none", "store": True}
        ).refused_field()
        is None
    )
    assert (
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "suffix": "y"}
        ).refused_field()
        == "suffix"
    )


def test_echo_with_logprobs_asks_the_engine_for_prompt_logprobs() -> None:
    def params(**fields: object) -> SamplingParams:
        body = {"model": "m", "prompt": "x", **fields}
        return CompletionRequest.model_validate(body).sampling_params()

    assert params(echo=True, logprobs=2, max_tokens=0).prompt_logprobs == 2
    assert params(echo=True, max_tokens=0).prompt_logprobs is None  # the text alone
    assert params(logprobs=2).prompt_logprobs is None
    with pytest.raises(FieldError, match="max_tokens"):
        params(max_tokens=0)


def test_prompt_logprobs_ask_the_engine_to_score_the_prompt_and_not_with_stream() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(chat).sampling_params().prompt_logprobs is None
    asked = ChatCompletionRequest.model_validate({**chat, "prompt_logprobs": 3})
    assert asked.sampling_params().prompt_logprobs == 3
    # echo's own count and prompt_logprobs': the engine scores the larger
    both = {"model": "m", "prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 4}
    assert CompletionRequest.model_validate(both).sampling_params().prompt_logprobs == 4
    few = {**both, "logprobs": 5, "prompt_logprobs": 0}
    assert CompletionRequest.model_validate(few).sampling_params().prompt_logprobs == 5
    with pytest.raises(FieldError, match="stream") as refused:
        ChatCompletionRequest.model_validate(
            {**chat, "prompt_logprobs": 1, "stream": True}
        ).sampling_params()
    assert refused.value.param == "prompt_logprobs"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user"}, "messages.0.content"),
        ({"role": "system"}, "messages.0.content"),
        ({"role": "developer", "content": None}, "messages.0.content"),
        ({"role": "tool", "content": "42"}, "messages.0.tool_call_id"),
        ({"content": "Hi"}, "messages.0.role"),
        ({"role": "bot", "content": "Hi"}, "messages.0.role"),
        ({"role": "user", "content": 5}, "messages.0.content"),
    ],
)
def test_each_role_is_validated_by_its_own_schema_naming_the_field(
    message: dict, param: str
) -> None:
    body = {"model": "m", "messages": [message]}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(json.dumps(body))
    assert from_validation(caught.value).param == param


@pytest.mark.parametrize(
    ("request_model", "body", "says"),
    [
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
         "'image_url' are not supported: the models served here read text only (parts of type 'text')"),
        (ResponsesRequest, {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "'input_image' are not supported: the models served here read text only"),
    ],
)  # fmt: skip
def test_an_image_part_is_refused_as_not_text(request_model: type, body: dict, says: str) -> None:
    """Not "Input should be 'text'": the client learns the model reads text only."""
    with pytest.raises(ValidationError) as caught:
        request_model.model_validate_json(json.dumps({"model": "m", **body}))
    error = from_validation(caught.value)
    assert error.param.endswith("content.0.type")
    assert says in error.message


def test_an_assistant_turn_may_be_empty_and_its_tool_calls_reach_the_template() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]}
    req = ChatCompletionRequest.model_validate(body)
    assert template_messages(req.messages, True)[1] == {"role": "assistant", "content": ""}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    body["messages"][1] = {"role": "assistant", "content": None, "tool_calls": [call]}
    body["messages"].append({"role": "tool", "content": "42", "tool_call_id": "c1"})
    req = ChatCompletionRequest.model_validate(body)
    assert req.refused_field() is None
    assistant, tool = template_messages(req.messages, True)[1:]
    assert assistant["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    plain = template_messages(req.messages, False)[1]  # for a template without tools
    assert plain == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    }
    body["messages"][1] = {"role": "assistant", "function_call": call["function"]}
    assert ChatCompletionRequest.model_validate(body).refused_field() == "messages.1.function_call"
