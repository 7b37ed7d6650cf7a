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
- Every request is checked again as the engine takes it (`worker.validation`, the ingress's
  own rules): a worker trusts no caller to have gone through the ingress.

A replica reports its load and prefix-cache keys to routers (`record_routing_stats`), its
queue depth and KV usage to the autoscaler (`record_autoscaling_stats`), and counts as
unhealthy when the engine loop died or has work but stopped stepping. Built with
`fault_injection` (tests only), it also takes `inject_fault` calls that make its next engine
steps raise or stall.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator
from itertools import islice, takewhile
from typing import Any

import torch
from ray import serve

from cluster.config import worker_torch_threads
from cluster.metrics import rss_bytes
from cluster.router import RouteHint
from cluster.transport import (
    decode_requests,
    encode_accepted,
    encode_deltas,
    encode_refused,
)
from worker.config import EngineConfig
from worker.cores import usable_cores
from worker.engine import Engine, EngineFull, EngineStats
from worker.heap import freeze_heap
from worker.outputs import merge_steps
from worker.request import ScheduledTask
from worker.streams import OutputStream
from worker.validation import EngineRequest, InvalidRequest

HEARTBEAT = encode_deltas([])  # an empty step frame: "still queued, the engine is stepping"
ANSWERED_REPORT_S = 600.0  # a sender's answered count is reported while it sent in this window
# A queued prompt's page keys are reported as cached for this long: every router then sends
# its tenant's next prompts here before the engine has computed (and itself reports) them.
QUEUED_KEYS_S = 10.0

log = logging.getLogger(__name__)


def set_cpu_threads(config: EngineConfig, threads: int | None) -> None:
    """Set this process's torch threads as a worker replica's engine has them (`threads`:
    `ClusterConfig.advanced.worker_cpu_threads`): Ray caps an actor's at its `num_cpus`."""
    threads = worker_torch_threads(config, threads, usable_cores(), torch.cuda.is_available())
    if threads is not None:
        torch.set_num_threads(threads)


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
            raise PermissionError(
                "fault injection is off (build_app(..., fault_injection=True), tests only)"
            )
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


