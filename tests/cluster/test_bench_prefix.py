"""`kvray bench cluster --scenarios prefix` at a tiny size on the local Ray: two worker
replicas whose KV caches the tenants' contexts overflow one by one, kvray's policy and
power-of-two choices, each with the control, and the staleness probe. The figures are CPU figures of a 135M model: the test
checks the result's shape and what must hold whatever the machine."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks import cluster as bench
from benchmarks.cluster_prefix import prefix_scenario
from cluster.config import ClusterConfig
from tests.cluster.conftest import ENGINE, RayHarness

TENANTS, QUESTIONS = 4, 3
ARGV = [
    "--replicas", "2",
    # round_robin is left to the unit tests: each policy redeploys (~25 s on two cores)
    "--policies", "prefix_load,power_of_two",
    "--tenants", str(TENANTS),
    "--tenant-context-len", "64",  # 4 pages of 16: one replica holds 12 pages, all four need 16
    "--tenant-questions", str(QUESTIONS),
    "--question-len", "8",
    "--answer-len", "2",
    "--tenant-rate", "16",
    "--tenant-concurrency", "8",
    "--control-requests", "8",
    "--staleness-trials", "3",
    "--router-replicas", "64",
    "--router-calls", "200",
]  # fmt: skip


@pytest.fixture(scope="module")
def result(ray_harness: RayHarness) -> Iterator[dict[str, Any]]:
    port = ray_harness.local_ray()
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(ARGV)
    base = ClusterConfig.model_validate(
        {
            "engine": {**ENGINE, "max_waiting": 64},
            "advanced": {"worker_cpu_threads": 1},  # two replicas on two cores
        }
    ).model_dump(mode="json")
    try:
        yield prefix_scenario(args, base, port, f"http://127.0.0.1:{port}", vocab=49152)
    finally:
        ray_harness.release_local()  # the shared app was replaced by this one


def test_every_policy_answers_every_request_of_both_loads(result: dict[str, Any]) -> None:
    json.dumps(result)  # the result file is plain JSON
    assert (result["requests"], result["warmup_requests"]) == (TENANTS * QUESTIONS, TENANTS)
    assert result["kv_tokens_per_replica"] < result["shared_context_tokens"]
    assert list(result["policies"]) == ["prefix_load", "power_of_two"]
    for policy, runs in result["policies"].items():
        for load in ("tenants", "control"):
            run = runs[load]
            sent = result["requests" if load == "tenants" else "control_requests"]
            assert (run["completed"], run["failed"]) == (sent, 0), (policy, load)
            assert run["output_throughput"] > 0 and run["request_throughput"] > 0
            assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"]
            assert run["itl_ms"]["p50"] <= run["itl_ms"]["p99"]
            rates = [run["prefix_hit_rate"], *run["per_replica_hit_rate"]]
            if load == "tenants":  # every answer named its replica: one home per tenant
                where = run["placement"]
                assert sum(where["tenants_per_replica"]) == TENANTS, (policy, where)
                assert 0.5 <= where["home_share"] <= 1.0 and where["questions_away"] >= 0
            assert runs["warmup_s"] > 0  # every tenant asked once before the measured run
            assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates), (policy, load, rates)


def test_kvrays_policy_hits_the_cache_at_least_as_often_as_power_of_two(
    result: dict[str, Any],
) -> None:
    runs = result["policies"]
    kvray, p2c = runs["prefix_load"], runs["power_of_two"]
    assert kvray["tenants"]["prefix_hit_rate"] >= p2c["tenants"]["prefix_hit_rate"], runs
    # two tenants a replica: placed by load alone, three could share one replica's 12 pages
    # and evict each other there (0.42 on it, 0.52 in all: below power-of-two in one CI run)
    assert min(kvray["tenants"]["per_replica_hit_rate"]) > 0.5, runs
    assert kvray["warmup_tenants_per_replica"] == [2, 2], runs
    assert kvray["tenants"]["placement"]["tenants_per_replica"] == [2, 2], runs
    # the tenants' contexts are what hits: the control shares nothing past a stray page
    assert kvray["tenants"]["prefix_hit_rate"] > kvray["control"]["prefix_hit_rate"] + 0.2


def test_the_router_views_staleness_and_decision_cost_are_reported(
    result: dict[str, Any],
) -> None:
    staleness = result["staleness"]
    assert staleness["trials"] == len(staleness["samples_ms"]) == 3
    assert all(0 < ms < 30_000 and math.isfinite(ms) for ms in staleness["samples_ms"])
    assert staleness["ms"]["p50"] <= staleness["ms"]["max"]
    decision = result["router_decision"]
    assert decision["replicas"] == 64
    assert 0 < decision["decision_us_p50"] <= decision["decision_us_p99"]


def test_placement_finds_each_tenants_home_and_the_questions_sent_elsewhere() -> None:
    from benchmarks.cluster_prefix import placement
    from benchmarks.stats import BenchSample, RequestResult

    a, b = [1, 2, 3], [4, 5, 6]  # two tenants' contexts
    prompts = [a + [7], b + [8], a + [9], a + [10], b + [11], b + [12], a + [13]]
    served = ["r1", "r2", "r1", "r2", "r2", None, "r1"]  # None: no answer, not counted
    where = placement(
        [BenchSample(p, 4) for p in prompts], [RequestResult(replica=r) for r in served], 3
    )
    assert where == {"home_share": 5 / 6, "tenants_per_replica": [1, 1], "questions_away": 1}
