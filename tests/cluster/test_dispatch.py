"""The ingress side of a worker call: group streams, first tokens first, aborts, batches."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.dispatch import CallError, Dispatcher, Group, GroupStream
from cluster.transport import encode_accepted, encode_deltas
from worker.outputs import RequestDelta
from worker.sampling import SamplingParams
from worker.validation import EngineRequest


class RecordingDispatcher:
    """Stands in for Dispatcher where a GroupStream only needs `send_abort`."""

    def __init__(self) -> None:
        self.aborted: list[tuple[str, list[str]]] = []
        self.open_streams: set[GroupStream] = set()

    def send_abort(self, replica_id: str, request_ids: list[str]) -> None:
        self.aborted.append((replica_id, request_ids))


def group_of(*request_ids: str) -> Group:
    return Group([EngineRequest(rid, [1, 2, 3], SamplingParams()) for rid in request_ids], ())


def test_group_stream_delivers_frames_queued_after_the_last_finish() -> None:
    async def scenario() -> list[list[RequestDelta]]:
        stream = GroupStream(RecordingDispatcher(), group_of("a", "b"))  # type: ignore[arg-type]
        stream._on_accept("replica-1")
        stream._on_deltas([RequestDelta("a", [5]), RequestDelta("b", [6], finish_reason="length")])
        stream._on_deltas([RequestDelta("a", [7], finish_reason="stop"), RequestDelta("x", [9])])
        return [frame async for frame in stream]

    frames = asyncio.run(scenario())
    assert [[(d.request_id, d.new_token_ids) for d in f] for f in frames] == [
        [("a", [5]), ("b", [6])],
        [("a", [7])],
    ]


def test_a_frame_wakes_the_streams_awaiting_their_first_token_before_the_others() -> None:
    class NoHandle:
        def options(self, **_: object) -> NoHandle:
            return self

    async def scenario() -> list[str]:
        dispatcher = Dispatcher(NoHandle(), 0.0, 8, 60.0, 300.0)
        streams = {rid: GroupStream(dispatcher, group_of(rid)) for rid in ("a", "b", "c")}
        for rid, stream in streams.items():
            stream._on_accept("replica-1")
            dispatcher.live[rid] = stream
        woken: list[str] = []

        async def read(rid: str) -> None:
            async for frame in streams[rid]:
                woken.extend(f"{d.request_id}{d.new_token_ids[0]}" for d in frame)

        readers = [asyncio.ensure_future(read(rid)) for rid in streams]
        session = dispatcher.session("replica-1")
        session._deliver([RequestDelta("a", [1])])
        await asyncio.sleep(0)
        # a and c are under way, b waits for its first token: b is woken first
        session._deliver([RequestDelta("a", [2]), RequestDelta("b", [1]), RequestDelta("c", [1])])
        await asyncio.sleep(0)
        done = [RequestDelta(rid, [9], finish_reason="length") for rid in streams]
        session._deliver(done)
        await asyncio.gather(*readers)
        return woken

    assert asyncio.run(scenario()) == ["a1", "b1", "c1", "a2", "a9", "b9", "c9"]


def test_group_stream_abort_reaches_the_replica_and_ends_the_stream() -> None:
    async def scenario() -> tuple[list[list[RequestDelta]], RecordingDispatcher]:
        dispatcher = RecordingDispatcher()
        stream = GroupStream(dispatcher, group_of("a", "b"))  # type: ignore[arg-type]
        stream._on_accept("replica-1")
        stream._on_deltas([RequestDelta("a", [5], finish_reason="length")])
        stream.abort(["b"])
        stream._on_deltas([RequestDelta("b", [], finish_reason="abort")])  # arrives late: ignored
        return [frame async for frame in stream], dispatcher

    frames, dispatcher = asyncio.run(scenario())
    assert [[d.request_id for d in f] for f in frames] == [["a"]]
    assert dispatcher.aborted == [("replica-1", ["b"])]


def test_group_stream_raises_the_call_error() -> None:
    async def scenario() -> None:
        stream = GroupStream(RecordingDispatcher(), group_of("a"))  # type: ignore[arg-type]
        stream._on_error(CallError("full", "queue full"))
        with pytest.raises(CallError, match="queue full"):
            await stream.accepted()

    asyncio.run(scenario())


def test_a_window_batch_is_split_by_leading_page_so_each_call_keeps_its_affinity() -> None:
    from types import SimpleNamespace

    from cluster.dispatch import _by_leading_page

    def stream(*first_pages: int) -> SimpleNamespace:
        hashes = tuple((p, 99) for p in first_pages)
        return SimpleNamespace(group=SimpleNamespace(page_hashes=hashes))

    a1, b, a2, short1, short2 = stream(1), stream(2), stream(1), stream(), stream()
    calls = _by_leading_page([a1, b, a2, short1, short2])
    assert calls == [[a1, a2], [b], [short1, short2]]


class _DeadReplica(Exception):
    """What a call to a killed replica raises (stands in for Ray's ActorDiedError)."""


class _Response:
    """A fake streaming Serve response yielding the given frames."""

    def __init__(self, frames: list[bytes]):
        self._frames = frames

    def __aiter__(self) -> _Response:
        return self

    async def __anext__(self) -> bytes:
        if not self._frames:
            raise StopAsyncIteration
        return self._frames.pop(0)

    def cancel(self) -> None:
        pass


class _Handle:
    """A fake worker handle whose first `submit` hits a dead replica; the retry reaches a
    live one, whose session delivers the request's one token."""

    def __init__(self, request_id: str):
        self.calls: dict[str, int] = {}
        self._request_id = request_id
        self._method = ""

    def options(self, method_name: str, stream: bool = False) -> _Handle:
        handle = _Handle(self._request_id)
        handle.calls, handle._method = self.calls, method_name
        return handle

    def remote(self, *args: Any) -> Any:
        self.calls[self._method] = self.calls.get(self._method, 0) + 1
        if self._method == "session":
            done = RequestDelta(self._request_id, [7], None, "length", None, 1, 0, None)
            return _Response([encode_accepted("live"), encode_deltas([done])])
        return self._submit(self.calls[self._method])

    async def _submit(self, attempt: int) -> bytes:
        if attempt == 1:
            raise _DeadReplica("the replica died")
        return encode_accepted("live")


def _group(request_id: str) -> Group:
    return Group([EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=1))], ())


