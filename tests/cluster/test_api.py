"""The ingress's handlers without Ray: the model list, engine request ids, max_tokens."""

from __future__ import annotations

import asyncio

import pytest

from cluster.config import (
    ClusterConfig,
)
from cluster.router import RouteHint
from worker.sampling import SamplingParams


def test_the_model_list_names_the_context_length_from_its_first_request(monkeypatch) -> None:
    """/v1/models asks a worker for the context length if nothing has yet, and answers
    without it (rather than an error) when no worker can say."""
    import json
    from types import SimpleNamespace

    from starlette.requests import Request

    import cluster.api as api

    ingress_class = api.Ingress.__mro__[1]  # the class under serve.ingress's wrapper
    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="ing-1"))
    monkeypatch.setattr(api.serve, "get_replica_context", lambda: context)

    class Worker:
        def __init__(self, answer: dict[str, int] | None):
            self.answer, self.asked = answer, 0
            self.info = self

        def options(self, **_: object) -> Worker:
            return self

        async def remote(self, hint: RouteHint) -> dict[str, int]:
            self.asked += 1
            if self.answer is None:
                raise RuntimeError("no replica")
            return self.answer

    async def listed(worker: Worker) -> list[dict[str, object]]:
        ingress = ingress_class(ClusterConfig(), worker)
        bodies = [await ingress.models(Request({"type": "http", "headers": []})) for _ in range(2)]
        return [json.loads(bytes(b.body))["data"][0] for b in bodies]

    worker = Worker({"max_seq_len": 512})
    assert [m["max_model_len"] for m in asyncio.run(listed(worker))] == [512, 512]
    assert worker.asked == 1
    assert [m["max_model_len"] for m in asyncio.run(listed(Worker(None)))] == [None, None]

    async def retrieved(name: str) -> dict[str, object]:
        ingress = ingress_class(ClusterConfig(), Worker({"max_seq_len": 512}))
        body = await ingress.model(Request({"type": "http", "headers": []}), name)
        return json.loads(bytes(body.body))

    card = asyncio.run(retrieved(ClusterConfig().model_name))
    assert card["id"] == ClusterConfig().model_name and card["max_model_len"] == 512
    with pytest.raises(api.ApiError) as refused:
        asyncio.run(retrieved("org/other"))
    assert (refused.value.status, refused.value.code) == (404, "model_not_found")


def test_a_responses_engine_requests_are_named_after_its_id() -> None:
    """Prompt p's choice i of response `rid` is the engine request `{rid}-p-i`: a request id
    in a worker's log names the response."""
    from types import SimpleNamespace

    import cluster.api as api

    ingress_class = api.Ingress.__mro__[1]  # the class under serve.ingress's wrapper
    ingress = SimpleNamespace(_config=ClusterConfig())
    group = ingress_class._group(
        ingress,
        "cmpl-7",
        [[1, 2], [3]],
        SamplingParams(seed=5),
        2,
        {"prefix_cache": False, "max_seq_len": 64},
    )
    assert [r.request_id for r in group.requests] == [
        "cmpl-7-0-0",
        "cmpl-7-0-1",
        "cmpl-7-1-0",
        "cmpl-7-1-1",
    ]
    assert [r.params.seed for r in group.requests] == [5, 6, 5, 6]  # n > 1: one seed a choice


def test_the_operators_default_max_tokens_is_fitted_to_each_prompts_context() -> None:
    """A request that took the operator's cap as its default stops where the context ends; the
    ingress sends it with max_tokens fitted, so the worker's own context check passes it."""
    from types import SimpleNamespace

    import cluster.api as api

    ingress_class = api.Ingress.__mro__[1]
    ingress = SimpleNamespace(_config=ClusterConfig())
    params = SamplingParams(max_tokens=50, min_tokens=40)
    info = {"prefix_cache": False, "max_seq_len": 64}
    group = ingress_class._group(ingress, "cmpl-8", [[1] * 30, [2] * 4], params, 1, info)
    assert [(r.params.max_tokens, r.params.min_tokens) for r in group.requests] == [
        (34, 34),
        (50, 40),
    ]


