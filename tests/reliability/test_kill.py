"""Killing replicas: a worker's streaming clients get an error promptly, requests sent
right after the kill are served by the other worker, Serve replaces the worker; with two
ingress replicas, the other one keeps serving. (tests/cluster/test_multinode.py covers a
worker killed under load across nodes; these add the retry of requests not yet started,
the ingress, and the replacement's freshness.)"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import ray

from cluster.api import REPLICA_HEADER
from tests.cluster.conftest import Served
from tests.reliability.conftest import completion_body, post, wait_all_idle


def replica_actors(deployment: str) -> dict[str, Any]:
    """Live Serve replica actors of one deployment, by replica id."""
    actors = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if f"#{deployment}#" in name:
            actors[name.rsplit("#", 1)[1]] = ray.get_actor(name, namespace=actor["namespace"])
    return actors


async def stream_outcome(
    client: httpx.AsyncClient, i: int, started: asyncio.Queue[str]
) -> tuple[str, str]:
    body = completion_body(f"Saga {i}:", max_tokens=64, ignore_eos=True, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        replica = response.headers[REPLICA_HEADER]
        await started.put(replica)
        lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    errors = [json.loads(line[6:]) for line in lines[:-1] if '"error"' in line]
    return replica, "error" if errors else "ok"


def test_killing_a_worker_fails_its_streams_and_later_requests_go_elsewhere(app: Served) -> None:
    wait_all_idle(app)

    async def scenario() -> tuple[str, list[tuple[str, str]], list[httpx.Response]]:
        started: asyncio.Queue[str] = asyncio.Queue()
        async with httpx.AsyncClient(base_url=app.base_url, timeout=120) as client:
            tasks = [asyncio.create_task(stream_outcome(client, i, started)) for i in range(4)]
            victim = await started.get()
            await asyncio.sleep(0.3)
            ray.kill(replica_actors("KvrayWorker")[victim], no_restart=True)
            # sent at once: some are routed to the dead replica before Serve knows
            later = [
                client.post("/v1/completions", json=completion_body(f"After {i}:"))
                for i in range(6)
            ]
            async with asyncio.timeout(90):  # the bound: nobody hangs
                streams = await asyncio.gather(*tasks)
                responses = await asyncio.gather(*later)
        return victim, streams, responses

    victim, streams, responses = asyncio.run(scenario())
    assert {outcome for replica, outcome in streams if replica == victim} == {"error"}
    assert {outcome for replica, outcome in streams if replica != victim} <= {"ok"}
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
    assert all(r.headers[REPLICA_HEADER] != victim for r in responses)
    deadline = time.monotonic() + 180
    while True:  # Serve starts a replacement with a fresh engine: every page free
        stats = app.worker_stats()
        if len(stats) == 2 and victim not in stats:
            break
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
        time.sleep(1)
    wait_all_idle(app, timeout_s=120)
    assert post(app, "/v1/completions", completion_body("Replaced:")).status_code == 200


def test_killing_one_ingress_replica_leaves_the_other_serving(app: Served) -> None:
    ingress = replica_actors("KvrayIngress")
    assert len(ingress) == 2
    victim = sorted(ingress)[0]
    ray.kill(ingress[victim], no_restart=True)
    statuses = [
        post(app, "/v1/completions", completion_body(f"Still here {i}:")).status_code
        for i in range(8)
    ]
    assert statuses == [200] * 8
