"""A stand-in for kvray's streaming `/v1/completions` with no engine behind it: a client run
against it measures what the client alone carries (`kvray bench cluster --scenarios front`
reports it beside each figure).

Every request is answered at once: for `max_tokens` tokens, `max_tokens x chunks_per_token`
SSE events (at least one; the real run's share, below 1 where a worker merged steps into
one frame) shaped as the real server's (`Completion` chunks, the last with its
finish_reason), a usage event counting `max_tokens`, then `[DONE]`, as HTTP/1.1 chunks.
Between events the server yields to its event loop, so the open streams interleave event by
event as from a server stepping a batch. It runs in as many processes as the client, on one
port (SO_REUSEPORT); a process of it writes prepared bytes where a client process parses
JSON, so the client is what waits.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cluster.local_ray import free_port
from cluster.protocol import Completion, CompletionChoice, Usage

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def _event(data: str) -> bytes:
    """One SSE event as one HTTP/1.1 chunk."""
    event = f"data: {data}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(event), event)


def _completion(finish: str | None = None, usage: Usage | None = None) -> str:
    choices = [] if usage else [CompletionChoice(index=0, text=" x", finish_reason=finish)]
    chunk = Completion(id="cmpl-stub", created=0, model="stub", choices=choices, usage=usage)
    return chunk.model_dump_json()


class Answers:
    """The events of every answer, all but the usage event built once."""

    def __init__(self, chunks_per_token: float) -> None:
        self.chunks_per_token = chunks_per_token
        self.token = _event(_completion())
        self.last = _event(_completion("length"))
        self.done = _event("[DONE]")

    def events(self, tokens: int, prompt_tokens: int) -> list[bytes]:
        chunks = max(1, round(tokens * self.chunks_per_token))
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=tokens,
            total_tokens=prompt_tokens + tokens,
        )
        return [self.token] * (chunks - 1) + [
            self.last,
            _event(_completion(usage=usage)),
            self.done,
        ]


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


async def _answer(reader: asyncio.StreamReader, writer: Any, answers: Answers) -> None:
    """Every request of one keep-alive connection, in turn."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            body = json.loads(await reader.readexactly(_content_length(head)) or b"{}")
            writer.write(HEAD)
            for event in answers.events(
                int(body.get("max_tokens", 16)), len(body.get("prompt", []))
            ):
                writer.write(event)
                await asyncio.sleep(0)  # the other streams' events go out between this one's
            writer.write(LAST_CHUNK)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the client closed the connection
    finally:
        writer.close()


def _serve(port: int, chunks_per_token: float, ready: Any) -> None:
    """One stub process: serve on `port` until terminated."""

    async def main() -> None:
        answers = Answers(chunks_per_token)
        server = await asyncio.start_server(
            lambda r, w: _answer(r, w, answers), "127.0.0.1", port, reuse_port=True, backlog=4096
        )
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


@contextmanager
def running(procs: int, chunks_per_token: float) -> Iterator[str]:
    """`procs` stub processes on one free port of 127.0.0.1 for the block; its base URL."""
    context = multiprocessing.get_context("spawn")
    port, started = free_port(), []
    try:
        for _ in range(procs):
            ready = context.Event()
            proc = context.Process(target=_serve, args=(port, chunks_per_token, ready), daemon=True)
            proc.start()
            started.append(proc)
            if not ready.wait(60):
                raise RuntimeError("an SSE stub process did not start within 60 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        for proc in started:
            proc.terminate()
            proc.join(10)