class WorkerDeployment:
    """The body of the worker deployment; `app.build_app` wraps it with `serve.deployment`."""

    def __init__(
        self,
        engine_config: EngineConfig,
        summary_pages: int | None = None,
        stall_threshold_s: float = 60.0,
        cpu_threads: int | None = None,
        fault_injection: bool = False,
        heartbeat_s: float = 5.0,
        orphan_timeout_s: float = 60.0,
        linger_s: float = 2.0,
    ):
        set_cpu_threads(engine_config, cpu_threads)
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
        # page key -> until when (monotonic) it is reported for a prompt queued here; oldest first
        self._queued_keys: dict[int, float] = {}
        self._max_queued_keys = self._engine.executor.cache.num_total_pages  # no more are cached
        self._last_report: dict[str, Any] | None = None  # record_routing_stats, and since when
        self._last_report_time = 0.0
        self._stall_threshold_s = stall_threshold_s
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        frozen = freeze_heap()  # no full collection walks the weights and modules mid-step
        log.info(
            "worker replica %s ready (%d objects frozen): %s",
            self._replica_id,
            frozen,
            self._engine.config,
        )

    async def submit(self, hint: RouteHint, payload: bytes, ingress_id: str) -> bytes:
        """Queue a batch of requests for `ingress_id`; answers accept or refuse. Their
        deltas come on that ingress's `session`."""
        try:
            requests = decode_requests(payload)
        except InvalidRequest as exc:
            return encode_refused("invalid", exc.message)
        answer = self._accept(hint, requests, ingress_id)
        # Counted once the prompts' keys are queued: a report that shows the answer shows
        # their pages (the routers add the unanswered requests' pages themselves).
        if isinstance(hint.sender, str):  # counted here: the hint's count is the caller's word
            count, _ = self._answered.get(hint.sender, (0, 0.0))
            self._answered[hint.sender] = (count + len(requests), time.monotonic())
        return answer

    def _accept(self, hint: RouteHint, requests: list[EngineRequest], ingress_id: str) -> bytes:
        box = self._mailboxes.get(ingress_id)
        if box is None or box.stream.closed:
            box = Mailbox(OutputStream([], self._engine.abort))
        try:
            self._engine.submit(requests, into=box.stream)
        except EngineFull as exc:
            return encode_refused("full", str(exc) or "the worker's waiting queue is full")
        except ValueError as exc:  # worker.validation's rules, checked by the engine
            return encode_refused("invalid", str(exc))
        self._mailboxes[ingress_id] = box
        if not box.attached:
            self._reap_later(ingress_id, box)
        if hint.page_hashes:
            self._queue_keys(hint.page_hashes)
        return encode_accepted(self._replica_id)

    def _queue_keys(self, prompts: tuple[tuple[int, ...], ...]) -> None:
        """Report the accepted prompts' leading page keys (the ingress hashed them for the
        router) for QUEUED_KEYS_S, at most as many keys as the cache has pages."""
        until, keys = time.monotonic() + QUEUED_KEYS_S, self._queued_keys
        for prompt in prompts:
            for key in prompt:
                keys.pop(key, None)  # to the end: the order stays the expiry order
                keys[key] = until
        excess = len(keys) - self._max_queued_keys
        for key in list(islice(keys, max(0, excess))):
            del keys[key]

    def _prefix_keys(self) -> tuple[list[int], int]:
        """The prompts queued here (newest first), then the engine's cached pages (at most
        `summary_pages` of them); and how many there are in all."""
        cached, keys, now = self._engine.prefix_summary(), self._queued_keys, time.monotonic()
        expired = list(takewhile(lambda key: keys[key] <= now, keys))
        for key in expired:
            del keys[key]
        if keys:
            cached = [*reversed(keys), *(key for key in cached if key not in keys)]
        shown = cached if self._summary_pages is None else cached[: self._summary_pages]
        return shown, len(cached)

    async def session(self, hint: RouteHint, ingress_id: str) -> AsyncGenerator[bytes, None]:
        """The deltas of everything `ingress_id` queued here: an accept frame, then one
        frame per engine step (the steps since the last frame, if this reader lags), and a
        heartbeat after `heartbeat_s` of silence in which the engine stepped. Ends once
        none of them has been unfinished for `linger_s`; a cancelled session aborts what is
        unfinished."""
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
        ended = False
        try:
            steps = self._engine.stats_snapshot.num_steps
            idle_since: float | None = None
            spoke = time.monotonic()  # of the last frame or heartbeat
            while box.session == number:
                wake.clear()
                frames, finished = box.stream.drain()
                if frames:
                    idle_since, steps = None, self._engine.stats_snapshot.num_steps
                    spoke = time.monotonic()
                    yield encode_deltas(frames[0] if len(frames) == 1 else merge_steps(frames))
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
                    # Two steps on, a whole step surely went by with nothing of ours (the
                    # engine publishes a step's frames after its snapshot). One step is
                    # enough after two periods of silence: slow steps are not a stall.
                    now_steps = self._engine.stats_snapshot.num_steps
                    silent_s = time.monotonic() - spoke
                    moved = now_steps - steps
                    if not finished and (
                        moved >= 2 or (moved >= 1 and silent_s >= 2 * self._heartbeat_s)
                    ):
                        steps, spoke = now_steps, time.monotonic()
                        yield HEARTBEAT  # queued behind others: not a stalled worker
            ended = True  # replaced by a newer session
        finally:
            unregister()
            if box.session == number:
                box.attached, box.wake = False, None
                if not ended:  # cancelled: the ingress gave up on these requests, or died
                    box.stream.close()
                    if self._mailboxes.get(ingress_id) is box:
                        del self._mailboxes[ingress_id]
                elif not box.stream.finished:
                    self._reap_later(ingress_id, box)

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

    async def abort(self, hint: RouteHint, request_ids: list[str], ingress_id: str) -> None:
        """Abort requests `ingress_id` queued here (another ingress's ids are left alone)."""
        box = self._mailboxes.get(ingress_id)
        for request_id in request_ids:
            if box is not None and box.stream.holds(request_id):
                self._engine.abort(request_id)

    async def inject_fault(self, hint: RouteHint, steps: int = 1, stall_s: float = 0.0) -> str:
        """Tests: make this replica's next `steps` steps raise (or stall `stall_s` seconds
        each). Refused (PermissionError) unless the config enables fault injection. Route it
        with `RouteHint(replica_id=...)`; returns the replica id that took it."""
        self._faults.arm(steps, stall_s)
        return self._replica_id

    async def info(self, hint: RouteHint | None = None) -> dict[str, Any]:
        """The resolved engine config the ingress validates prompts against, and which
        replica answered (routed like a submit, it shows where the router sends a prompt)."""
        config = self._engine.config
        return {
            "replica_id": self._replica_id,
            "max_seq_len": config.max_seq_len,
            "vocab_size": self._engine.model_config.vocab_size,
            "page_size": config.advanced.page_size,
            "prefix_cache": config.prefix_cache,
            "engine": config.model_dump(),
        }

    async def stats(self) -> dict[str, Any]:
        """Engine stats for /metrics, tagged with this replica's id."""
        stats = self._engine.stats()
        return {
            "replica_id": self._replica_id,
            "pid": os.getpid(),
            "faults_injected": self._faults.injected,
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
        keys, resident = self._prefix_keys()
        report = {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "waiting_tokens": stats.waiting_tokens,
            "num_free_pages": stats.num_free_pages,
            "num_total_pages": stats.num_total_pages,
            "kv_usage": stats.kv_usage,
            "prefix_keys": keys,
            "resident_pages": resident,  # pages of prefixes held or queued here, `keys` or not
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

    def __del__(self) -> None:
        """Serve calls this when the replica stops, once its own calls have drained."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
