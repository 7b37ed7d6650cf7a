"""Two worker replicas on two nodes of a `ray.cluster_utils.Cluster` (a custom resource per
node stands in for a GPU): spreading, prefix affinity, spill under load, replica death."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray

from cluster.api import REPLICA_HEADER
from tests.cluster.conftest import RayHarness, Served
from worker.sampling import SamplingParams
from worker.validation import EngineRequest

DOC = (
    " ".join(
        f"Clause {i}: the tenant keeps the garden tidy and pays rent on day {i}." for i in range(16)
    )
    + "\n"
)


@pytest.fixture(scope="module")
def two(ray_harness: RayHarness) -> Iterator[Served]:
    config = {
        "worker_replicas": 2,
        "advanced": {"router": {"stats_period_s": 0.2, "imbalance_threshold": 2}},
    }
    served = ray_harness.multinode_app(worker_nodes=2, worker_config=config)
    yield served
    ray_harness.stop()


def complete(served: Served, prompt: str, max_tokens: int = 4, **extra: Any) -> httpx.Response:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def test_replicas_run_on_both_worker_nodes(two: Served) -> None:
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("fake_gpu")}
    assert len(nodes) == 2
    assert len(two.worker_stats()) == 2


def test_concurrent_requests_spread_across_both_replicas(two: Served) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=two.base_url, timeout=120) as client:
            bodies = [
                {
                    "model": "demo",
                    "prompt": f"Story {i}: once upon a time",
                    "max_tokens": 24,
                    "ignore_eos": True,
                }
                for i in range(8)
            ]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    assert len({r.headers[REPLICA_HEADER] for r in responses}) == 2


def test_repeated_long_prefix_sticks_to_one_replica_and_hits_its_cache(two: Served) -> None:
    before = two.worker_stats()
    served_by = [
        complete(two, f"{DOC}Question {i}: who keeps the garden?").headers[REPLICA_HEADER]
        for i in range(6)
    ]
    assert len(set(served_by)) == 1, served_by
    home = served_by[0]
    after = two.worker_stats()
    hits = {rid: after[rid]["prefix_hits"] - before[rid]["prefix_hits"] for rid in after}
    pages = len(DOC) // 4 // 16  # a lower bound of the document's full pages (>= 4 chars a token)
    assert hits[home] >= 5 * pages
    assert after[home]["prefix_hit_rate"] > before[home]["prefix_hit_rate"]


def drain(response: Any, stop: threading.Event) -> None:
    """Read a session until `stop`, then cancel it from this thread: a response generator is
    not thread-safe, and a cancel from another thread while this one waits in next() races
    it (the likely cause of a flood that ran on past its cancel, 1 run in 10)."""
    with contextlib.suppress(Exception):
        for _ in response:
            if stop.is_set():
                break
        response.cancel()


def flood(two: Served, replica_id: str, count: int, stop: threading.Event) -> None:
    """Start `count` long generations on one replica, straight through a worker handle; each
    session is cancelled once `stop` is set (by its reader, at its next frame)."""
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
    for i in range(count):
        request = EngineRequest(f"flood-{i}", [1000 + i] * 40, params)
        response = two.open_on(replica_id, [request])
        threading.Thread(target=drain, args=(response, stop), daemon=True).start()


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_prefix_requests_spill_from_a_flooded_replica(two: Served) -> None:
    home = complete(two, f"{DOC}Question: who pays rent?").headers[REPLICA_HEADER]
    stop = threading.Event()
    flood(two, home, 4, stop)
    try:
        wait_for(lambda: two.worker_stats()[home]["num_running"] >= 4, 30, "the flood to run")
        time.sleep(0.5)  # let the routers see the flooded replica's report
        spilled = [
            complete(two, f"{DOC}Question {i}: when is rent due?").headers[REPLICA_HEADER]
            for i in range(3)
        ]
        assert all(rid != home for rid in spilled), (home, spilled)
    finally:
        stop.set()
    wait_for(lambda: two.worker_stats()[home]["num_running"] == 0, 30, "the flood to be aborted")


def replica_actor(replica_id: str) -> Any:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"#{replica_id}"):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise LookupError(replica_id)


def test_killing_a_replica_under_load_never_hangs_a_client(two: Served) -> None:
    async def stream_one(client: httpx.AsyncClient, i: int, started: asyncio.Queue[str]) -> str:
        body = {
            "model": "demo",
            "prompt": f"Tale {i}:",
            "max_tokens": 48,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            await started.put(response.headers[REPLICA_HEADER])
            lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        return "error" if any('"error"' in line for line in lines) else "ok"

    async def load_and_kill() -> tuple[list[str], str]:
        started: asyncio.Queue[str] = asyncio.Queue()
        async with httpx.AsyncClient(base_url=two.base_url, timeout=120) as client:
            tasks = [asyncio.create_task(stream_one(client, i, started)) for i in range(6)]
            victim = await started.get()
            await asyncio.sleep(0.5)
            ray.kill(replica_actor(victim), no_restart=True)
            async with asyncio.timeout(90):  # the bound: every client finishes or fails by then
                outcomes = await asyncio.gather(*tasks)
        return outcomes, victim

    outcomes, victim = asyncio.run(load_and_kill())
    assert set(outcomes) <= {"ok", "error"} and "error" in outcomes
    for i in range(4):
        assert complete(two, f"After the crash {i}:").headers[REPLICA_HEADER] != victim
    wait_for(
        lambda: len(two.worker_stats()) == 2 and victim not in two.worker_stats(),
        180,
        "Serve to replace the replica",
    )
