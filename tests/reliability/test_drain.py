"""Graceful shutdown: scaling the workers down lets running streams finish; a draining
ingress (what `kvray serve` does on SIGTERM) refuses new requests with 503 + Retry-After
and fails /health while its running requests finish. Last module: it shrinks the app."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
from ray import serve

from cluster.api import REPLICA_HEADER
from cluster.app import build_app
from cluster.cli import drain_ingress
from tests.cluster.conftest import Served, wait_healthy
from tests.reliability.conftest import completion_body, ingress_handle, post, wait_all_idle


async def one_stream(client: httpx.AsyncClient, i: int, started: asyncio.Queue[str]) -> str:
    """A long stream; the finish reason of its last chunk, or 'error'."""
    body = completion_body(f"Epic {i}:", max_tokens=80, ignore_eos=True, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        # put before asserting: a refused stream must fail the test, not leave it waiting
        await started.put(response.headers.get(REPLICA_HEADER, f"HTTP {response.status_code}"))
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    if any("error" in c for c in chunks):
        return "error"
    return str(chunks[-1]["choices"][0]["finish_reason"])


def test_scaling_workers_down_lets_running_streams_finish(app: Served) -> None:
    wait_all_idle(app)
    smaller = app.config.model_copy(update={"worker_replicas": 1})

    async def scenario() -> tuple[set[str], list[str]]:
        started: asyncio.Queue[str] = asyncio.Queue()
        async with httpx.AsyncClient(base_url=app.base_url, timeout=300) as client:
            # one at a time, each once the previous is accepted: four requests inside one
            # batching window would travel in one call to one replica. Two ingress routers
            # that each see reports 0.2 s old may send a few in a row to one replica (seen:
            # four), so more follow, up to eight, until both replicas run some.
            tasks, replicas = [], set()
            while len(tasks) < 4 or (len(replicas) < 2 and len(tasks) < 8):
                tasks.append(asyncio.create_task(one_stream(client, len(tasks), started)))
                replicas.add(await asyncio.wait_for(started.get(), 120))
            redeploy = threading.Thread(
                target=serve.run,
                args=(build_app(smaller),),
                kwargs={"name": "kvray", "route_prefix": "/"},
            )
            redeploy.start()
            outcomes = await asyncio.gather(*tasks)
            await asyncio.to_thread(redeploy.join, 300)
        return replicas, outcomes

    replicas, outcomes = asyncio.run(scenario())
    assert len(replicas) == 2, "the streams should have run on both replicas"
    assert outcomes == ["length"] * len(outcomes)
    app.config = smaller
    wait_healthy(app)
    wait_all_idle(app, replicas=1)
    assert post(app, "/v1/completions", completion_body("Smaller now:")).status_code == 200


def test_draining_ingress_refuses_new_requests_and_finishes_running_ones(app: Served) -> None:
    """`kvray serve`'s SIGTERM path: drain_ingress returns once the running stream ended."""

    def draining() -> bool:
        status = ingress_handle().broadcast("drain_status").results(timeout_s=30)
        return all(s["draining"] for s in status)

    async def scenario() -> tuple[str, httpx.Response, httpx.Response, bool]:
        started: asyncio.Queue[str] = asyncio.Queue()
        async with httpx.AsyncClient(base_url=app.base_url, timeout=300) as client:
            running = asyncio.create_task(one_stream(client, 0, started))
            await asyncio.wait_for(started.get(), 120)
            drain = asyncio.create_task(asyncio.to_thread(drain_ingress, app.config))
            while not await asyncio.to_thread(draining):
                await asyncio.sleep(0.2)
            refused = await client.post("/v1/completions", json=completion_body("Too late:"))
            health = await client.get("/health")
            outcome = await running
            drain_waited = not drain.done()  # it waits for the stream's end, then polls
            async with asyncio.timeout(120):
                await drain
            return outcome, refused, health, drain_waited

    outcome, refused, health, drain_waited = asyncio.run(scenario())
    assert outcome == "length" and drain_waited
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert refused.json()["error"]["code"] == "draining"
    assert health.status_code == 503
    status = ingress_handle().broadcast("drain_status").results(timeout_s=30)
    assert all(s["draining"] and s["in_flight"] == 0 for s in status)
