"""WorkerDeployment: one Engine per Serve replica (one GPU each, or CPU).

An ingress replica queues requests with `submit` (answered accept or refuse) and reads the
deltas of all its requests on this replica from one `session` stream: one msgpack frame
per engine step for the pair, not one per call (see transport.py). Each ingress has a
`Mailbox` here: one engine OutputStream its requests deliver into.
- A session ends once the ingress has had nothing unfinished here for `linger_s` (a steady
  trickle of requests keeps one session, and a first token waits for no extra call); the
  ingress opens a new one with its next accepted submit. So a draining replica is not
  held open by idle sessions.
- A session the ingress cancels, or a mailbox no session reads for `orphan_timeout_s` (its
  ingress died), aborts what is left.
- `generate` does the same in one call with a stream of its own (direct use, tests).
- With `frame_socket`, a session can also be read over a plain TCP connection to this
  replica (transport.py); closing it is what cancelling a session call does. The same port
  takes submit links (submits and their answers, no Serve call) and is published, from the
  replica's start, in its Serve replica metadata (`frames_at`), which an ingress's router
  sees with its choice of replica.

A replica reports its load and prefix-cache keys to routers (`record_routing_stats`), its
queue depth and KV usage to the autoscaler (`record_autoscaling_stats`), and counts as
unhealthy when the engine loop died or has work but stopped stepping. With
`ClusterConfig.fault_injection` on (tests only), it also takes `inject_fault` calls that
make its next engine steps raise or stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import ray
import torch
from ray import serve

from cluster import timeline
from cluster.config import usable_cores, worker_torch_threads
from cluster.dispatch import rss_bytes
from cluster.router import RouteHint
from cluster.transport import (
    FrameWriter,
    decode_hello,
    decode_requests,
    decode_submit,
    encode_accepted,
    encode_deltas,
    encode_refused,
    encode_submit_answer,
    read_frame,
    write_frame,
)
from worker.config import EngineConfig
from worker.engine import Engine, EngineFull, EngineRequest, EngineStats
from worker.heap import freeze_heap
from worker.outputs import RequestDelta, merge_steps
from worker.request import ScheduledTask
from worker.streams import OutputStream

HEARTBEAT = encode_deltas([])  # an empty step frame: "still queued, the engine is stepping"
ANSWERED_REPORT_S = 600.0  # a sender's answered count is reported while it sent in this window

log = logging.getLogger(__name__)


def set_cpu_threads(config: EngineConfig, threads: int | None) -> None:
    """Set this process's torch threads as a worker replica's engine has them (`threads`:
    `ClusterConfig.worker_cpu_threads`): Ray caps an actor's at its `num_cpus`."""
    threads = worker_torch_threads(config, threads, usable_cores(), torch.cuda.is_available())
    if threads is not None:
        torch.set_num_threads(threads)


