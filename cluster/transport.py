"""The wire format between ingress and worker replicas: msgpack, one frame per engine step.

A `submit` call carries a batch of engine requests (one or more OpenAI requests bound for
the same replica) and is answered with an *accept* frame (the replica id) or a *refuse*
frame (queue full, invalid input). The deltas of every request one ingress replica has on
a worker come on that pair's `session` stream: an accept frame, then one frame per engine
step that advanced any of them (when the reader fell behind, one frame for several steps,
still one delta per request: `worker.outputs.merge_steps`), and an empty frame (heartbeat) now and then while they wait in a queue that
keeps moving. (`generate`, for direct use, is a submit and a stream of its own in one
call.) Every frame is plain msgpack so neither side unpickles anything the other sent, and
a frame costs one small bytes object on the Serve stream.

The session's frames can also travel over a plain TCP connection to the worker instead of a
Serve stream (`ClusterConfig.frame_socket`): the accept frame of a submit then names the
address, the ingress connects and sends a hello (its id and the replica it expects), and
reads the same frames, each prefixed with its length (4 bytes, big-endian). A Serve stream
item crosses gRPC and Serve's streaming machinery in two Python processes; a socket write
does not. On the worker a `FrameWriter` lets the engine thread write a step's frame onto the
socket itself as the step ends, without a hop through the worker's event loop. Submits can
take the same way (a *submit link*: a connection whose hello says `submit`): the ingress's
router picks the replica as for a Serve call, and the submit and its answer travel over the
link, matched by an id.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from worker.outputs import RequestDelta, RequestMetrics, TokenLogprobs
from worker.sampling import SamplingParams

RefusalKind = Literal["full", "invalid", "internal", "gone"]


@dataclass(frozen=True, slots=True)
class WireRequest:
    """One engine request as the ingress sends it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Accepted:
    """The worker queued every request of the call; `frames_at` is where it serves session
    frames over a plain socket (host, port), if it does."""

    replica_id: str
    frames_at: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """The worker queued nothing: `kind` says why (full -> 429, invalid -> 400, internal -> 500;
    gone: a session call reached another replica than the one it was for)."""

    kind: RefusalKind
    message: str


def encode_requests(requests: list[WireRequest]) -> bytes:
    rows = [
        [r.request_id, r.prompt_token_ids, r.params.model_dump(exclude_defaults=True)]
        for r in requests
    ]
    return msgpack.packb(rows)


def decode_requests(payload: bytes) -> list[WireRequest]:
    rows = msgpack.unpackb(payload, strict_map_key=False)
    return [WireRequest(rid, list(ids), SamplingParams(**params)) for rid, ids, params in rows]


def encode_accepted(replica_id: str, frames_at: tuple[str, int] | None = None) -> bytes:
    if frames_at is None:
        return msgpack.packb({"accepted": replica_id})
    return msgpack.packb({"accepted": replica_id, "frames_at": list(frames_at)})


def encode_refused(kind: RefusalKind, message: str) -> bytes:
    return msgpack.packb({"refused": kind, "message": message})


def decode_first(frame: bytes) -> Accepted | Refused:
    data = msgpack.unpackb(frame)
    if "accepted" in data:
        at = data.get("frames_at")
        return Accepted(data["accepted"], None if at is None else (str(at[0]), int(at[1])))
    return Refused(data["refused"], data["message"])


# -- the session over a plain socket ---------------------------------------------------------

_LENGTH_BYTES = 4
MAX_SOCKET_FRAME = 1 << 30  # a frame is one engine step's deltas: far below this


HelloKind = Literal["session", "submit"]


def encode_hello(ingress_id: str, replica_id: str, kind: HelloKind = "session") -> bytes:
    if kind == "session":
        return msgpack.packb({"ingress": ingress_id, "replica": replica_id})
    return msgpack.packb({"ingress": ingress_id, "replica": replica_id, "kind": kind})


def decode_hello(frame: bytes) -> tuple[str, str, HelloKind]:
    """(ingress id, the replica id the ingress expects, what the connection carries)."""
    data = msgpack.unpackb(frame)
    kind = data.get("kind", "session")
    if kind not in ("session", "submit"):
        raise ValueError(f"a connection for {kind!r}")
    return str(data["ingress"]), str(data["replica"]), kind


def encode_submit(submit_id: int, num_requests: int, sender: str, payload: bytes) -> bytes:
    """A submit over a submit link: the payload of a `submit` call, with what the worker
    counts per sender (RouteHint.num_requests, .sender), and an id its answer repeats."""
    return msgpack.packb([submit_id, num_requests, sender, payload])


def decode_submit(frame: bytes) -> tuple[int, int, str, bytes]:
    submit_id, num_requests, sender, payload = msgpack.unpackb(frame)
    return int(submit_id), int(num_requests), str(sender), bytes(payload)


