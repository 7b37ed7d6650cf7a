"""A client that disconnects, or a stop string that hits, aborts the request on the worker."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import Served

CHAT = "/v1/chat/completions"
STORY = [{"role": "user", "content": "Write a long story about the sea."}]


def the_replica(served: Served) -> dict[str, Any]:
    [stats] = served.worker_stats().values()
    return stats


def wait_idle(served: Served, timeout_s: float = 30.0) -> dict[str, Any]:
    """Stats once nothing runs or waits and every page is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = the_replica(served)
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["num_free_pages"] == stats["num_total_pages"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"worker did not become idle: {stats}")
        time.sleep(0.1)


STREAMS = {  # route -> a long streamed request, and what starts a line of its text
    CHAT: ({"model": "demo", "messages": STORY, "max_tokens": 400, "ignore_eos": True,
            "stream": True}, "data:"),
    "/v1/responses": ({"model": "demo", "input": STORY[0]["content"], "max_output_tokens": 400,
                       "stream": True}, "event: response.output_text.delta"),
}  # fmt: skip


@pytest.mark.parametrize("route", sorted(STREAMS))
def test_disconnect_mid_stream_aborts_and_frees_every_page(served: Served, route: str) -> None:
    before = wait_idle(served)
    body, text_line = STREAMS[route]
    with httpx.stream(
        "POST", f"{served.base_url}{route}", json=body, headers=served.headers(), timeout=60
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        chunks: list[str] = []
        for line in lines:
            if line.startswith(text_line):
                chunks.append(line)
            if len(chunks) == 4:
                break
        during = the_replica(served)
        assert during["num_running"] == 1
        assert during["num_free_pages"] < before["num_free_pages"]
    started = time.monotonic()
    after = wait_idle(served, timeout_s=10)
    assert after["num_free_pages"] == before["num_free_pages"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 400
    assert time.monotonic() - started < 10


def test_stop_string_hit_aborts_the_request_on_the_worker(served: Served) -> None:
    before = wait_idle(served)
    body = {
        "model": "demo",
        "messages": STORY,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
    }
    full = httpx.post(
        f"{served.base_url}{CHAT}",
        json={**body, "max_tokens": 12},
        headers=served.headers(),
        timeout=60,
    )
    stop = full.json()["choices"][0]["message"]["content"][-4:]
    cut = httpx.post(
        f"{served.base_url}{CHAT}",
        json={**body, "stop": [stop]},
        headers=served.headers(),
        timeout=60,
    )
    assert cut.json()["choices"][0]["finish_reason"] == "stop"
    after = wait_idle(served, timeout_s=10)
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 12 + 40, "the engine kept generating after the stop string hit"
