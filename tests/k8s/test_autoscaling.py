"""Autoscaling for real: the cpu-demo Serve config on a local head + two worker nodes (a
`fake_gpu` resource per worker node stands in for a GPU pod), deployed through the
dashboard's REST API as KubeRay deploys serveConfigV2. Under sustained load the worker
deployment goes from 1 to 2 replicas, the second on the other worker node; when the load
stops it returns to 1; no request fails across either transition.

The run happens in a child process (tests/k8s/autoscale_run.py, ~1.5 min on two cores):
one Ray runtime per process, and other test modules keep theirs in this one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.autoscaling import POLICY_PATH
from tests.k8s.autoscale_run import NEW_REPLICA_REQUESTS
from tests.k8s.manifests import REPO

pytestmark = pytest.mark.slow  # `-m "not slow"` leaves it out of a quick local run

RUN_TIMEOUT_S = 900  # a generous bound for a loaded CI machine; ~100 s is typical


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("autoscale") / "record.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-m", "tests.k8s.autoscale_run", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(Path(out).read_text())


def test_starts_with_one_worker_replica(record: dict[str, Any]) -> None:
    assert record["initial_states"] == {"RUNNING": 1}
    assert record["fake_gpus_total"] == 2


def test_sustained_load_adds_a_replica_on_the_second_worker_node(record: dict[str, Any]) -> None:
    assert record["two_running_s"] is not None, record["timeline"]
    # Each worker node holds one fake GPU and each replica takes one: none free means the
    # two replicas sit on the two worker nodes.
    assert record["fake_gpus_free_at_two"] == 0
    assert record["new_replica"] not in (None, record["initial_replica"])
    served_by_new = [s for s in record["served"] if s[2] == record["new_replica"]]
    assert len(served_by_new) >= NEW_REPLICA_REQUESTS


def test_the_scale_up_follows_the_engine_load_signal(record: dict[str, Any]) -> None:
    """Serve runs kvray's policy (engine requests and KV usage, not its count of ongoing
    calls), and the signal passed its target before the second replica came."""
    assert record["autoscaling_policy"] == POLICY_PATH
    assert record["overload_s"] is not None, record["signal"]
    assert record["load_start_s"] <= record["overload_s"] <= record["two_running_s"]
    # one replica's engine held more requests than target_ongoing_requests before it scaled
    before = [s for s in record["signal"] if s[0] <= record["overload_s"] and s[3] == 1]
    assert any(requests > 2 for _, requests, _, _ in before), record["signal"]


def test_the_time_from_overload_to_the_new_replica_serving_is_reported(
    record: dict[str, Any],
) -> None:
    took = record["overload_to_serving_s"]
    assert took is not None and math.isfinite(took), record
    assert took == pytest.approx(record["new_replica_serving_s"] - record["overload_s"], abs=0.01)
    assert 0 < took < RUN_TIMEOUT_S


def test_idle_returns_to_one_replica(record: dict[str, Any]) -> None:
    assert record["back_to_one_s"] is not None, record["timeline"]
    assert record["back_to_one_s"] > record["load_stop_s"]
    assert record["final_states"] == {"RUNNING": 1}
    states = [s for _, s in record["timeline"]]
    assert max(sum(s.values()) for s in states) == 2  # never more than max_replicas


def _first(record: dict[str, Any], after: float, predicate: Any) -> float:
    return min(t for t, states in record["timeline"] if t >= after and predicate(states))


def test_no_request_fails_across_either_transition(record: dict[str, Any]) -> None:
    assert record["failures"] == []
    # none lost either: every request sent was answered (a hang would be a failure at 180 s)
    assert len(record["served"]) == record["requests_sent"]
    assert record["stopped_replica"] in (record["initial_replica"], record["new_replica"])
    # The light client streamed back to back all along: some of its requests overlapped the
    # start of the second replica and the stop of one, and none failed.
    up = (_first(record, 0, lambda s: sum(s.values()) == 2), record["two_running_s"])
    down = (
        _first(record, record["load_stop_s"], lambda s: "STOPPING" in s),
        record["back_to_one_s"],
    )
    streams = [(start, end) for start, end, _, kind in record["served"] if kind == "stream"]
    for first, last in (up, down):
        assert any(start <= last and end >= first for start, end in streams), (first, last)
