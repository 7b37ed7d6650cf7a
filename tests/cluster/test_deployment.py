"""WorkerDeployment without Ray: the test-only fault injector, health while a step hangs."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.deployment import FaultInjector, InjectedFault, WorkerDeployment
from worker.engine import EngineStats


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