def encode_submit_answer(submit_id: int, answer: bytes) -> bytes:
    return msgpack.packb([submit_id, answer])


def decode_submit_answer(frame: bytes) -> tuple[int, bytes]:
    submit_id, answer = msgpack.unpackb(frame)
    return int(submit_id), bytes(answer)


def _framed(frame: bytes) -> bytes:
    return len(frame).to_bytes(_LENGTH_BYTES, "big") + frame


def write_frame(writer: asyncio.StreamWriter, frame: bytes) -> None:
    writer.write(_framed(frame))


class FrameWriter:
    """The writes onto one session socket, from two threads in one order: the engine
    thread's (`try_write`: a step's frame sent as the step ends, with no hop through the
    event loop, whose wakeup from another thread costs a lone request's first token more than
    the write) and the event loop's (`write`: frames that waited, heartbeats). The engine
    thread sends only when nothing is queued before it, and never blocks: what the socket
    does not take at once is left to the loop. `lock` orders the two; the loop holds it
    across taking frames from a stream and writing them (see `OutputStream.hand_off`)."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer
        self._transport = writer.transport
        self._loop = asyncio.get_running_loop()
        # the same connection under another descriptor: the transport's own is the loop's
        self._sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
        self.lock = threading.RLock()
        self._rest = b""  # what a send of the engine thread's left unsent: the loop's to write
        self._closed = False

    def ready(self) -> bool:
        """Nothing is queued before the next write and the connection is open (a hint;
        `try_write` checks again)."""
        transport = self._transport
        return not (
            self._rest
            or self._closed
            or transport.get_write_buffer_size()
            or transport.is_closing()
        )

    def try_write(self, frame: bytes) -> bool:
        """Any thread: send `frame` now if nothing is queued before it. False: it was not
        written (queued writes, a closed connection); the caller keeps it for `write`."""
        data = _framed(frame)
        with self.lock:
            if not self.ready():
                return False
            try:
                sent = self._sock.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError:  # it would block, or the connection failed (the loop finds out)
                return False
            if sent < len(data):
                self._rest = data[sent:]
                # a closed loop: the connection went with it
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._flush)
            return True

    def write(self, frame: bytes) -> None:
        """The loop: queue `frame` on the transport after anything queued before it."""
        with self.lock:
            self._flush()
            write_frame(self._writer, frame)

    async def drain(self) -> None:
        """Wait while the transport holds more than its high-water mark (backpressure)."""
        await self._writer.drain()

    def close(self) -> None:
        """The loop, before it closes the connection: what is left goes onto the transport
        (closing it sends that first); nothing more is sent from another thread."""
        with self.lock:
            self._flush()
            self._closed = True
            self._sock.close()

    def _flush(self) -> None:
        with self.lock:
            if self._rest:
                self._transport.write(self._rest)
                self._rest = b""


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next length-prefixed frame, or None when the other side closed between frames."""
    try:
        header = await reader.readexactly(_LENGTH_BYTES)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("the connection closed inside a frame header") from None
        return None
    size = int.from_bytes(header, "big")
    if size > MAX_SOCKET_FRAME:
        raise ConnectionError(f"a frame of {size} bytes: not a kvray session")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ConnectionError("the connection closed inside a frame") from None


def _pack_logprobs(logprobs: list[TokenLogprobs] | None) -> list[Any] | None:
    if logprobs is None:
        return None
    return [[lp.token_id, lp.logprob, list(lp.top.items())] for lp in logprobs]


def _unpack_logprobs(rows: list[Any] | None) -> list[TokenLogprobs] | None:
    if rows is None:
        return None
    return [TokenLogprobs(tid, lp, {int(k): v for k, v in top}) for tid, lp, top in rows]


def encode_deltas(deltas: list[RequestDelta]) -> bytes:
    rows = [
        [
            d.request_id,
            d.new_token_ids,
            _pack_logprobs(d.logprobs),
            d.finish_reason,
            d.error,
            d.num_prompt_tokens,
            d.num_cached_tokens,
            None if d.metrics is None else dataclasses.astuple(d.metrics),
        ]
        for d in deltas
    ]
    return msgpack.packb(rows)


def decode_deltas(frame: bytes) -> list[RequestDelta]:
    return [
        RequestDelta(
            rid,
            list(ids),
            _unpack_logprobs(lps),
            finish,
            error,
            n_prompt,
            n_cached,
            None if metrics is None else RequestMetrics(*metrics),
        )
        for rid, ids, lps, finish, error, n_prompt, n_cached, metrics in msgpack.unpackb(
            frame, strict_map_key=False
        )
    ]
