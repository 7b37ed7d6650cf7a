"""OutputStream: the frames of one `Engine.submit` call, handed from the engine thread.

One frame per engine step, holding every request of the submit that advanced in that
step. Consumers iterate it synchronously or from any asyncio loop; the engine thread wakes
them (no polling sleeps). A long-lived stream can take more requests (`Engine.submit(...,
into=stream)`): the cluster's worker keeps one per ingress replica and drains it with
`drain` and `wakeup`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from worker.outputs import RequestDelta


class OutputStream:
    def __init__(self, request_ids: list[str], abort: Callable[[str], None]):
        self.request_ids = request_ids  # of the submit that made it (`add` keeps no record)
        self._unfinished = set(request_ids)
        self._abort = abort
        self._frames: deque[list[RequestDelta]] = deque()
        self._cond = threading.Condition()
        self._wakeups: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._closed = False

    @property
    def finished(self) -> bool:
        """Every request of this stream has finished (its last frame may still be unread)."""
        return not self._unfinished

    @property
    def closed(self) -> bool:
        return self._closed

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` delivers into this stream and has not finished."""
        with self._cond:
            return request_id in self._unfinished

    def add(self, request_ids: list[str]) -> None:
        """Engine: more requests deliver into this stream (before any of them can step)."""
        with self._cond:
            if self._closed:
                raise ValueError("the stream is closed")
            self._unfinished.update(request_ids)

    def push(self, frame: list[RequestDelta]) -> None:
        """Engine thread: deliver one step's deltas for this stream."""
        with self._cond:
            self._frames.append(frame)
            for d in frame:
                if d.finish_reason is not None:
                    self._unfinished.discard(d.request_id)
            self._cond.notify_all()
            wakeups = list(self._wakeups)
        for loop, event in wakeups:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def poll(self) -> list[list[RequestDelta]]:
        """Frames delivered so far and not yet read (never blocks)."""
        with self._cond:
            frames = list(self._frames)
            self._frames.clear()
        return frames

    def drain(self) -> tuple[list[list[RequestDelta]], bool]:
        """Every frame not yet read, and whether every request has finished, in one look:
        a consumer that sees `([], True)` has read the last frame of every request."""
        with self._cond:
            frames = list(self._frames)
            self._frames.clear()
            return frames, not self._unfinished

    def wakeup(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
        """Set `event` (in `loop`) on every push; returns the function that unregisters it."""
        entry = (loop, event)
        with self._cond:
            self._wakeups.append(entry)

        def unregister() -> None:
            with self._cond:
                self._wakeups.remove(entry)

        return unregister

    def close(self) -> None:
        """Abort whatever of this submit is unfinished; further frames are dropped."""
        with self._cond:
            self._closed = True
            unfinished = list(self._unfinished)
            self._cond.notify_all()
        for rid in unfinished:
            self._abort(rid)

    def _ready(self) -> bool:
        return bool(self._frames) or self._closed or not self._unfinished

    def _take(self) -> list[RequestDelta] | None:
        """Next frame, or None when the stream is over. Call with the lock held, when ready."""
        return self._frames.popleft() if self._frames else None

    def __iter__(self) -> Iterator[list[RequestDelta]]:
        while True:
            with self._cond:
                self._cond.wait_for(self._ready)
                frame = self._take()
            if frame is None:
                return
            yield frame

    async def __aiter__(self) -> AsyncIterator[list[RequestDelta]]:
        event = asyncio.Event()
        unregister = self.wakeup(asyncio.get_running_loop(), event)
        try:
            while True:
                with self._cond:
                    ready = self._ready()
                    if not ready:
                        event.clear()  # under the lock: a push after this sets it again
                    frame = self._take() if ready else None
                if not ready:
                    await event.wait()
                    continue
                if frame is None:
                    return
                yield frame
        finally:
            unregister()
