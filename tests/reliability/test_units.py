"""Reliability pieces that need no Ray: the fault injector, retry before accept, draining."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.deployment import FaultInjector, InjectedFault, WorkerDeployment
from cluster.dispatch import Dispatcher, Group
from cluster.transport import encode_accepted, encode_deltas
from worker.engine import EngineStats
from worker.outputs import RequestDelta
from worker.sampling import SamplingParams
from worker.validation import EngineRequest


def test_fault_injection_is_refused_unless_the_config_enables_it() -> None:
    with pytest.raises(PermissionError):
        FaultInjector(enabled=False).arm(steps=1)


def test_armed_injector_fails_exactly_the_armed_steps() -> None:
    faults = FaultInjector(enabled=True)
    faults([])  # not armed: nothing happens
    faults.arm(steps=2)
    for _ in range(2):
        with pytest.raises(InjectedFault):
            faults([])
    faults([])
    assert faults.injected == 2


def test_stalling_injector_sleeps_instead_of_raising() -> None:
    faults = FaultInjector(enabled=True)
    faults.arm(steps=1, stall_s=0.01)
    faults([])
    assert faults.injected == 1


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


class _HungEngine:
    """An engine whose current step hangs: its last snapshot (taken before the step) shows
    it idle, but it holds work (that arrived `work_age_s` ago)."""

    has_work = True

    def __init__(self, work_age_s: float = 120.0):
        self.work_since = time.monotonic() - work_age_s

    def stats(self) -> EngineStats:
        return EngineStats(loop_alive=True, last_step_time=time.monotonic() - 120)

    def shutdown(self) -> None:
        pass


def test_health_fails_when_a_step_hangs_although_the_last_snapshot_shows_idle() -> None:
    replica = object.__new__(WorkerDeployment)  # no Serve replica context: only the check
    replica._engine = _HungEngine()  # type: ignore[assignment]
    replica._stall_threshold_s = 60.0
    with pytest.raises(RuntimeError, match="has not stepped"):
        replica.check_health()


def test_a_replica_idle_for_long_is_not_stalled_while_its_first_step_runs() -> None:
    replica = object.__new__(WorkerDeployment)
    replica._engine = _HungEngine(work_age_s=0.5)  # type: ignore[assignment]
    replica._stall_threshold_s = 60.0
    replica.check_health()  # idle 120 s, then work for 0.5 s: healthy
    assert 0.4 < replica._stalled_s(replica._engine.stats()) < 5.0  # the router's measure too


def test_metrics_split_time_to_first_token_between_serve_and_the_engine() -> None:
    from cluster.metrics import Metrics
    from worker.outputs import RequestMetrics

    metrics = Metrics("m", "ing-1")
    metrics.observe_choice(0.30, None, 0.5, 1)  # at the ingress
    metrics.observe_engine(
        RequestMetrics(
            queue_time=0.01, time_to_first_token=0.25, time_per_output_token=0.0, e2e_latency=0.4
        )
    )
    text = metrics.render([]).decode()

    def total(name: str) -> float:
        return float(
            next(x for x in text.splitlines() if x.startswith(f"{name}_sum{{")).split()[-1]
        )

    assert total("kvray:time_to_first_token_seconds") == 0.30
    assert total("kvray:engine_time_to_first_token_seconds") == 0.25
    assert total("kvray:request_queue_time_seconds") == 0.01


def test_metrics_show_a_hung_step_as_stalled_seconds() -> None:
    from cluster.metrics import Metrics

    replica = object.__new__(WorkerDeployment)
    replica._engine = _HungEngine(work_age_s=120.0)  # type: ignore[assignment]
    replica._replica_id = "w-hung"
    replica._faults = FaultInjector(enabled=False)
    stats = asyncio.run(replica.stats())
    assert 119.0 < stats["stalled_s"] < 130.0
    text = Metrics("m", "ing-1").render([stats]).decode()
    line = next(x for x in text.splitlines() if x.startswith("kvray:engine_stalled_seconds{"))
    assert 'replica="w-hung"' in line and 119.0 < float(line.split()[-1]) < 130.0