def _warn_if_below_the_control_plane() -> None:
    """Ray starts workers at niceness 15 unless told otherwise (cluster/app.py, SERVE_ENV); the
    engine then yields its cores to every wakeup of Ray's daemons."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness > 0:
        log.warning(
            "worker replica at niceness %d: Ray's daemons preempt its engine; set "
            "RAY_worker_niceness=0 on every node before `ray start` (kvray serve does)",
            niceness,
        )


class InjectedFault(RuntimeError):
    """The failure a FaultInjector raises inside an engine step."""


class FaultInjector:
    """Test-only engine fault, installed as `Engine.fault_hook` (runs on the engine thread
    before each step's forward): the next `steps` steps with work raise, or stall first.

    Off unless the config enables it, so a production replica can never be told to fail."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._steps = 0
        self._stall_s = 0.0
        self.injected = 0  # steps failed or stalled so far

    def arm(self, steps: int, stall_s: float = 0.0) -> None:
        """Fail the next `steps` steps (raise), or with `stall_s` > 0 sleep that long in each."""
        if not self.enabled:
            raise PermissionError("fault injection is off (ClusterConfig.fault_injection)")
        if steps < 0 or stall_s < 0:
            raise ValueError("steps and stall_s must not be negative")
        with self._lock:
            self._steps, self._stall_s = steps, stall_s

    def __call__(self, tasks: list[ScheduledTask]) -> None:
        with self._lock:
            if self._steps <= 0:
                return
            self._steps -= 1
            self.injected += 1
            stall_s = self._stall_s
        if stall_s > 0:
            time.sleep(stall_s)
            return
        raise InjectedFault(f"injected fault in a step of {len(tasks)} request(s)")


@dataclasses.dataclass(eq=False)
class Mailbox:
    """What one ingress replica has queued on this worker, and which session reads it."""

    stream: OutputStream
    session: int = 0  # the number of the newest session; it alone reads the stream
    attached: bool = False
    wake: asyncio.Event | None = None  # the reading session's wakeup
    handed_off: int = 0  # frames the engine thread wrote onto the session's socket itself
    # unfinished with a token out (timeline)
    started: set[str] = dataclasses.field(default_factory=set)


def _mark_first_written(
    frames: list[list[RequestDelta]], box: Mailbox, at: float | None = None
) -> None:
    """The timeline's `first_written` of each request whose first token these frames carry
    (`at`: when the write began, if not now)."""
    for frame in frames:
        for delta in frame:
            if delta.new_token_ids and delta.request_id not in box.started:
                timeline.mark(delta.request_id, "first_written", at)
                box.started.add(delta.request_id)
            if delta.finished:
                box.started.discard(delta.request_id)


# The engine thread writes a frame of at most this many requests' deltas itself; a larger one
# (many requests of one ingress in a step) is encoded on the event loop, beside the next step.
HAND_OFF_MAX_DELTAS = 16


def _frame_of(frames: list[list[RequestDelta]], box: Mailbox) -> bytes:
    """One frame for the steps a session read together (one delta per request)."""
    if timeline.enabled():
        _mark_first_written(frames, box)
    return encode_deltas(frames[0] if len(frames) == 1 else merge_steps(frames))


async def _pump(frames: AsyncGenerator[bytes, None], sink: FrameWriter) -> None:
    """What a socket session yields (its accept frame and heartbeats) onto its socket;
    closing the session if this ends first (the socket failed, or the task was cancelled) is
    what makes it abort what is unfinished."""
    try:
        async for frame in frames:
            sink.write(frame)
            await sink.drain()
    finally:
        await frames.aclose()


def _node_ip() -> str:
    """This node's address as Ray knows it (pods and hosts reach each other on it)."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # no Ray here (unit tests): this host only
        return "127.0.0.1"


class WorkerDeployment:
    """The body of the worker deployment; `app.build_app` wraps it with `serve.deployment`."""

    def __init__(
        self,
        engine_config: EngineConfig,
        summary_pages: int = 4096,
        stall_threshold_s: float = 60.0,
        cpu_threads: int | None = None,
        fault_injection: bool = False,
        heartbeat_s: float = 5.0,
        orphan_timeout_s: float = 60.0,
        linger_s: float = 2.0,
        frame_socket: bool = False,
    ):
        set_cpu_threads(engine_config, cpu_threads)
        _warn_if_below_the_control_plane()
        self._engine = Engine.launched(engine_config)  # built on its loop thread, see there
        self._faults = FaultInjector(fault_injection)
        if fault_injection:
            self._engine.fault_hook = self._faults
        self._summary_pages = summary_pages
        self._heartbeat_s = heartbeat_s
        self._orphan_timeout_s = orphan_timeout_s
        self._linger_s = linger_s
        self._mailboxes: dict[str, Mailbox] = {}
        # requests answered (accepted or refused) per sending ingress, and when last: the
        # routers count what they sent here and this has not answered yet (cluster/router.py)
        self._answered: dict[str, tuple[int, float]] = {}
        self._last_report: dict[str, Any] | None = None  # record_routing_stats, and since when
        self._last_report_time = 0.0
        self._stall_threshold_s = stall_threshold_s
        self._frame_socket = frame_socket
        self._frame_server: asyncio.Task[tuple[str, int] | None] | None = None
        self._socket_sessions = 0  # open sessions on the frame socket
        self._submit_links: set[asyncio.StreamWriter] = set()  # open submit links
        self._draining = False  # Serve is stopping this replica
        self._link_submits = 0  # submits that came over submit links (the rest: Serve calls)
        self._frames_handed_off = 0  # socket frames the engine thread wrote itself
        self._server: asyncio.Server | None = None
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        frozen = freeze_heap()  # no full collection walks the weights and modules mid-step
        log.info(
            "worker replica %s ready (%d objects frozen): %s",
            self._replica_id,
            frozen,
            self._engine.config,
        )

    async def generate(self, hint: RouteHint, payload: bytes) -> AsyncIterator[bytes]:
        """Queue a batch of requests; stream accept/refuse, then one frame per engine step."""
        requests = [
            EngineRequest(r.request_id, r.prompt_token_ids, r.params)
            for r in decode_requests(payload)
        ]
        try:
            stream = self._engine.submit(requests)
        except EngineFull as exc:
            yield encode_refused("full", str(exc) or "the worker's waiting queue is full")
            return
        except ValueError as exc:
            yield encode_refused("invalid", str(exc))
            return
        yield encode_accepted(self._replica_id)
        try:
            async for frame in self._frames(stream):
                yield frame
        finally:
            stream.close()  # a cancelled call (client gone) aborts what is unfinished

    async def _frames(self, stream: OutputStream) -> AsyncIterator[bytes]:
        """The stream's frames, plus an empty frame after every `heartbeat_s` of silence in
        which the engine stepped: a request waiting in a long queue is not a stalled
        worker. An engine that stopped stepping sends nothing, so the ingress's
        `stall_timeout_s` still fires."""
        queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for deltas in stream:
                    queue.put_nowait(encode_deltas(deltas))
                queue.put_nowait(None)
            except Exception as exc:
                queue.put_nowait(exc)

        task = asyncio.get_running_loop().create_task(pump())
        steps = self._engine.stats_snapshot.num_steps
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), self._heartbeat_s)
                except TimeoutError:
                    if self._engine.stats_snapshot.num_steps != steps:
                        steps = self._engine.stats_snapshot.num_steps
                        yield HEARTBEAT
                    continue
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()

    async def submit(
        self, hint: RouteHint, payload: bytes, ingress_id: str, received_at: float | None = None
    ) -> bytes:
        """Queue a batch of requests for `ingress_id`; answers accept or refuse. Their
        deltas come on that ingress's `session`. `received_at`: when a submit link read it
        (the timeline; a Serve call is received when this runs)."""
        received_at = time.perf_counter() if received_at is None else received_at
        try:
            return self._submit(payload, ingress_id, await self._frames_at(), received_at)
        finally:
            answered, _ = self._answered.get(hint.sender, (0, 0.0))
            self._answered[hint.sender] = (answered + hint.num_requests, time.monotonic())

    def _submit(
        self, payload: bytes, ingress_id: str, frames_at: tuple[str, int] | None, received_at: float
    ) -> bytes:
        requests = [
            EngineRequest(r.request_id, r.prompt_token_ids, r.params)
            for r in decode_requests(payload)
        ]
        if timeline.enabled():
            for r in requests:
                timeline.mark(r.request_id, "received", received_at)
        box = self._mailboxes.get(ingress_id)
        if box is None or box.stream.closed:
            box = self._mailboxes[ingress_id] = Mailbox(OutputStream([], self._engine.abort))
        try:
            self._engine.submit(requests, into=box.stream)
        except EngineFull as exc:
            return encode_refused("full", str(exc) or "the worker's waiting queue is full")
        except ValueError as exc:
            return encode_refused("invalid", str(exc))
        if timeline.enabled():
            for r in requests:
                timeline.mark(r.request_id, "queued")
        if not box.attached:
            self._reap_later(ingress_id, box)
        return encode_accepted(self._replica_id, frames_at)

    async def _frames_at(self) -> tuple[str, int] | None:
        """Where this replica serves sessions over a socket (the server starts on the first
        submit, on the loop that runs the sessions), or None."""
        if not self._frame_socket:
            return None
        if self._frame_server is None:
            self._frame_server = asyncio.ensure_future(self._start_frame_server())
        return await asyncio.shield(self._frame_server)

    async def _start_frame_server(self) -> tuple[str, int] | None:
        host = _node_ip()
        try:
            server = await asyncio.start_server(self._frames_connection, host=host, port=0)
        except OSError as exc:
            log.warning("no frame socket on %s (%r): sessions stay on Serve streams", host, exc)
            return None
        self._server = server  # held for the replica's life
        port = server.sockets[0].getsockname()[1]
        log.info("worker replica %s serves session frames on %s:%d", self._replica_id, host, port)
        return host, port

    async def record_replica_metadata(self) -> dict[str, Any]:
        """Serve asks once, when the replica is ready: the frame socket's address, which an
        ingress's router hands back with its choice of this replica (submit links)."""
        frames_at = await self._frames_at()
        return {} if frames_at is None else {"frames_at": list(frames_at)}

    async def _frames_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One connection to the frame socket: the ingress says who it is and what the
        connection carries. A session: it reads what `session` yields; the worker closes the
        connection when the session ends, and the ingress closing it (it gave up, or died)
        ends the session as a cancelled call would: what is unfinished is aborted. A submit
        link: `_submit_link`."""
        try:
            async with asyncio.timeout(10.0):
                hello = await read_frame(reader)
            if hello is None:
                raise ConnectionError("closed before its hello")
            ingress_id, replica_id, kind = decode_hello(hello)
        except (TimeoutError, ConnectionError, ValueError, KeyError, TypeError) as exc:
            log.warning("frame socket: a connection without a valid hello: %r", exc)
            writer.close()
            return
        if kind == "submit":
            await self._submit_link(reader, writer, ingress_id)
            return
        sink = FrameWriter(writer)
        frames = self.session(RouteHint(replica_id=replica_id), ingress_id, sink)
        pump = asyncio.ensure_future(_pump(frames, sink))
        closed = asyncio.ensure_future(reader.read(1))  # the ingress sends nothing more: EOF
        self._socket_sessions += 1
        try:
            await asyncio.wait({pump, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pump.cancel()
            closed.cancel()
            with contextlib.suppress(BaseException):
                await pump
            sink.close()
            writer.close()
            self._socket_sessions -= 1

    async def _submit_link(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ingress_id: str
    ) -> None:
        """Submits from one ingress over a connection of their own, each answered as the
        `submit` call answers, with the id it came with, in order. The link carries no
        deltas: those come on the ingress's session. It ends when the ingress closes it."""
        if self._draining:
            writer.close()
            return
        self._submit_links.add(writer)
        try:
            while (frame := await read_frame(reader)) is not None and not self._draining:
                received_at = time.perf_counter()
                submit_id, num_requests, sender, payload = decode_submit(frame)
                self._link_submits += 1
                hint = RouteHint(num_requests=num_requests, sender=sender)
                answer = await self.submit(hint, payload, ingress_id, received_at)
                write_frame(writer, encode_submit_answer(submit_id, answer))
                await writer.drain()
        except (ConnectionError, ValueError, TypeError) as exc:
            log.warning("submit link from ingress %s ended: %r", ingress_id, exc)
        finally:
            self._submit_links.discard(writer)
            writer.close()

    async def session(
        self, hint: RouteHint, ingress_id: str, sink: FrameWriter | None = None
    ) -> AsyncGenerator[bytes, None]:
        """The deltas of everything `ingress_id` queued here: an accept frame, then one
        frame per engine step (the steps since the last frame, if this reader lags), and a
        heartbeat after `heartbeat_s` of silence in which the engine stepped. Ends once
        none of them has been unfinished for `linger_s`; a cancelled session aborts what is
        unfinished. On a frame socket (`sink`) the deltas' frames go onto the socket rather
        than out of this generator: the engine thread writes a step's frame itself when
        nothing waits before it (`_hand_off`), and this writes the frames that waited."""
        if hint.replica_id != self._replica_id:  # routed elsewhere: its replica is gone
            yield encode_refused("gone", f"replica {hint.replica_id} is gone")
            return
        yield encode_accepted(self._replica_id)
        box = self._mailboxes.get(ingress_id)
        if box is None:
            return
        box.session += 1
        number = box.session
        if box.wake is not None:
            box.wake.set()  # a session this one replaces stops reading
        box.attached, box.wake = True, asyncio.Event()
        wake = box.wake
        unregister = box.stream.wakeup(asyncio.get_running_loop(), wake)
        take_back = None if sink is None else box.stream.hand_off(self._hand_off(box, sink))
        ended = False
        try:
            steps, handed_off = self._engine.stats_snapshot.num_steps, box.handed_off
            idle_since: float | None = None
            while box.session == number:
                wake.clear()
                if sink is None:
                    frames, finished = box.stream.drain()
                    if frames:
                        idle_since = None
                        yield _frame_of(frames, box)
                        continue
                else:
                    with sink.lock:  # the engine thread's writes wait: these frames go first
                        frames, finished = box.stream.drain()
                        if frames:
                            sink.write(_frame_of(frames, box))
                    if frames:
                        idle_since = None
                        await sink.drain()
                        continue
                if finished:  # nothing left: linger a moment for the ingress's next submit
                    now = time.monotonic()
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= self._linger_s:
                        ended = True
                        return
                    wait_s = self._linger_s - (now - idle_since)
                else:
                    idle_since, wait_s = None, self._heartbeat_s
                try:
                    await asyncio.wait_for(wake.wait(), wait_s)
                except TimeoutError:
                    stepped = self._engine.stats_snapshot.num_steps != steps
                    steps = self._engine.stats_snapshot.num_steps
                    if not finished and stepped and box.handed_off == handed_off:
                        yield HEARTBEAT  # nothing went out, not even from the engine thread
                    handed_off = box.handed_off
            ended = True  # replaced by a newer session
        finally:
            unregister()
            if take_back is not None:
                take_back()
            if box.session == number:
                box.attached, box.wake = False, None
                if not ended:  # cancelled: the ingress gave up on these requests, or died
                    box.stream.close()
                    if self._mailboxes.get(ingress_id) is box:
                        del self._mailboxes[ingress_id]
                elif not box.stream.finished:
                    self._reap_later(ingress_id, box)

    def _hand_off(self, box: Mailbox, sink: FrameWriter) -> Callable[[list[RequestDelta]], bool]:
        """The engine thread's taker of a socket session's frames (`OutputStream.hand_off`):
        it writes a step's frame as the step ends, when the socket has nothing queued."""

        def take(frame: list[RequestDelta]) -> bool:
            if len(frame) > HAND_OFF_MAX_DELTAS or not sink.ready():
                return False
            # counted first, so no reader sees a frame the stats do not (this thread alone
            # counts them); taken back if the frame is not sent
            self._frames_handed_off += 1
            box.handed_off += 1
            try:
                data = encode_deltas(frame)
                began = time.perf_counter()
                sent = sink.try_write(data)
            except Exception:  # never the engine thread's failure: the loop writes it instead
                log.exception("the engine thread could not write a frame; the loop will")
                sent = False
            if not sent:
                self._frames_handed_off -= 1
                box.handed_off -= 1
                return False
            if timeline.enabled():  # the ingress may read the frame before this runs
                _mark_first_written([frame], box, began)
            return True

        return take

    def _reap_later(self, ingress_id: str, box: Mailbox) -> None:
        """Abort a mailbox's requests if no session reads it for `orphan_timeout_s`."""
        number = box.session

        def reap() -> None:
            if box.attached or box.session != number or box.stream.finished:
                return
            log.warning(
                "no session from ingress %s for %.0f s: aborting its requests",
                ingress_id,
                self._orphan_timeout_s,
            )
            box.stream.close()
            if self._mailboxes.get(ingress_id) is box:
                del self._mailboxes[ingress_id]

        asyncio.get_running_loop().call_later(self._orphan_timeout_s, reap)

    async def abort(self, hint: RouteHint, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._engine.abort(request_id)

    async def inject_fault(self, hint: RouteHint, steps: int = 1, stall_s: float = 0.0) -> str:
        """Tests: make this replica's next `steps` steps raise (or stall `stall_s` seconds
        each). Refused (PermissionError) unless the config enables fault injection. Route it
        with `RouteHint(replica_id=...)`; returns the replica id that took it."""
        self._faults.arm(steps, stall_s)
        return self._replica_id

    async def info(self, hint: RouteHint | None = None) -> dict[str, Any]:
        """The resolved engine config the ingress validates prompts against."""
        config = self._engine.config
        return {
            "max_seq_len": config.max_seq_len,
            "page_size": config.page_size,
            "prefix_cache": config.prefix_cache,
            "engine": config.model_dump(),
        }

    async def stats(self) -> dict[str, Any]:
        """Engine stats for /metrics, tagged with this replica's id."""
        stats = self._engine.stats()
        return {
            "replica_id": self._replica_id,
            "faults_injected": self._faults.injected,
            "link_submits": self._link_submits,
            "frames_handed_off": self._frames_handed_off,
            "rss_bytes": rss_bytes(),
            "stalled_s": self._stalled_s(stats),
            **dataclasses.asdict(stats),
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """What the routers rank this replica by. Its `time` is when the report last changed:
        Serve's controller sends a replica's report to every router (the ingress replicas, its
        proxies) only when it differs from the one before, so an idle replica's reports, all
        alike, cost nothing past the call that asks for them."""
        stats = self._engine.stats()
        report = {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "waiting_tokens": stats.waiting_tokens,
            "num_free_pages": stats.num_free_pages,
            "kv_usage": stats.kv_usage,
            "prefix_keys": self._engine.prefix_summary(self._summary_pages),
            "stalled_s": self._stalled_s(stats),
            "answered": self._answered_counts(),
        }
        if report != self._last_report:
            self._last_report, self._last_report_time = report, time.time()
        return {"time": self._last_report_time, **report}

    def _answered_counts(self) -> dict[str, int]:
        """Requests answered per sender that sent in the last ANSWERED_REPORT_S. The counts
        are kept for good (one small entry per ingress process ever seen): a count that
        restarted from zero would make a router count its answered sends as unanswered."""
        now = time.monotonic()
        return {
            sender: n for sender, (n, at) in self._answered.items() if now - at < ANSWERED_REPORT_S
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self._engine.stats()
        return {
            "engine_requests": float(stats.num_running + stats.num_waiting),
            "kv_usage": float(stats.kv_usage),
        }

    def check_health(self) -> None:
        stats = self._engine.stats()
        if not stats.loop_alive:
            raise RuntimeError("engine loop is not running")
        silent_s = self._stalled_s(stats)
        if silent_s > self._stall_threshold_s:
            raise RuntimeError(f"engine has work but has not stepped for {silent_s:.0f} s")

    def _stalled_s(self, stats: EngineStats) -> float:
        """How long the engine has held work without finishing a step (0 when idle).

        The snapshot is taken at the end of a step, so during a step that hangs it still
        shows the idle state before it: ask the engine whether it holds work right now.
        The clock starts at the later of the last step and the arrival of work at an idle
        engine: a replica idle for minutes is not stalled during its first step."""
        busy = stats.num_running + stats.num_waiting > 0 or self._engine.has_work
        since = max(stats.last_step_time, self._engine.work_since)
        return time.monotonic() - since if busy else 0.0

    def __del__(self) -> Awaitable[None] | None:  # type: ignore[override]
        """Serve calls this when the replica stops, once its own calls have drained, and
        awaits what it returns (within graceful_shutdown_timeout_s). Sessions on the frame
        socket are not Serve calls: while any is open, the engine stops only after they
        end, so the requests they carry finish (a scale-down or an upgrade drains them)."""
        engine = getattr(self, "_engine", None)
        if engine is None:
            return None
        self._draining = True
        # a submit sent meanwhile is sent again elsewhere
        for link in getattr(self, "_submit_links", ()):
            link.close()
        if self._holds_socket_work():
            return self._stop_after_socket_sessions()
        engine.shutdown()
        return None

    def _holds_socket_work(self) -> bool:
        """Open frame-socket sessions, or requests accepted and unfinished (a submit over a
        link is not a Serve call, and its session opens only after its answer)."""
        if not getattr(self, "_frame_socket", False):
            return False
        return self._socket_sessions > 0 or any(
            not box.stream.finished for box in self._mailboxes.values()
        )

    async def _stop_after_socket_sessions(self) -> None:
        while self._holds_socket_work():
            await asyncio.sleep(0.05)
        self._engine.shutdown()
