"""Request limits and request parsing, without a server: each check alone, on its edges."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
from pydantic import ValidationError

from cluster import limits
from cluster.config import RequestLimits
from cluster.errors import ApiError, error_type, from_validation
from cluster.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "demo", "messages": MESSAGES, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "demo", "prompt": "Hi", **fields})


def refused(call: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args)
    return info.value


# ---- body size ------------------------------------------------------------------------


def test_content_length_over_the_limit_is_413_before_any_read() -> None:
    limits.check_content_length({}, 1024)
    limits.check_content_length({"content-length": "1024"}, 1024)
    error = refused(limits.check_content_length, {"content-length": "1025"}, 1024)
    assert error.status == 413 and error.code == "request_too_large"
    assert refused(limits.check_content_length, {"content-length": "-5"}, 1024).status == 400
    assert refused(limits.check_content_length, {"content-length": "1e9"}, 1024).status == 400


async def _counting(chunks: Iterable[bytes], pulled: list[int]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        pulled.append(len(chunk))
        yield chunk


def test_a_streamed_body_is_read_whole_when_it_fits() -> None:
    pulled: list[int] = []
    body = asyncio.run(limits.read_limited(_counting([b"ab", b"cd", b"e"], pulled), 5))
    assert body == b"abcde"


def test_an_endless_streamed_body_stops_being_read_past_the_limit() -> None:
    pulled: list[int] = []
    endless = _counting(itertools.repeat(b"x" * 1000), pulled)
    with pytest.raises(ApiError) as info:
        asyncio.run(limits.read_limited(endless, 10_500))
    assert info.value.status == 413
    assert sum(pulled) == 11_000, "reading must stop at the first chunk past the limit"


# ---- content type -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "application/json",
        "Application/JSON",
        "application/json; charset=utf-8",
        "application/vnd.kvray+json",
        None,
    ],
)
def test_json_content_types_and_none_are_read(value: str | None) -> None:
    limits.check_content_type({} if value is None else {"content-type": value})


@pytest.mark.parametrize(
    "value",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "text/json",
        "json",
        "",
        "; charset=utf-8",
    ],
)
def test_other_content_types_are_415(value: str) -> None:
    error = refused(limits.check_content_type, {"content-type": value})
    assert error.status == 415 and error_type(415) == "invalid_request_error"


# ---- per-request limits -----------------------------------------------------------------


def test_defaults_are_openai_like_and_leave_max_tokens_to_the_context() -> None:
    d = RequestLimits()
    assert (d.max_n, d.max_stop, d.max_stop_chars, d.max_stop_token_ids) == (16, 16, 1024, 64)
    assert d.max_request_bytes == 4 * 1024 * 1024 and d.max_prompts == 64
    assert d.max_tokens is None and d.max_prompt_tokens is None


@pytest.mark.parametrize(
    "bad",
    [
        {"max_stop": -1},
        {"max_tokens": 0},
        {"max_prompts": 0},
        {"max_request_bytes": 10},
        {"max_n": 17},
        {"max_stop_chars": 0},
        {"unknown_limit": 1},
    ],
)
def test_limits_are_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RequestLimits.model_validate(bad)


@pytest.mark.parametrize(
    ("req", "lim", "param"),
    [
        (chat(n=3), {"max_n": 2}, "n"),
        (chat(stop=["a", "b", "c"]), {"max_stop": 2}, "stop"),
        (chat(stop="abcd"), {"max_stop": 1, "max_stop_chars": 3}, "stop"),
        (chat(stop=["ok", "abcd"]), {"max_stop_chars": 3}, "stop"),
        (chat(stop_token_ids=[1, 2, 3]), {"max_stop_token_ids": 2}, "stop_token_ids"),
        (chat(max_tokens=9), {"max_tokens": 8}, "max_tokens"),
        (chat(max_completion_tokens=9), {"max_tokens": 8}, "max_completion_tokens"),
        (completion(max_tokens=9), {"max_tokens": 8}, "max_tokens"),
        (completion(prompt=["a", "b", "c"]), {"max_prompts": 2}, "prompt"),
        (completion(prompt=[[1], [2], [3]]), {"max_prompts": 2}, "prompt"),
        (chat(stop=[]), {"max_stop": 0, "max_stop_token_ids": 0}, None),
    ],
)
def test_each_limit_refuses_one_past_it(req: Any, lim: dict[str, Any], param: str | None) -> None:
    over = RequestLimits.model_validate(lim)
    if param is None:
        limits.check_request(req, over)
        return
    error = refused(limits.check_request, req, over)
    assert (error.status, error.param) == (400, param)


def test_requests_at_the_limits_pass() -> None:
    lim = RequestLimits(
        max_n=2, max_stop=2, max_stop_chars=3, max_stop_token_ids=2, max_prompts=2, max_tokens=8
    )
    limits.check_request(chat(n=2, stop=["abc", "d"], stop_token_ids=[1, 2], max_tokens=8), lim)
    limits.check_request(completion(prompt=["a", "b"], max_tokens=8), lim)
    limits.check_request(completion(prompt=[1, 2, 3, 4, 5]), lim)  # one prompt of token ids


def test_a_max_tokens_cap_is_the_default_of_requests_without_one() -> None:
    assert limits.with_default_max_tokens(chat(), 8).max_tokens == 8
    assert limits.with_default_max_tokens(chat(max_tokens=3), 8).max_tokens == 3
    capped = limits.with_default_max_tokens(chat(max_completion_tokens=5), 8)
    assert capped.sampling_params().max_tokens == 5
    assert limits.with_default_max_tokens(chat(), None).max_tokens is None
    assert limits.with_default_max_tokens(chat(max_tokens=None), 8).max_tokens == 8
    assert limits.with_default_max_tokens(completion(), 8).max_tokens == 8  # default 16 lowered
    assert limits.with_default_max_tokens(completion(), 100).max_tokens == 16


def test_token_ids_must_lie_in_the_vocabulary() -> None:
    limits.check_prompt_ids([0, 5, 9], 10, "prompt")
    for bad in (10, -1, 2**64):
        error = refused(limits.check_prompt_ids, [1, bad], 10, "prompt")
        assert (error.param, error.code) == ("prompt", "invalid_token_id")


def test_text_too_long_for_any_tokenization_is_refused_untokenized() -> None:
    vocab = ["a", "bcd", "<|special|>"]
    longest = limits.longest_token_chars(lambda ids, **_: vocab[ids[0]], len(vocab))
    assert longest == len("<|special|>") + 4  # special tokens count: clients can type them
    limits.check_text_size(longest * 10, longest, 10, "prompt")  # might still fit
    error = refused(limits.check_text_size, longest * 10 + 1, longest, 10, "prompt")
    assert (error.param, error.code) == ("prompt", "context_length_exceeded")


def test_more_sequences_than_a_worker_queues_is_400_not_an_endless_429() -> None:
    limits.check_fan_out(2, 3, 6)
    assert refused(limits.check_fan_out, 1, 7, 6).param == "n"
    assert refused(limits.check_fan_out, 4, 2, 6).param == "prompt"


def test_context_check() -> None:
    limits.check_context(500, 12, 512, None, "prompt")
    limits.check_context(500, None, 512, None, "prompt")  # up to the context
    assert refused(limits.check_context, 512, None, 512, None, "prompt").param == "prompt"
    error = refused(limits.check_context, 500, 13, 512, None, "messages")
    assert (error.param, error.code) == ("max_tokens", "context_length_exceeded")
    limits.check_context(500, 64, 512, 64, "prompt")  # the cap as a default runs to the end


def test_prompt_token_cap() -> None:
    limits.check_prompt_tokens([1] * 4, 4, "messages")
    limits.check_prompt_tokens([1] * 400, None, "messages")
    error = refused(limits.check_prompt_tokens, [1] * 5, 4, "messages")
    assert (error.param, error.code) == ("messages", "context_length_exceeded")


# ---- parsing: strict types, bounded ints, errors naming the field -------------------------


def error_of(model: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return from_validation(info.value)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": "2"}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stream": 1}, "stream"),
        ({"top_k": 2**31}, "top_k"),
        ({"min_tokens": 2**31}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ],
)
def test_types_are_strict_and_errors_name_the_field(fields: dict[str, Any], param: str) -> None:
    body = {"model": "demo", "messages": MESSAGES, **fields}
    assert error_of(ChatCompletionRequest, body).param == param


def test_integers_are_numbers_too_and_whole_floats_integers() -> None:
    assert chat(temperature=1, top_p=1).temperature == 1.0
    req = CompletionRequest.model_validate_json(b'{"model": "d", "prompt": [1.0, 2], "n": 2.0}')
    assert (req.prompt, req.n) == ([1, 2], 2) and isinstance(req.n, int)


def test_union_errors_name_the_closest_member() -> None:
    assert error_of(CompletionRequest, {"model": "demo", "prompt": [1, "a"]}).param.startswith(
        "prompt"
    )
    assert error_of(CompletionRequest, {"model": "demo", "prompt": [[[1]]]}).param == "prompt.0.0"


def test_legacy_function_calls_are_refused_and_tool_calls_accepted() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = chat(messages=[*MESSAGES, {"role": "assistant", "tool_calls": [call]}])
    assert req.refused_field() is None
    legacy = [*MESSAGES, {"role": "assistant", "function_call": call["function"]}]
    assert chat(messages=legacy).refused_field() == "messages.1.function_call"
    assert chat(function_call="auto").refused_field() == "function_call"
    assert (
        chat(messages=[{"role": "assistant", "content": "x", "tool_calls": []}]).refused_field()
        is None
    )


def test_error_types_of_statuses() -> None:
    assert error_type(405) == "invalid_request_error"
    assert error_type(401) == "authentication_error"
    assert error_type(500) == "server_error"
    assert error_type(502) == "server_error"
