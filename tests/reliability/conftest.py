"""One Ray Serve app for every reliability test: two worker and two ingress replicas, fault
injection on, a short stall timeout.

Ray allows one runtime per process, so the app is package-scoped like tests/cluster's, and
the modules run in the order below: the ones that kill replicas or shrink the app come last.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from cluster.app import INGRESS_NAME, cluster_runtime_env
from cluster.config import ClusterConfig
from cluster.router import RouteHint
from tests.cluster.conftest import ENGINE, RayHarness, Served, deploy, free_port

STALL_TIMEOUT_S = 10.0  # a loaded 2-core CI machine has steps of several seconds
MODULE_ORDER = (
    "test_faults",
    "test_stalled_routing",
    "test_overload",
    "test_soak",
    "test_kill",
    "test_drain",
)


def reliability_config(**overrides: Any) -> ClusterConfig:
    data: dict[str, Any] = {
        "engine": ENGINE,
        "port": free_port(),
        "worker_replicas": 2,
        "ingress_replicas": 2,
        "advanced": {
            "router": {"stats_period_s": 0.2},
            "limits": {"accept_timeout_s": 30},
            "stall_reroute_s": 1.0,
            "stall_timeout_s": STALL_TIMEOUT_S,
            "drain_timeout_s": 120,
            "drain_poll_s": 0.5,
        },
        **overrides,
    }
    return ClusterConfig.model_validate(data)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within tests/reliability, run modules in MODULE_ORDER; other items keep their places."""
    here = [i for i, item in enumerate(items) if "tests/reliability/" in item.nodeid]
    ours = [items[i] for i in here]

    def rank(item: pytest.Item) -> int:
        name = item.nodeid.split("/")[-1].split(".py")[0]
        return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)

    ours.sort(key=rank)
    for i, item in zip(here, ours, strict=True):
        items[i] = item


@pytest.fixture(scope="package")
def app() -> Iterator[Served]:
    harness = RayHarness()
    harness.stop()
    ray.init(
        address="local",
        num_cpus=8,
        runtime_env=cluster_runtime_env(),
        include_dashboard=False,
    )
    try:
        yield deploy(reliability_config(), fault_injection=True)
    finally:
        harness.stop()


# -- helpers shared by the modules ---------------------------------------------------------------


def post(served: Served, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{served.base_url}{path}", json=body, timeout=timeout)


def completion_body(prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def sse_lines(served: Served, body: dict[str, Any], timeout: float = 120) -> list[str]:
    """Every `data:` line of one streaming completion (the status must be 200)."""
    with httpx.stream(
        "POST", f"{served.base_url}/v1/completions", json={**body, "stream": True}, timeout=timeout
    ) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line.startswith("data:")]


def arm_faults(served: Served, steps: int, stall_s: float = 0.0) -> list[str]:
    """Arm (steps > 0) or disarm (0) the fault injector of every worker replica."""
    results = served.worker_handle().broadcast("inject_fault", RouteHint(), steps, stall_s)
    return list(results.results(timeout_s=30))


def arm_fault(served: Served, replica_id: str, steps: int, stall_s: float = 0.0) -> str:
    handle = served.worker_handle().options(method_name="inject_fault")
    return str(handle.remote(RouteHint(replica_id=replica_id), steps, stall_s).result(timeout_s=30))


def wait_all_idle(
    served: Served, replicas: int = 2, timeout_s: float = 60
) -> dict[str, dict[str, Any]]:
    """Stats once `replicas` workers report nothing running or waiting and every page free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = served.worker_stats()
        idle = len(stats) == replicas and all(
            s["num_running"] == 0
            and s["num_waiting"] == 0
            and s["num_free_pages"] == s["num_total_pages"]
            for s in stats.values()
        )
        if idle:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"workers did not become idle: {stats}")
        time.sleep(0.2)


def ingress_handle() -> Any:
    return serve.get_deployment_handle(INGRESS_NAME, app_name="kvray")
