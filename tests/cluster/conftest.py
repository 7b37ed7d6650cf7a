"""Real Ray Serve on this machine, shared by the cluster tests.

Starting Ray and the app costs ~20 s on two cores, so one app serves every single-node
test module (session fixture `served`), and the multi-node module swaps it for a
`ray.cluster_utils.Cluster` (one Ray runtime per process at a time). All apps run the real
engine on the demo model with a small KV cache so CPU steps stay fast.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import llguidance
import llguidance.hf
import pytest
import ray
from ray import serve

from cluster.app import (
    INGRESS_NAME,
    WORKER_NAME,
    build_app,
    build_app_with_fault_injection,
    cluster_runtime_env,
)
from cluster.config import ClusterConfig
from cluster.local_ray import free_port
from cluster.router import RouteHint
from cluster.transport import Accepted, decode_deltas, decode_first, encode_requests
from worker.guided import GuidedDecoding, check_guided
from worker.model.demo import ensure_demo_model
from worker.outputs import RequestDelta
from worker.tokenizer import Tokenizer
from worker.validation import EngineRequest

API_KEY = "test-key"
APP_NAME = "kvray"
ENGINE = {
    "model": "demo",
    "num_pages": 96,
    "max_running": 4,
    "max_waiting": 6,
    "max_seq_len": 512,
    "token_budget": 512,
}


@dataclass
class Served:
    """A running app: where it listens and how to reach its worker replicas."""

    config: ClusterConfig
    base_url: str

    @property
    def api_key(self) -> str:
        return self.config.api_keys[0] if self.config.api_keys else "unused"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def worker_handle(self) -> Any:
        return serve.get_deployment_handle(WORKER_NAME, app_name=APP_NAME)

    def open_on(self, replica_id: str, requests: list[EngineRequest]) -> Any:
        """Requests queued on one worker replica the way an ingress queues them (a `submit`
        call, then its `session` stream, as an ingress of its own); the session's response,
        whose `cancel()` aborts them, after its accept frame."""
        ingress_id, hint = uuid.uuid4().hex[:16], RouteHint(replica_id=replica_id)
        handle = self.worker_handle()
        body = encode_requests(requests)
        answer = decode_first(
            handle.options(method_name="submit").remote(hint, body, ingress_id).result()
        )
        assert isinstance(answer, Accepted) and answer.replica_id == replica_id, answer
        session = handle.options(method_name="session", stream=True).remote(hint, ingress_id)
        first = decode_first(next(iter(session)))
        assert isinstance(first, Accepted), first
        return session

    def generate_on(self, replica_id: str, requests: list[EngineRequest]) -> list[RequestDelta]:
        """`open_on`, read to the session's end: every delta."""
        return [d for frame in self.open_on(replica_id, requests) for d in decode_deltas(frame)]

    def worker_stats(self) -> dict[str, dict[str, Any]]:
        """Engine stats of every worker replica, by replica id."""
        stats = (
            self.worker_handle().broadcast("stats").results(timeout_s=30, return_exceptions=True)
        )
        return {s["replica_id"]: s for s in stats if isinstance(s, dict)}


def deploy(config: ClusterConfig, fault_injection: bool = False) -> Served:
    serve.start(http_options={"host": config.host, "port": config.port})
    build = build_app_with_fault_injection if fault_injection else build_app
    serve.run(build(config), name=APP_NAME, route_prefix="/")
    served = Served(config, f"http://{config.host}:{config.port}")
    wait_healthy(served)
    warm_up(served)
    return served


def warm_up(served: Served) -> None:
    """A few tiny requests, so engines have stepped (an engine that never stepped reports
    no free pages yet) and first-step costs are paid before a test measures anything."""
    body = {"model": served.config.model_name, "prompt": "Hello", "max_tokens": 2}
    for _ in range(served.config.worker_replicas):
        response = httpx.post(
            f"{served.base_url}/v1/completions", json=body, headers=served.headers(), timeout=120
        )
        response.raise_for_status()


