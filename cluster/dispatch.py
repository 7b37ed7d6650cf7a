"""Ingress side of worker calls: the batching window, one submit per batch, one frame
stream per worker replica.

An OpenAI request becomes a `Group` (its n x prompts engine requests). `Dispatcher.submit`
returns the group's `GroupStream` at once and sends the group either alone (the ingress was
idle for a window, or the window is 0) or together with every group that arrives within
`window_s` (a request batch: one `submit` Serve call, one routing decision). An accepted
group's deltas come on the `_Session` this ingress holds with that replica: one long-lived
Serve stream per (ingress, worker) pair, one item per engine step for all of this ingress's
requests there, however many calls brought them. (A stream per call would cost the worker
and the ingress one Ray item per call per step: at 512 running requests that, not the GPU,
set the step time.) A session ends when nothing of this ingress is left unfinished on its
replica and the next accepted submit opens a new one.

Failures never hang a client: a refused submit, a replica that dies, a submit not
accepted within `accept_timeout_s`, or a session silent for `stall_timeout_s` ends the
groups concerned with a `CallError`. A submit that fails before it is accepted is sent once
more (the router picks again). Nor does a client that left keep a request running: a
request whose deltas still come `REABORT_S` after no stream wants them (an abort lost, or
sent before its submit's duplicate was accepted) is aborted again. While the ingress drains (shutdown), `draining` is set and
`num_open` counts the groups still being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from cluster.router import RouteHint
from cluster.transport import Accepted, Refused, decode_deltas, decode_first, encode_requests
from worker.outputs import RequestDelta
from worker.validation import EngineRequest

log = logging.getLogger(__name__)

T = TypeVar("T")
# A request no stream wants that still steps this long after is aborted again.
REABORT_S = 1.0
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

    requests: list[EngineRequest]
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
        self.started = False  # a token of it has been delivered
        self.closed = False

    async def accepted(self) -> str:
        """Wait until a worker queued the requests; its replica id. Raises CallError."""
        # shielded: a cancelled waiter (the client left) must not cancel the shared future,
        # or `_on_accept` could no longer tell an accepted-then-closed group from a failed one
        return await asyncio.shield(self._accepted)

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

    def wants(self, request_id: str) -> bool:
        """Whether this stream still waits for deltas of `request_id`."""
        return request_id in self._unfinished

    def close(self) -> None:
        """The client is gone or done: abort whatever is unfinished."""
        if self.closed:
            return
        self.closed = True
        self._dispatcher.open_streams.discard(self)
        self.abort(list(self._unfinished))

    # -- called by _Submit and _Session -----------------------------------------------------

    def _on_accept(self, replica_id: str) -> None:
        if not self._accepted.done():
            self._accepted.set_result(replica_id)
        if self.closed:  # closed while the call was being routed
            self._dispatcher.send_abort(replica_id, [r.request_id for r in self.group.requests])

    def _on_deltas(self, deltas: list[RequestDelta]) -> None:
        mine = [d for d in deltas if d.request_id in self._unfinished]
        for d in mine:
            self.started = self.started or bool(d.new_token_ids)
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
class _Submit:
    """One `submit` call carrying one or more groups: routed, then accepted or refused."""

    dispatcher: Dispatcher
    streams: list[GroupStream]
    attempt: int = 0

    async def run(self) -> None:
        try:
            accepted = await self._submit()
        except CallError as error:
            self._fail(error)
            return
        except asyncio.CancelledError:
            self._fail(CallError("unavailable", "the call was cancelled"))
            raise
        except Exception as exc:  # a dead replica surfaces as a Ray error of some kind
            if self.attempt == 0:
                log.warning("worker call failed before it was accepted, retrying once: %r", exc)
                self.dispatcher.send(self.streams, attempt=1)
                return
            log.warning("worker call failed: %r", exc)
            self._fail(CallError("unavailable", f"worker failed: {type(exc).__name__}: {exc}"))
            return
        if accepted is not None:
            self.dispatcher.session(accepted.replica_id).add(self.streams)
            for stream in self.streams:
                stream._on_accept(accepted.replica_id)

    def _fail(self, error: CallError) -> None:
        self.dispatcher.forget(self.streams)
        _fail(self.streams, error)

    async def _submit(self) -> Accepted | None:
        """The accepting replica's answer, or None when the batch was refused (and handled)."""
        groups = [s.group for s in self.streams]
        hint = RouteHint(
            page_hashes=tuple(p for g in groups for p in g.page_hashes),
            num_requests=sum(len(g.requests) for g in groups),
            num_tokens=sum(g.num_tokens for g in groups),
            sender=self.dispatcher.ingress_id,
        )
        payload = encode_requests([r for g in groups for r in g.requests])
        dispatcher = self.dispatcher
        timeout_s = dispatcher.accept_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                answer = decode_first(
                    await dispatcher.submit_handle.remote(hint, payload, dispatcher.ingress_id)
                )
        except TimeoutError:
            raise CallError(
                "unavailable", f"no worker accepted the request within {timeout_s:.0f} s"
            ) from None
        if isinstance(answer, Refused):
            self._refused(answer)
            return None
        return answer

    def _refused(self, refusal: Refused) -> None:
        if refusal.kind in ("invalid", "full") and len(self.streams) > 1:
            # One bad group fails the whole batch, and a batch may not fit the queue where
            # its groups would one by one: send each group alone to get each its own answer.
            for stream in self.streams:
                self.dispatcher.send([stream])
            return
        kind = "unavailable" if refusal.kind == "gone" else refusal.kind
        self._fail(CallError(kind, refusal.message))


