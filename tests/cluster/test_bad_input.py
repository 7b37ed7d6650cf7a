"""The bad-input corpus against the running app: every case is a 4xx OpenAI error, none
is a 5xx or a hang, and afterwards the server is healthy and its worker idle with every
KV page free."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.cluster.bad_inputs import ANY, CHAT, Case, Target, build_corpus
from tests.cluster.conftest import ENGINE, Served
from tests.cluster.test_cancellation import wait_idle
from worker.model.demo import resolve_model_path
from worker.tokenizer import Tokenizer

CONCURRENCY = 8
TIMEOUT_S = 60.0  # per request: a hang fails the case instead of the whole run
CHUNK = 64 * 1024


def target_of(served: Served) -> Target:
    limits = served.config.advanced.limits
    vocab = Tokenizer.from_dir(str(resolve_model_path(served.config.engine.model))).vocab_size
    return Target(
        model=served.config.model_name,
        api_key=served.api_key,
        max_seq_len=int(ENGINE["max_seq_len"]),
        vocab_size=vocab,
        max_request_bytes=limits.max_request_bytes,
        max_stop=limits.max_stop,
        max_stop_chars=limits.max_stop_chars,
        max_stop_token_ids=limits.max_stop_token_ids,
        max_prompts=limits.max_prompts,
        max_n=limits.max_n,
        max_waiting=int(ENGINE["max_waiting"]),
    )


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), CHUNK):
        yield body[start : start + CHUNK]


async def send(client: httpx.AsyncClient, base_url: str, case: Case) -> httpx.Response:
    # full URLs: httpx would read a path such as "//v1//chat" as a host
    headers = [(k.encode(), v.encode("latin-1")) for k, v in case.headers.items()]
    content: Any = case.body
    if case.chunked and case.body is not None:
        content = _chunks(case.body)
    return await client.request(
        case.method, f"{base_url}{case.path}", content=content, headers=headers
    )


def problem(case: Case, response: httpx.Response | BaseException) -> str | None:
    """Why the answer to `case` is wrong, or None when it is right."""
    if isinstance(response, BaseException):
        return f"{case.id}: no answer ({response!r})"
    status = response.status_code
    if status != case.status:
        return f"{case.id}: status {status}, expected {case.status}: {response.text[:300]}"
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{case.id}: not an OpenAI error body: {response.text[:300]!r}"
    shape_ok = (
        set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and error["message"]
        and isinstance(error["type"], str)
        and (error["param"] is None or isinstance(error["param"], str))
    )
    if not shape_ok:
        return f"{case.id}: malformed error {error!r}"
    if case.param != ANY and error["param"] != case.param:
        return f"{case.id}: param {error['param']!r}, expected {case.param!r} ({error['message']})"
    return None


async def run_corpus(served: Served, cases: list[Case]) -> list[str]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, case: Case) -> str | None:
        async with gate:
            try:
                response: httpx.Response | BaseException = await send(client, served.base_url, case)
            except httpx.HTTPError as exc:
                response = exc
            return problem(case, response)

    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        found = await asyncio.gather(*(one(client, c) for c in cases))
    return [p for p in found if p]


def test_corpus_is_large_and_distinct() -> None:
    cases = build_corpus(Target("demo", "test-key", 512, 49152))
    assert len(cases) >= 200
    assert all(400 <= c.status < 500 for c in cases)
    seen: dict[Any, str] = {}
    for c in cases:
        sent = (c.method, c.path, c.body, tuple(c.headers.items()), c.chunked)
        assert sent not in seen, f"{c.id} sends the same request as {seen[sent]}"
        seen[sent] = c.id


@pytest.fixture(scope="module")
def corpus_done(served: Served) -> list[str]:
    cases = build_corpus(target_of(served))
    return asyncio.run(run_corpus(served, cases))


def test_every_bad_input_gets_a_4xx_openai_error(corpus_done: list[str]) -> None:
    assert not corpus_done, "\n".join(corpus_done)


def test_server_is_healthy_and_idle_after_the_corpus(
    served: Served, corpus_done: list[str]
) -> None:
    assert httpx.get(f"{served.base_url}/health", timeout=60).status_code == 200
    body = {
        "model": served.config.model_name,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
    }
    ok = httpx.post(f"{served.base_url}{CHAT}", json=body, headers=served.headers(), timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"]
    stats = wait_idle(served)
    assert stats["num_free_pages"] == stats["num_total_pages"]