def wait_healthy(served: Served, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{served.base_url}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the app did not become healthy")


class RayHarness:
    """Owns the one Ray runtime of this test process: a local one, or a multi-node Cluster."""

    def __init__(self) -> None:
        self.local: Served | None = None
        self.cluster: Any = None
        self._port = 0  # Serve's HTTP port on the local Ray

    def local_ray(self) -> int:
        """The local Ray of the shared app, with Serve started; its HTTP port. A test that
        deploys an app of its own over it sets `local` to None when done (`release_local`)."""
        if self.local is not None:
            return self.local.config.port
        if not (self._port and ray.is_initialized()):  # none, or not ours (HAProxy, several nodes)
            self.stop()
            ray.init(
                address="local",  # never another process's cluster on this machine
                num_cpus=4,
                runtime_env=cluster_runtime_env(),
                include_dashboard=False,
            )
            self._port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": self._port})
        return self._port

    def release_local(self) -> None:
        """The shared app was replaced: the next `local_app` deploys it again."""
        if self.local is not None:
            self._port = self.local.config.port
        self.local = None

    def local_app(self) -> Served:
        if self.local is None:
            port = self.local_ray()
            config = ClusterConfig.model_validate(
                {
                    "engine": ENGINE,
                    "api_keys": [API_KEY],
                    "port": port,
                    # a wide batch window: a burst must land in one window even on a loaded 2-core CI machine
                    "advanced": {
                        "router": {"stats_period_s": 0.2, "batch_window_ms": 25.0},
                        "limits": {"accept_timeout_s": 30},
                        "stall_timeout_s": 60,
                    },
                }
            )
            self.local = deploy(config)
        return self.local

    def haproxy_app(self, ingress_replicas: int) -> Served:
        """A local app behind HAProxy (`http_proxy: haproxy`): Serve's settings for it go into
        the job's runtime_env, so Ray starts afresh."""
        self.stop()
        config = ClusterConfig.model_validate(
            {
                "engine": ENGINE,
                "port": free_port(),
                "http_proxy": "haproxy",
                "ingress_replicas": ingress_replicas,
            }
        )
        ray.init(
            address="local",
            num_cpus=4,
            runtime_env=cluster_runtime_env(config),
            include_dashboard=False,
        )
        return deploy(config)

    def multinode_app(self, worker_nodes: int, worker_config: dict[str, Any]) -> Served:
        from ray.cluster_utils import Cluster

        self.stop()
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        for _ in range(worker_nodes):
            self.cluster.add_node(num_cpus=2, resources={"fake_gpu": 1})
        ray.init(address=self.cluster.address, runtime_env=cluster_runtime_env())
        self.cluster.wait_for_nodes()
        config = ClusterConfig.model_validate(
            {
                "engine": ENGINE,
                "port": free_port(),
                "worker_resources": {"fake_gpu": 1},
                **worker_config,
            }
        )
        return deploy(config)

    def stop(self) -> None:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        self.local = None
        self._port = 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules that start Ray their own way (several nodes) last among the cluster
    tests, so the single-node app starts once. Items of other directories keep their places."""
    here = [i for i, item in enumerate(items) if "tests/cluster/" in item.nodeid]
    ours = [items[i] for i in here]
    ours.sort(
        key=lambda item: any(
            m in item.nodeid
            for m in (
                "test_bench_prefix",
                "test_bench_front",
                "test_multinode",
                "test_local_ray",
                "test_haproxy",
            )
        )
    )
    for i, item in zip(here, ours, strict=True):
        items[i] = item


@pytest.fixture(scope="package")
def ray_harness() -> Iterator[RayHarness]:
    harness = RayHarness()
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def served(ray_harness: RayHarness) -> Served:
    return ray_harness.local_app()


@pytest.fixture(scope="module")
def client(served: Served) -> Any:
    """The official `openai` client of the shared app."""
    from openai import OpenAI

    return OpenAI(
        base_url=f"{served.base_url}/v1", api_key=served.api_key, max_retries=0, timeout=120
    )


__all__ = ["API_KEY", "ENGINE", "INGRESS_NAME", "WORKER_NAME", "Served", "RayHarness", "free_port"]


@pytest.fixture(scope="module")
def accepts() -> Callable[[GuidedDecoding, str], bool]:
    """Does a spec's grammar (checked as the ingress checks it) take a text whole, under the
    demo model's tokenizer?"""
    tokenizer = llguidance.hf.from_tokenizer(Tokenizer.from_dir(ensure_demo_model()).hf_tokenizer)

    def accepts(guided: GuidedDecoding, text: str) -> bool:
        check_guided(guided)
        matcher = llguidance.LLMatcher(tokenizer, guided.grammar_text(), log_level=0)
        ok = all(matcher.consume_token(t) for t in tokenizer.tokenize_str(text))
        return ok and matcher.is_accepting()

    return accepts
