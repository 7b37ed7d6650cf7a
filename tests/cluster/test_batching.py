"""Requests that arrive together for the same replica travel in one worker call."""

from __future__ import annotations

import asyncio
import re

import httpx

from tests.cluster.conftest import Served


def batch_histogram(served: Served) -> tuple[float, float]:
    """(calls, requests) so far, from kvray:request_batch_size on /metrics."""
    text = httpx.get(f"{served.base_url}/metrics", timeout=60).text

    def value(suffix: str) -> float:
        match = re.search(rf"^kvray:request_batch_size_{suffix}\{{[^}}]*\}} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    return value("count"), value("sum")


def test_a_burst_shares_worker_calls_and_every_request_gets_its_own_answer(served: Served) -> None:
    calls_before, requests_before = batch_histogram(served)
    prompts = [f"Fact number {i} about the moon:" for i in range(6)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=served.base_url, headers=served.headers(), timeout=120
        ) as client:
            bodies = [
                {"model": "demo", "prompt": p, "max_tokens": 6, "temperature": 0} for p in prompts
            ]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 6
    calls_after, requests_after = batch_histogram(served)
    assert requests_after - requests_before == 6
    assert calls_after - calls_before < 6, "no two requests of the burst shared a call"
    # batched or not, each answer is the one its prompt gets alone (greedy)
    alone = httpx.post(
        f"{served.base_url}/v1/completions",
        json={"model": "demo", "prompt": prompts[3], "max_tokens": 6, "temperature": 0},
        headers=served.headers(),
        timeout=120,
    )
    assert responses[3].json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
