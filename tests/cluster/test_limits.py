"""The default request limits through HTTP, at their edges: what is at a limit passes,
one past it is refused, and an oversized body is refused before it has been read.

The two raw-socket tests send a request whose body never ends (or never starts): an
answer can only come if the ingress refused by Content-Length, or stopped reading a
chunked body at the limit.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.cluster.conftest import Served

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
TIMEOUT_S = 60


def body(served: Served, **fields: Any) -> dict[str, Any]:
    return {"model": served.config.model_name, "messages": MESSAGES, "max_tokens": 2, **fields}


def post(served: Served, content: bytes, **headers: str) -> httpx.Response:
    sent = {**served.headers(), "Content-Type": "application/json", **headers}
    sent = {k: v for k, v in sent.items() if v}
    return httpx.post(f"{served.base_url}{CHAT}", content=content, headers=sent, timeout=TIMEOUT_S)


def test_stop_lists_at_the_default_limits_pass(served: Served) -> None:
    limits = served.config.advanced.limits
    stops = [f"zq{i}" for i in range(limits.max_stop - 1)] + ["z" * limits.max_stop_chars]
    ok = post(served, json.dumps(body(served, stop=stops)).encode())
    assert ok.status_code == 200, ok.text
    ids = list(range(limits.max_stop_token_ids))
    ok = post(served, json.dumps(body(served, stop_token_ids=ids, min_tokens=0)).encode())
    assert ok.status_code == 200, ok.text
    over = post(served, json.dumps(body(served, stop=[*stops, "one more"])).encode())
    assert (over.status_code, over.json()["error"]["param"]) == (400, "stop")


def test_json_without_a_content_type_or_with_a_charset_is_read(served: Served) -> None:
    raw = json.dumps(body(served)).encode()
    assert post(served, raw, **{"Content-Type": ""}).status_code == 200
    assert (
        post(served, raw, **{"Content-Type": "application/json; charset=utf-8"}).status_code == 200
    )


def test_a_body_of_exactly_the_limit_passes_and_one_byte_more_is_413(served: Served) -> None:
    limit = served.config.advanced.limits.max_request_bytes
    raw = json.dumps(body(served)).encode()
    at_limit = raw + b" " * (limit - len(raw))  # trailing whitespace is valid JSON
    assert post(served, at_limit).status_code == 200
    over = post(served, at_limit + b" ")
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"


def _raw_request(served: Served, headers: str, chunks: list[bytes]) -> bytes:
    """Send a request head and some body, never end the body, and read the answer's head."""
    url = urlsplit(served.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=TIMEOUT_S) as sock:
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Authorization: Bearer {served.api_key}\r\nContent-Type: application/json\r\n"
            f"{headers}\r\n"
        )
        sock.sendall(head.encode())
        for chunk in chunks:
            sock.sendall(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer


def test_a_declared_oversize_body_is_refused_before_it_is_sent(served: Served) -> None:
    started = time.monotonic()
    answer = _raw_request(served, f"Content-Length: {10 * 1024 * 1024}\r\n", [])
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.monotonic() - started < 30


def test_an_endless_chunked_body_is_refused_once_past_the_limit(served: Served) -> None:
    limit = served.config.advanced.limits.max_request_bytes
    piece = b"a" * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    count = limit // len(piece) + 2  # just past the limit; the terminating chunk never comes
    answer = _raw_request(served, "Transfer-Encoding: chunked\r\n", [chunk] * count)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
