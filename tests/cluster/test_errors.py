"""Bad inputs get their status code and an OpenAI error body; the server stays healthy."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import ENGINE, Served

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]


def post(
    served: Served,
    path: str,
    body: Any = None,
    *,
    content: bytes | None = None,
    key: str | None = None,
) -> httpx.Response:
    headers = {
        "Authorization": f"Bearer {key or served.api_key}",
        "Content-Type": "application/json",
    }
    return httpx.post(
        f"{served.base_url}{path}", json=body, content=content, headers=headers, timeout=60
    )


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": None}, "messages"),
        ({"stop": [""]}, "stop"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_invalid_fields_are_400_naming_the_field(
    served: Served, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "demo", "messages": MESSAGES, **extra}
    error = assert_error(post(served, CHAT, body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_is_400(served: Served) -> None:
    error = assert_error(post(served, CHAT, content=b'{"model": "demo", "messages": ['), 400)
    assert error["code"] == "invalid_json"


def test_missing_field_is_400(served: Served) -> None:
    assert_error(post(served, CHAT, {"model": "demo"}), 400, "messages")


def test_prompt_longer_than_the_context_is_400(served: Served) -> None:
    long_text = "word " * ENGINE["max_seq_len"]
    error = assert_error(
        post(served, CHAT, {"model": "demo", "messages": [{"role": "user", "content": long_text}]}),
        400,
    )
    assert error["code"] == "context_length_exceeded"
    too_many = {"model": "demo", "messages": MESSAGES, "max_tokens": ENGINE["max_seq_len"]}
    assert_error(post(served, CHAT, too_many), 400, "max_tokens")


def test_token_ids_outside_the_vocabulary_are_400(served: Served) -> None:
    assert_error(post(served, "/v1/completions", {"model": "demo", "prompt": [1, 2, 10**7]}), 400)


def test_unknown_model_is_404(served: Served) -> None:
    error = assert_error(post(served, CHAT, {"model": "gpt-9", "messages": MESSAGES}), 404, "model")
    assert error["code"] == "model_not_found"


def test_missing_or_wrong_api_key_is_401(served: Served) -> None:
    body = {"model": "demo", "messages": MESSAGES}
    assert_error(post(served, CHAT, body, key="wrong"), 401)
    no_key = httpx.post(f"{served.base_url}{CHAT}", json=body, timeout=60)
    assert_error(no_key, 401)
    assert_error(httpx.get(f"{served.base_url}/v1/models", timeout=60), 401)


def test_unknown_route_is_404_error_json(served: Served) -> None:
    assert_error(httpx.get(f"{served.base_url}/v1/nothing-here", timeout=60), 404)


def test_over_the_waiting_limit_is_429_with_retry_after(served: Served) -> None:
    body = {
        "model": "demo",
        "messages": MESSAGES,
        "max_tokens": 24,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=served.base_url, headers=served.headers(), timeout=120
        ) as client:
            return await asyncio.gather(*(client.post(CHAT, json=body) for _ in range(24)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, [
        r.text for r in responses if r.status_code not in (200, 429)
    ]
    refused = [r for r in responses if r.status_code == 429]
    assert refused, "24 concurrent requests must exceed max_running + max_waiting"
    assert all(r.headers.get("retry-after") for r in refused)
    assert assert_error(refused[0], 429)["type"] == "rate_limit_error"
    assert all(
        r.json()["usage"]["completion_tokens"] == 24 for r in responses if r.status_code == 200
    )


def test_server_stays_healthy_after_bad_inputs(served: Served) -> None:
    assert httpx.get(f"{served.base_url}/health", timeout=60).status_code == 200
    ok = post(served, CHAT, {"model": "demo", "messages": MESSAGES, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