def test_a_call_that_fails_before_it_is_accepted_is_retried_once() -> None:
    async def run() -> tuple[str, list[RequestDelta], dict[str, int]]:
        handle = _Handle("r-1")
        dispatcher = Dispatcher(handle, 0.0, 8, 60.0, 300.0)
        stream = dispatcher.submit(_group("r-1"))
        replica = await stream.accepted()
        frames: list[RequestDelta] = []
        async for frame in stream:
            frames.extend(frame)
        stream.close()
        return replica, frames, handle.calls

    replica, frames, calls = asyncio.run(run())
    assert (replica, calls) == ("live", {"submit": 2, "session": 1})
    assert [d.finish_reason for d in frames] == ["length"]


def test_draining_dispatcher_counts_open_requests_until_closed() -> None:
    async def run() -> list[int]:
        dispatcher = Dispatcher(_Handle("r-2"), 0.0, 8, 60.0, 300.0)
        counts = [dispatcher.num_open]
        stream = dispatcher.submit(_group("r-2"))
        counts.append(dispatcher.num_open)
        await stream.accepted()  # the retry reaches the live replica
        stream.close()
        counts.append(dispatcher.num_open)
        return counts

    assert asyncio.run(run()) == [0, 1, 0]


def test_a_request_still_stepping_after_its_abort_is_aborted_again(monkeypatch) -> None:
    """An abort that never landed (lost, or raced its submit): the request's next frames
    after REABORT_S send it again, once per period; a finished request is let go."""
    import cluster.dispatch as dispatch

    class NoHandle:
        def options(self, **_: object) -> NoHandle:
            return self

    clock = [100.0]
    monkeypatch.setattr(dispatch.time, "monotonic", lambda: clock[0])

    async def scenario() -> list[list[str]]:
        dispatcher = Dispatcher(NoHandle(), 0.0, 8, 60.0, 300.0)
        sent: list[list[str]] = []
        dispatcher.send_abort = lambda replica_id, ids: sent.append(ids)  # type: ignore[method-assign]
        stream = GroupStream(dispatcher, group_of("a", "b"))
        stream._on_accept("replica-1")
        for rid in ("a", "b", "ghost"):
            dispatcher.live[rid] = stream
        del dispatcher.live["ghost"]  # a request nobody here waits on (a retried submit's twin)
        session = dispatcher.session("replica-1")
        stream.close()  # the client left: the first abort goes out from the stream
        assert [sorted(ids) for ids in sent] == [["a", "b"]]
        step = [RequestDelta(rid, [1]) for rid in ("a", "b", "ghost")]
        session._deliver(step)  # in flight when the abort was sent: nothing again yet
        clock[0] += 0.5
        session._deliver(step)
        clock[0] += 0.6
        session._deliver(step)  # 1.1 s on: all three again
        clock[0] += 0.5
        session._deliver([RequestDelta("a", [], finish_reason="abort"), *step[1:]])
        clock[0] += 0.6
        session._deliver(step[1:])  # "a" finished; the others go again a period after
        return sent[1:]

    assert asyncio.run(scenario()) == [["a", "b", "ghost"], ["b", "ghost"]]


def test_a_client_that_leaves_while_its_call_is_routed_gets_it_aborted_on_accept() -> None:
    """The handler awaiting `accepted()` is cancelled: closing then must not raise, and the
    accept that follows sends the abort."""

    async def scenario() -> RecordingDispatcher:
        dispatcher = RecordingDispatcher()
        stream = GroupStream(dispatcher, group_of("a"))  # type: ignore[arg-type]
        waiter = asyncio.ensure_future(stream.accepted())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        stream.close()
        assert dispatcher.aborted == []
        stream._on_accept("replica-1")
        return dispatcher

    assert asyncio.run(scenario()).aborted == [("replica-1", ["a"])]
