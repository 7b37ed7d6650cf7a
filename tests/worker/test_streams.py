"""OutputStream: the engine thread pushes one frame per step; a consumer drains what came,
is woken on its own event loop, and a closed stream aborts what is unfinished."""

from __future__ import annotations

import asyncio

import pytest

from worker.outputs import RequestDelta
from worker.streams import OutputStream


def step(rid: str, token: int, finish: bool = False) -> list[RequestDelta]:
    return [RequestDelta(rid, [token], finish_reason="length" if finish else None)]


def test_drain_returns_every_frame_and_says_when_all_finished() -> None:
    stream = OutputStream(["a", "b"], abort=lambda rid: None)
    stream.push(step("a", 1))
    stream.push(step("a", 2, finish=True))
    frames, finished = stream.drain()
    assert [f[0].new_token_ids for f in frames] == [[1], [2]] and not finished
    stream.push(step("b", 3, finish=True))
    assert stream.drain() == ([step("b", 3, finish=True)], True)
    assert stream.drain() == ([], True)


def test_a_push_from_another_thread_wakes_the_consumers_loop() -> None:
    async def run() -> bool:
        stream = OutputStream(["a"], abort=lambda rid: None)
        event = asyncio.Event()
        unregister = stream.wakeup(asyncio.get_running_loop(), event)
        await asyncio.to_thread(stream.push, step("a", 1))  # as the engine thread does
        await asyncio.wait_for(event.wait(), 5)
        unregister()
        event.clear()
        await asyncio.to_thread(stream.push, step("a", 2))
        await asyncio.sleep(0.05)
        return event.is_set()

    assert asyncio.run(run()) is False  # unregistered: no wakeup


def test_closing_aborts_only_the_unfinished_and_refuses_more_requests() -> None:
    aborted: list[str] = []
    stream = OutputStream(["a", "b"], abort=aborted.append)
    stream.push(step("a", 1, finish=True))
    stream.close()
    assert aborted == ["b"] and stream.closed
    with pytest.raises(ValueError):
        stream.add(["c"])


def test_iterating_ends_when_every_request_finished() -> None:
    stream = OutputStream(["a"], abort=lambda rid: None)
    stream.push(step("a", 1))
    stream.push(step("a", 2, finish=True))
    assert [f[0].new_token_ids for f in stream] == [[1], [2]]
