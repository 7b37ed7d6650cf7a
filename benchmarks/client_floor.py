"""The floor under a first token over HTTP: `kvray bench serve`'s client (aiohttp) against a
server that answers at once, and a bare socket against the same server.

Through Serve, a request's time to first token includes the load generator's own work: build
the request, write it, wake up for the response, parse the chunked body and the SSE line. The
in-process engine's way has none of it. This measures that part alone, on loopback, with a
server that does nothing (asyncio streams: one SSE chunk as soon as the body is read), so the
Serve path's figures can be read against it.

    python -m benchmarks.client_floor [--requests 400] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

from benchmarks import write_result
from benchmarks.serve import http_client

CHUNK = b'data: {"id":"cmpl-0","object":"text_completion","choices":[{"index":0,"text":" a"}]}\n\n'
ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHUNK), CHUNK)
)
BODY = {"model": "m", "prompt": list(range(1000, 1064)), "max_tokens": 16, "stream": True}
GAP_S = 0.02  # between requests: each finds both sides idle, as a lone request does


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One SSE chunk for each request on this connection, as soon as its body is in."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            writer.write(ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _serve(port: int, ready: multiprocessing.synchronize.Event) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_answer, "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def by_aiohttp(port: int, requests: int) -> list[float]:
    """TTFT of `kvray bench serve`'s client: its session, a streamed POST, the first SSE line."""
    ttfts = []
    async with http_client(f"http://127.0.0.1:{port}", 1, 60.0) as client:
        for _ in range(requests):
            start = time.perf_counter()
            async with client.post("/v1/completions", json=BODY) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        ttfts.append(time.perf_counter() - start)
                        break
                await response.read()
            await asyncio.sleep(GAP_S)
    return ttfts


async def by_socket(port: int, requests: int) -> list[float]:
    """TTFT of a bare socket: the same bytes written, read up to the first SSE line."""
    ttfts = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(requests):
        start = time.perf_counter()
        body = json.dumps(BODY).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await reader.readuntil(b"data: {")
        ttfts.append(time.perf_counter() - start)
        await reader.readuntil(b"0\r\n\r\n")
        await asyncio.sleep(GAP_S)
    writer.close()
    return ttfts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2, help="each client this many times, alternated")
    ap.add_argument("--port", type=int, default=18777)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve, args=(args.port, ready), daemon=True)
    server.start()
    ready.wait(30)
    clients: dict[str, Callable[[int, int], Coroutine[Any, Any, list[float]]]] = {
        "aiohttp": by_aiohttp,
        "socket": by_socket,
    }
    p50s: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for _ in range(args.rounds):
            for name, client in clients.items():
                ttfts = asyncio.run(client(args.port, args.requests))
                p50s[name].append(1e3 * statistics.median(ttfts[20:]))  # past the warm-up
                print(f"{name:8} TTFT p50 {p50s[name][-1]:.3f} ms", flush=True)
    finally:
        server.terminate()
    write_result(args.out, args, ttft_p50_ms=p50s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
