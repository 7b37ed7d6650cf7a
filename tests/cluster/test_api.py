"""The ingress's handlers without Ray: the model list, engine request ids, max_tokens."""

from __future__ import annotations

import asyncio

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
