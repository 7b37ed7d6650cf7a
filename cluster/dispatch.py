"""Ingress side of worker calls: the batching window, one call per batch, one stream per request.

An OpenAI request becomes a `Group` (its n x prompts engine requests). `Dispatcher.submit`
returns the group's `GroupStream` at once and sends the group either alone (the ingress was
idle for a window, or the window is 0) or together with every group that arrives within
`window_s` (a request batch: one Serve call, one routing decision, one msgpack frame per
engine step for all of them). A `_Call` reads the worker's frames and hands each group the
deltas of its own requests.

Failures never hang a client: a refused call, a replica that dies, a call that is not
accepted within `accept_timeout_s` or goes silent for `stall_timeout_s` ends every group of
the call with a `CallError`. While the ingress drains (shutdown), `draining` is set and
`num_open` counts the groups still being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from cluster.router import RouteHint
from cluster.transport import Refused, WireRequest, decode_deltas, decode_first, encode_requests
from worker.outputs import RequestDelta

log = logging.getLogger(__name__)

T = TypeVar("T")
ErrorKind = Literal["full", "invalid", "internal", "unavailable"]


class CallError(Exception):
    """A worker call failed for a group: `kind` maps to the HTTP status."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True, slots=True)
class Group:
    """The engine requests of one OpenAI request, and the page hashes of its prompts."""

    requests: list[WireRequest]
    page_hashes: tuple[tuple[int, ...], ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


_END = object()


class GroupStream:
    """One OpenAI request's view of its call: accept, then its deltas step by step."""

    def __init__(self, dispatcher: Dispatcher, group: Group):
        self.group = group
        self._dispatcher = dispatcher
        self._accepted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._unfinished = {r.request_id for r in group.requests}
        self._call: _Call | None = None
        self.closed = False

    async def accepted(self) -> str:
        """Wait until a worker queued the requests; its replica id. Raises CallError."""
        return await self._accepted

    def __aiter__(self) -> AsyncIterator[list[RequestDelta]]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[list[RequestDelta]]:
        await self._accepted
        # Frames may be queued after the last request finished: read them all first.
        while self._unfinished or not self._queue.empty():
            item = await self._queue.get()
            if isinstance(item, CallError):
                raise item
            if item is _END:
                return
            yield item

    def abort(self, request_ids: list[str]) -> None:
        """Stop some requests (stop string hit): free them on the worker, stop waiting for them."""
        live = [rid for rid in request_ids if rid in self._unfinished]
        self._unfinished.difference_update(live)
        if live and self._accepted.done() and not self._accepted.exception():
            self._dispatcher.send_abort(self._accepted.result(), live)
        if not self._unfinished:
            self._queue.put_nowait(_END)

    def close(self) -> None:
        """The client is gone or done: abort whatever is unfinished."""
        if self.closed:
            return
        self.closed = True
        self._dispatcher.open_streams.discard(self)
        self.abort(list(self._unfinished))
        if self._call is not None:
            self._call.group_closed()

    # -- called by _Call ------------------------------------------------------------------

    def _on_accept(self, replica_id: str) -> None:
        if not self._accepted.done():
            self._accepted.set_result(replica_id)
        if self.closed:  # closed while the call was being routed
            self._dispatcher.send_abort(replica_id, [r.request_id for r in self.group.requests])

    def _on_deltas(self, deltas: list[RequestDelta]) -> None:
        mine = [d for d in deltas if d.request_id in self._unfinished]
        for d in mine:
            if d.finished:
                self._unfinished.discard(d.request_id)
        if mine:
            self._queue.put_nowait(mine)

    def _on_error(self, error: CallError) -> None:
        if not self._accepted.done():
            self._accepted.set_exception(error)
            self._accepted.exception()  # mark retrieved: a closed group may never await it
        if self._unfinished:
            self._queue.put_nowait(error)


@dataclass
class _Call:
    """One Serve call carrying one or more groups; reads the worker's frames."""

    dispatcher: Dispatcher
    streams: list[GroupStream]
    attempt: int = 0
    by_request: dict[str, GroupStream] = field(default_factory=dict)
    response: Any = None
    accepted: bool = False

    def __post_init__(self) -> None:
        for stream in self.streams:
            stream._call = self
            for r in stream.group.requests:
                self.by_request[r.request_id] = stream

    def group_closed(self) -> None:
        if all(s.closed for s in self.streams) and self.response is not None:
            self.response.cancel()

    async def run(self) -> None:
        try:
            await self._run()
        except CallError as error:
            self._fail(error)
        except asyncio.CancelledError:
            self._fail(CallError("unavailable", "the call was cancelled"))
            raise
        except Exception as exc:  # a dead replica surfaces as a Ray error of some kind
            if all(s.closed for s in self.streams):
                return  # every client left and the call was cancelled on purpose
            if not self.accepted and self.attempt == 0:
                log.warning("worker call failed before it was accepted, retrying once: %r", exc)
                self.dispatcher.send(self.streams, attempt=1)
                return
            log.warning("worker call failed: %r", exc)
            self._fail(CallError("unavailable", f"worker failed: {type(exc).__name__}: {exc}"))

    async def _run(self) -> None:
        groups = [s.group for s in self.streams]
        hint = RouteHint(
            page_hashes=tuple(p for g in groups for p in g.page_hashes),
            num_requests=sum(len(g.requests) for g in groups),
            num_tokens=sum(g.num_tokens for g in groups),
        )
        payload = encode_requests([r for g in groups for r in g.requests])
        limits = self.dispatcher.limits
        self.response = self.dispatcher.generate_handle.remote(hint, payload)
        try:
            async with asyncio.timeout(limits.accept_timeout_s):
                first = decode_first(await self.response.__anext__())
        except TimeoutError:
            self.response.cancel()
            raise CallError(
                "unavailable",
                f"no worker accepted the request within {limits.accept_timeout_s:.0f} s",
            ) from None
        if isinstance(first, Refused):
            await self._finish_stream()
            self._refused(first)
            return
        self.accepted = True
        for stream in self.streams:
            stream._on_accept(first.replica_id)
        await self._pump(limits.stall_timeout_s)

    async def _finish_stream(self) -> None:
        """Read a refused call to its end: Serve counts a call as ongoing until then."""
        async with asyncio.timeout(self.dispatcher.limits.accept_timeout_s):
            async for _ in self.response:
                pass

    def _refused(self, refusal: Refused) -> None:
        if refusal.kind in ("invalid", "full") and len(self.streams) > 1:
            # One bad group fails the whole batch, and a batch may not fit the queue where
            # its groups would one by one: send each group alone to get each its own answer.
            for stream in self.streams:
                self.dispatcher.send([stream])
            return
        self._fail(CallError(refusal.kind, refusal.message))

    async def _pump(self, stall_timeout_s: float) -> None:
        iterator = self.response.__aiter__()
        while True:
            try:
                async with asyncio.timeout(stall_timeout_s):
                    frame = await iterator.__anext__()
            except StopAsyncIteration:
                break
            except TimeoutError:
                self.response.cancel()
                raise CallError(
                    "unavailable", f"the worker sent nothing for {stall_timeout_s:.0f} s"
                ) from None
            per_stream: dict[int, list[RequestDelta]] = {}
            for delta in decode_deltas(frame):
                stream = self.by_request.get(delta.request_id)
                if stream is not None:
                    per_stream.setdefault(id(stream), []).append(delta)
            for stream in self.streams:
                if id(stream) in per_stream:
                    stream._on_deltas(per_stream[id(stream)])
        self._fail(CallError("internal", "the worker ended the stream early"))

    def _fail(self, error: CallError) -> None:
        for stream in self.streams:
            stream._on_error(error)


def in_own_context(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run a worker call outside the HTTP request's context.

    A handle call made inside a request inherits that request's Serve request id
    (a contextvar). Batched calls, retries and aborts would then share one id with other
    calls in flight, and Serve's router matches a routing decision to its pending call by
    that id. In an empty context every call gets an id of its own."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


class Dispatcher:
    """Batches groups within a window and sends each batch as one streaming worker call."""

    def __init__(
        self,
        worker_handle: Any,
        window_s: float,
        max_batch: int,
        limits: Any,
        on_call: Callable[[int], None] = lambda num_requests: None,
    ):
        """`on_call(num_requests)` is told the size of every call sent (a metric)."""
        self._on_call = on_call
        self.generate_handle = worker_handle.options(method_name="generate", stream=True)
        self._abort_handle = worker_handle.options(method_name="abort")
        self.limits = limits
        self._window_s = window_s
        self._max_batch = max_batch
        self._pending: list[GroupStream] = []
        self._pending_requests = 0
        self._flush_timer: asyncio.TimerHandle | None = None
        self._last_send = -1e9
        self._tasks: set[asyncio.Task[None]] = set()
        self.open_streams: set[GroupStream] = set()  # submitted and not yet closed
        self.draining = False  # set once at shutdown: the ingress refuses new requests

    @property
    def num_open(self) -> int:
        """Requests this ingress still serves (a drain waits for this to reach 0)."""
        return len(self.open_streams)

    def submit(self, group: Group) -> GroupStream:
        stream = GroupStream(self, group)
        self.open_streams.add(stream)
        now = time.monotonic()
        idle = not self._pending and now - self._last_send > self._window_s
        if self._window_s <= 0 or idle:
            self._last_send = now
            self.send([stream])
            return stream
        self._pending.append(stream)
        self._pending_requests += len(group.requests)
        if self._pending_requests >= self._max_batch:
            self._flush()
        elif len(self._pending) == 1:
            self._flush_timer = asyncio.get_running_loop().call_later(self._window_s, self._flush)
        return stream

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        batch, self._pending, self._pending_requests = self._pending, [], 0
        self._last_send = time.monotonic()
        for calls in _by_leading_page(s for s in batch if not s.closed):
            self.send(calls)

    def send(self, streams: list[GroupStream], attempt: int = 0) -> None:
        self._on_call(sum(len(s.group.requests) for s in streams))
        self._spawn(_Call(self, streams, attempt).run())

    def send_abort(self, replica_id: str, request_ids: list[str]) -> None:
        self._spawn(self._abort(replica_id, request_ids))

    async def _abort(self, replica_id: str, request_ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # the replica may be gone: nothing left to free
            async with asyncio.timeout(self.limits.accept_timeout_s):
                await self._abort_handle.remote(RouteHint(replica_id=replica_id), request_ids)

    def _spawn(self, coro: Any) -> None:
        task = in_own_context(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _by_leading_page(streams: Iterable[GroupStream]) -> list[list[GroupStream]]:
    """Split a window's batch so that one call never mixes prompts that open differently.

    A call is routed as a whole, so a batch of unrelated prompts would drag every prompt to
    the replica that suits the first; grouping by the first page's hash keeps each call
    bound for the replica its prefix is cached on. Prompts without hashes (shorter than a
    page, or prefix affinity off) travel together."""
    calls: dict[int | None, list[GroupStream]] = {}
    for stream in streams:
        hashes = stream.group.page_hashes
        key = hashes[0][0] if hashes and hashes[0] else None
        calls.setdefault(key, []).append(stream)
    return list(calls.values())


def rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; 0 elsewhere): what the soak watches."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
