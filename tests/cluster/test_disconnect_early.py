"""A streaming client that leaves before the first byte of its response aborts its request.

The client writes a whole request on a raw socket and closes it after a short delay, before
any response byte arrives: while the ingress tokenizes, waits for a worker to accept, or
has just returned its streaming response. In every case the request must be aborted on the
worker and its pages freed within a few steps, not run to `max_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from starlette.responses import StreamingResponse

from cluster.generation import ClosingStreamingResponse
from tests.cluster.conftest import Served
from tests.cluster.test_cancellation import STORY, wait_idle

MAX_TOKENS = 400


def gone_before_first_byte(response_class: Any) -> list[str]:
    """Serve one streaming response to a client whose disconnect is already queued, the way
    uvicorn and Serve's proxy present it (ASGI 2.3); what the body and close saw."""
    seen: list[str] = []

    async def body() -> AsyncIterator[str]:
        try:
            seen.append("body started")
            yield "data: {}\n\n"
            await asyncio.sleep(30)
        finally:
            seen.append("body cleaned up")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0.01)  # the proxy takes a moment to take each message

    async def serve_one() -> None:
        extra = (
            {"on_close": lambda: seen.append("closed")}
            if response_class is not StreamingResponse
            else {}
        )
        response = response_class(body(), **extra)
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await asyncio.wait_for(response(scope, receive, send), timeout=10)

    asyncio.run(serve_one())
    return seen


def test_plain_streaming_response_never_cleans_up_a_body_it_never_started() -> None:
    """The cause of the gap: the body generator never runs, so its `finally` never does."""
    assert gone_before_first_byte(StreamingResponse) == []


def test_closing_response_closes_when_the_client_left_before_the_first_byte() -> None:
    assert gone_before_first_byte(ClosingStreamingResponse) == ["closed"]


def send_and_leave(served: Served, delay_s: float) -> None:
    """POST a long streaming chat request, wait `delay_s`, close without reading a byte."""
    url = urlsplit(served.base_url)
    body = json.dumps(
        {
            "model": "demo",
            "messages": STORY,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Authorization: Bearer {served.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head + body)
        time.sleep(delay_s)
        # RST instead of FIN: the peer sees the connection gone at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


@pytest.mark.parametrize("delay_s", [0.0, 0.02, 0.05, 0.1])
def test_disconnect_before_first_byte_frees_the_request(served: Served, delay_s: float) -> None:
    before = wait_idle(served)
    send_and_leave(served, delay_s)
    after = wait_idle(served, timeout_s=20)
    assert after["num_free_pages"] == before["num_free_pages"]
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < MAX_TOKENS // 2, (
        f"the request ran on after its client left ({generated} tokens)"
    )


def test_a_burst_of_early_leavers_frees_every_page(served: Served) -> None:
    """Six clients leave at staggered moments around the accept; none of them keeps running."""
    before = wait_idle(served)
    threads = [threading.Thread(target=send_and_leave, args=(served, 0.015 * i)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = wait_idle(served, timeout_s=30)
    assert after["num_free_pages"] == before["num_free_pages"]
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 6 * MAX_TOKENS // 4, f"early leavers kept generating ({generated} tokens)"