class _Session:
    """This ingress's frame stream from one worker replica: the deltas of every request
    it has there, one item per engine step (see the module docstring)."""

    def __init__(self, dispatcher: Dispatcher, replica_id: str):
        self.dispatcher = dispatcher
        self.replica_id = replica_id
        self.request_ids: set[str] = set()  # accepted here, not yet finished on the worker
        self._task: asyncio.Task[None] | None = None
        # requests still stepping that no stream wants (aborted, or their client left):
        # when one was first seen so, or its abort last sent again
        self._unwanted: dict[str, float] = {}

    def add(self, streams: list[GroupStream]) -> None:
        """Requests accepted by this replica (those whose last delta came already excepted:
        an open session can deliver before the submit's answer is read)."""
        live = self.dispatcher.live
        self.request_ids.update(
            r.request_id for s in streams for r in s.group.requests if r.request_id in live
        )
        if self.request_ids and self._task is None:
            self._task = in_own_context(self._run())

    async def _run(self) -> None:
        idle_sessions = 0  # sessions in a row that ended with nothing delivered
        try:
            while self.request_ids:
                if await self._read():
                    idle_sessions = 0
                else:
                    idle_sessions += 1
                if idle_sessions >= 2 and self.request_ids:
                    # The worker says nothing of ours is unfinished, twice, yet we wait.
                    raise CallError("internal", "the worker no longer holds these requests")
        except CallError as error:
            self._fail(error)
        except asyncio.CancelledError:
            self._fail(CallError("unavailable", "the call was cancelled"))
            raise
        except Exception as exc:  # the replica died
            log.warning("worker session with %s failed: %r", self.replica_id, exc)
            self._fail(CallError("unavailable", f"worker failed: {type(exc).__name__}: {exc}"))
        finally:
            self._task = None
            self._unwanted.clear()
            self.dispatcher.session_ended(self)

    async def _read(self) -> bool:
        """One session, a Serve streaming call, read to its end; whether it delivered anything."""
        response = self.dispatcher.session_handle.remote(
            RouteHint(replica_id=self.replica_id), self.dispatcher.ingress_id
        )
        iterator = response.__aiter__()

        async def next_item() -> bytes | None:
            try:
                return await iterator.__anext__()
            except StopAsyncIteration:
                return None

        return await self._consume(next_item, response.cancel)

    async def _consume(
        self, next_frame: Callable[[], Awaitable[bytes | None]], cancel: Callable[[], object]
    ) -> bool:
        """A session's frames, from its accept frame to its end (`next_frame` gives None);
        whether any delivered deltas. `cancel` gives up on the session after a timeout."""
        accept_s, stall_s = self.dispatcher.accept_timeout_s, self.dispatcher.stall_timeout_s
        try:
            async with asyncio.timeout(accept_s):
                first = await next_frame()
        except TimeoutError:
            cancel()
            raise CallError(
                "unavailable", f"worker replica {self.replica_id} did not answer in time"
            ) from None
        if first is None:
            raise CallError("unavailable", f"worker replica {self.replica_id} closed the session")
        answer = decode_first(first)
        if isinstance(answer, Refused):
            raise CallError("unavailable", answer.message)
        delivered = False
        while True:
            try:
                async with asyncio.timeout(stall_s):
                    frame = await next_frame()
            except TimeoutError:
                cancel()
                raise CallError(
                    "unavailable", f"the worker sent nothing for {stall_s:.0f} s"
                ) from None
            if frame is None:  # the worker ended the session
                return delivered
            deltas = decode_deltas(frame)
            delivered = delivered or bool(deltas)
            self._deliver(deltas)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        live = self.dispatcher.live
        per_stream: dict[GroupStream, list[RequestDelta]] = {}
        unwanted: list[str] = []
        for delta in deltas:
            stream = live.get(delta.request_id)
            if delta.finished:
                self._unwanted.pop(delta.request_id, None)
            elif stream is None or not stream.wants(delta.request_id):
                unwanted.append(delta.request_id)
            if stream is None:
                continue
            per_stream.setdefault(stream, []).append(delta)
            if delta.finished:
                del live[delta.request_id]
                self.request_ids.discard(delta.request_id)
        # First tokens first: each stream's HTTP handler wakes in this order and writes its
        # own chunk, so a first token behind N streams under way would wait N writes.
        for stream, mine in sorted(per_stream.items(), key=lambda item: item[0].started):
            stream._on_deltas(mine)
        if unwanted:
            self._abort_again(unwanted)

    def _abort_again(self, request_ids: list[str]) -> None:
        """Abort again what still steps `REABORT_S` after no stream wanted it: its abort
        was lost or raced its submit, and it would otherwise run to `max_tokens`."""
        now, again = time.monotonic(), []
        for rid in request_ids:
            since = self._unwanted.setdefault(rid, now)
            if now - since >= REABORT_S:
                self._unwanted[rid] = now
                again.append(rid)
        if again:
            log.warning(
                "%d requests still ran on %s after their abort: aborting them again",
                len(again),
                self.replica_id,
            )
            self.dispatcher.send_abort(self.replica_id, again)

    def _fail(self, error: CallError) -> None:
        live = self.dispatcher.live
        streams = {live.pop(rid) for rid in self.request_ids if rid in live}
        self.request_ids.clear()
        _fail(list(streams), error)