def _ingress(monkeypatch, info: dict[str, int] | None = None):
    """An ingress without Ray whose worker answers the engine info `info`."""
    from types import SimpleNamespace

    import cluster.api as api

    ingress_class = api.Ingress.__mro__[1]  # the class under serve.ingress's wrapper
    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="ing-1"))
    monkeypatch.setattr(api.serve, "get_replica_context", lambda: context)

    class Worker:
        def __init__(self) -> None:
            self.info = self

        def options(self, **_: object) -> Worker:
            return self

        async def remote(self, hint: RouteHint) -> dict[str, int]:
            if info is None:
                raise RuntimeError("no replica")
            return info

    return ingress_class(ClusterConfig(), Worker())


def _post(handler, body: dict) -> tuple[int, dict]:
    """Call a POST route's handler with a JSON body: (status, JSON answer)."""
    import json

    from starlette.requests import Request

    from cluster.errors import ApiError

    data = json.dumps(body).encode()

    async def receive() -> dict:
        return {"type": "http.request", "body": data, "more_body": False}

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    request = Request({"type": "http", "method": "POST", "headers": headers}, receive)
    try:
        response = asyncio.run(handler(request))
    except ApiError as exc:
        response = exc.response()
    return response.status_code, json.loads(bytes(response.body))


def test_tokenize_gives_the_ids_the_generation_routes_would_send(monkeypatch) -> None:
    """A prompt is tokenized as /v1/completions does (BOS and all), chat messages as
    /v1/chat/completions renders them; the count, the context length and, when asked, each
    token's string come with them; /detokenize turns the ids back into the text."""
    ingress = _ingress(monkeypatch, {"max_seq_len": 512})
    tok = ingress._tokenizer
    text = "The capital of France is Paris. Ünïcode, too."
    status, body = _post(ingress.tokenize, {"model": "demo", "prompt": text})
    assert status == 200
    assert body == {
        "count": len(tok.encode(text)),
        "max_model_len": 512,
        "tokens": tok.encode(text),
        "token_strs": None,
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    status, chat = _post(ingress.tokenize, {"model": "demo", "messages": messages})
    assert status == 200 and chat["tokens"] == tok.apply_chat_template(messages)
    status, open_turn = _post(
        ingress.tokenize,
        {"model": "demo", "messages": messages, "add_generation_prompt": False},
    )
    assert status == 200
    assert open_turn["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=False)
    assert open_turn["count"] < chat["count"]
    bare = {"model": "demo", "prompt": text, "add_special_tokens": False, "return_token_strs": True}
    status, plain = _post(ingress.tokenize, bare)
    assert status == 200 and plain["tokens"] == tok.encode(text, add_special_tokens=False)
    assert plain["token_strs"] == tok.hf_tokenizer.convert_ids_to_tokens(plain["tokens"])
    status, back = _post(ingress.detokenize, {"model": "demo", "tokens": plain["tokens"]})
    assert (status, back) == (200, {"prompt": text})


def test_tokenize_and_detokenize_refuse_what_they_cannot_answer(monkeypatch) -> None:
    ingress = _ingress(monkeypatch)  # no worker answers: the context length is unknown
    status, body = _post(ingress.tokenize, {"model": "demo", "prompt": "hi"})
    assert status == 200 and body["max_model_len"] is None
    vocab = ingress._tokenizer.vocab_size
    cases = [
        (ingress.tokenize, {"model": "demo"}, 400, None),
        (ingress.tokenize, {"model": "demo", "prompt": "a", "messages": []}, 400, None),
        (ingress.tokenize, {"model": "other", "prompt": "a"}, 404, "model"),
        (ingress.detokenize, {"model": "demo", "tokens": [1, vocab]}, 400, "tokens.1"),
        (ingress.detokenize, {"model": "demo", "tokens": [-1]}, 400, "tokens.0"),
        (ingress.detokenize, {"model": "demo", "tokens": "12"}, 400, "tokens"),
    ]
    for handler, body, status, param in cases:
        got, answer = _post(handler, body)
        assert got == status, (body, answer)
        if param is not None:
            assert answer["error"]["param"] == param, (body, answer)
