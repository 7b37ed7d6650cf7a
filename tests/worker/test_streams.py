"""OutputStream's hand-off: the engine thread gives a step's frame to a taker itself while no
frame waits in the stream; what the taker declines waits for `drain`, and nothing overtakes
it."""

from __future__ import annotations

import asyncio

from worker.outputs import RequestDelta
from worker.streams import OutputStream


def step(rid: str, token: int, finish: bool = False) -> list[RequestDelta]:
    return [RequestDelta(rid, [token], finish_reason="length" if finish else None)]


class Taker:
    """Takes frames while `open`; records what it took."""

    def __init__(self) -> None:
        self.open = True
        self.took: list[list[RequestDelta]] = []

    def __call__(self, frame: list[RequestDelta]) -> bool:
        if self.open:
            self.took.append(frame)
        return self.open


def test_a_taker_gets_each_frame_and_nothing_waits() -> None:
    stream = OutputStream(["a"], abort=lambda rid: None)
    taker = Taker()
    stream.hand_off(taker)
    stream.push(step("a", 1))
    stream.push(step("a", 2, finish=True))
    assert [f[0].new_token_ids for f in taker.took] == [[1], [2]]
    assert stream.drain() == ([], True)  # taken frames count as read


def test_a_declined_frame_waits_and_the_next_queues_behind_it_until_drained() -> None:
    stream = OutputStream(["a"], abort=lambda rid: None)
    taker = Taker()
    stream.hand_off(taker)
    taker.open = False
    stream.push(step("a", 1))  # declined: waits
    taker.open = True
    stream.push(step("a", 2))  # must not overtake frame 1
    assert taker.took == []
    frames, finished = stream.drain()
    assert [f[0].new_token_ids for f in frames] == [[1], [2]] and not finished
    stream.push(step("a", 3, finish=True))  # nothing waits now: the taker's again
    assert [f[0].new_token_ids for f in taker.took] == [[3]]
    assert stream.drain() == ([], True)


def test_the_stream_is_unfinished_until_the_last_frame_is_taken_or_queued() -> None:
    stream = OutputStream(["a"], abort=lambda rid: None)
    seen: list[bool] = []

    def taker(frame: list[RequestDelta]) -> bool:
        seen.append(stream.drain()[1])  # a consumer that looks while the frame is in hand
        return False

    stream.hand_off(taker)
    stream.push(step("a", 1, finish=True))
    assert seen == [False]
    frames, finished = stream.drain()
    assert len(frames) == 1 and finished


def test_taking_back_the_taker_queues_frames_again() -> None:
    stream = OutputStream(["a"], abort=lambda rid: None)
    first, second = Taker(), Taker()
    take_back_first = stream.hand_off(first)
    stream.hand_off(second)  # a newer session's
    take_back_first()  # the old one's leaves the newer one in place
    stream.push(step("a", 1))
    take_back = stream.hand_off(second)
    take_back()
    stream.push(step("a", 2))
    assert [f[0].new_token_ids for f in second.took] == [[1]] and first.took == []
    assert [f[0].new_token_ids for f in stream.drain()[0]] == [[2]]


def test_a_taken_frame_wakes_the_consumer_only_when_a_request_finished() -> None:
    async def run() -> list[bool]:
        stream = OutputStream(["a"], abort=lambda rid: None)
        event = asyncio.Event()
        stream.wakeup(asyncio.get_running_loop(), event)
        stream.hand_off(Taker())
        woken = []
        for frame in (step("a", 1), step("a", 2, finish=True)):
            event.clear()
            await asyncio.to_thread(stream.push, frame)  # from another thread, as the engine's
            await asyncio.sleep(0.05)
            woken.append(event.is_set())
        return woken

    assert asyncio.run(run()) == [False, True]