def _fail(streams: list[GroupStream], error: CallError) -> None:
    for stream in streams:
        stream._on_error(error)


def in_own_context(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run a worker call outside the HTTP request's context.

    A handle call made inside a request inherits that request's Serve request id
    (a contextvar). Batched calls, retries and aborts would then share one id with other
    calls in flight, and Serve's router matches a routing decision to its pending call by
    that id. In an empty context every call gets an id of its own."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


class Dispatcher:
    """Batches groups within a window, submits each batch, reads one session per replica."""

    def __init__(
        self,
        worker_handle: Any,
        window_s: float,
        max_batch: int,
        accept_timeout_s: float,
        stall_timeout_s: float,
        on_call: Callable[[int], None] = lambda num_requests: None,
    ):
        """A worker must accept a call within `accept_timeout_s` and a session must not be
        silent longer than `stall_timeout_s`; `on_call(num_requests)` is told the size of
        every call sent (a metric)."""
        self._on_call = on_call
        self.submit_handle = worker_handle.options(method_name="submit")
        self.session_handle = worker_handle.options(method_name="session", stream=True)
        self.ingress_id = uuid.uuid4().hex[:16]  # names this ingress's mailbox on each worker
        self._sessions: dict[str, _Session] = {}
        # every request sent and not yet finished on its worker, by id: a session delivers
        # through this, so deltas that outrun their submit's answer still find their stream
        self.live: dict[str, GroupStream] = {}
        self._abort_handle = worker_handle.options(method_name="abort")
        self.accept_timeout_s = accept_timeout_s
        self.stall_timeout_s = stall_timeout_s
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
        for stream in streams:
            for r in stream.group.requests:
                self.live[r.request_id] = stream
        self._spawn(_Submit(self, streams, attempt).run())

    def session(self, replica_id: str) -> _Session:
        """The session with a replica, open or about to open."""
        session = self._sessions.get(replica_id)
        if session is None:
            session = self._sessions[replica_id] = _Session(self, replica_id)
        return session

    def session_ended(self, session: _Session) -> None:
        if self._sessions.get(session.replica_id) is session and not session.request_ids:
            del self._sessions[session.replica_id]

    def forget(self, streams: list[GroupStream]) -> None:
        """Streams whose submit failed or was refused: no worker holds their requests."""
        for stream in streams:
            for r in stream.group.requests:
                self.live.pop(r.request_id, None)

    def send_abort(self, replica_id: str, request_ids: list[str]) -> None:
        self._spawn(self._abort(replica_id, request_ids))

    async def _abort(self, replica_id: str, request_ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # the replica may be gone: nothing left to free
            async with asyncio.timeout(self.accept_timeout_s):
                hint = RouteHint(replica_id=replica_id)
                await self._abort_handle.remote(hint, request_ids, self.ingress_id)

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
