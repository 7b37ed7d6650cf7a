"""Autoscale the cpu-demo Serve config for real on a local multi-node Ray cluster.

    python -m tests.k8s.autoscale_run [--json OUT]

Runs in its own process (test_autoscaling.py starts it) so its three-node
`ray.cluster_utils.Cluster` never meets the Ray runtime other test modules keep in the
pytest process. What KubeRay does is done here by hand: the head's dashboard receives the
Serve config of k8s/overlays/cpu-demo over the same REST call (PUT /api/serve/applications/),
changed only where a laptop differs from a pod: a `fake_gpu` custom resource (one per worker
node) stands in for the worker pods' `kvray_worker`, delays are seconds instead of minutes,
and the KV cache is tiny. Then:

1. a light client streams one request at a time for the whole run;
2. load starts: LOAD_CLIENTS clients send requests back to back; the policy asks for a
   second worker replica, which can only go to the second worker node;
3. once the new replica has served a few requests, the load stops; the deployment goes back
   to one replica while the light client keeps streaming.

It records (does not judge) the replica counts over time, the autoscaling signal the
replicas report (engine requests and KV usage, as EngineLoadPolicy reads them), which
replica served each request, every failed request, and the times, among them the time
from overload (the first signal past its target) to the new replica's first answer; the
test asserts on that record.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx

from cluster.local_ray import free_port
from tests.k8s.manifests import REPO, compose

WORKER = "KvrayWorker"
APP = "kvray"
LOAD_CLIENTS = 6
NEW_REPLICA_REQUESTS = 3  # stop the load once the new replica has served this many
PHASE_TIMEOUT_S = 240.0

# What differs from the cpu-demo overlay: tiny engine, fake GPUs, seconds-long delays.
TEST_ARGS: dict[str, Any] = {
    "engine": {
        "num_pages": 96,
        "max_running": 4,
        "max_waiting": 64,
        "max_seq_len": 512,
        "token_budget": 512,
    },
    "worker_resources": {"fake_gpu": 1},
    "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2},
    "advanced": {
        "worker_cpu_threads": 1,
        "router": {"stats_period_s": 0.2},
        "upscale_delay_s": 2,
        "downscale_delay_s": 6,
        "autoscaling_look_back_s": 2,
        "autoscaling_metrics_interval_s": 0.5,
    },
    "host": "127.0.0.1",
}


@dataclass
class Record:
    """Everything observed; times are seconds since the load started."""

    date: str = field(default_factory=lambda: date.today().isoformat())
    cpus: int = field(default_factory=lambda: os.cpu_count() or 0)
    loadavg_before: tuple[float, ...] = ()
    loadavg_after: tuple[float, ...] = ()
    setup_s: float = 0.0
    initial_replica: str = ""
    initial_states: dict[str, int] = field(default_factory=dict)
    autoscaling_policy: str | None = None  # the worker deployment's, as Serve runs it
    load_start_s: float | None = None
    overload_s: float | None = None  # first sample of the signal past its target
    two_running_s: float | None = None
    new_replica: str | None = None
    new_replica_serving_s: float | None = None  # its first request answered
    overload_to_serving_s: float | None = None  # new_replica_serving_s - overload_s
    fake_gpus_total: float = 0.0
    fake_gpus_free_at_two: float | None = None
    load_stop_s: float | None = None
    back_to_one_s: float | None = None
    final_states: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    # (time, engine requests summed over the replicas, mean KV usage, replicas reporting)
    signal: list[tuple[float, float, float, int]] = field(default_factory=list)
    requests_sent: int = 0
    served: list[tuple[float, float, str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stopped_replica: str | None = None  # the one scale-in took away
    served_while_stopping: int = 0  # its requests that ended after it began to stop


def serve_config(port: int) -> dict[str, Any]:
    """The cpu-demo overlay's serveConfigV2 with TEST_ARGS merged into its ClusterConfig."""
    config = copy.deepcopy(compose("cpu-demo").serve_config)
    config["proxy_location"] = "HeadOnly"  # all nodes share one host here: one proxy port
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    (app,) = config["applications"]
    app["args"] = _merged(app["args"], {**TEST_ARGS, "port": port})
    return config


def _merged(args: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """ClusterConfig args with `update` applied: its sections (engine, autoscaling, advanced)
    are merged field by field, every other key is replaced."""
    out = dict(args)
    for key, value in update.items():
        out[key] = {**args.get(key, {}), **value} if key in _SECTIONS else value
    return out


_SECTIONS = ("engine", "autoscaling", "advanced")


def wait_for(predicate: Callable[[], bool], timeout_s: float = PHASE_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


class Run:
    """One autoscaling run against a running cluster; fills a Record."""

    def __init__(self, base_url: str, record: Record, autoscaling: dict[str, Any]) -> None:
        """`autoscaling`: the app's ClusterConfig `autoscaling` section (the targets)."""
        self.base_url = base_url
        self.record = record
        self.target_requests = float(autoscaling["target_ongoing_requests"])
        self.target_kv = float(autoscaling.get("target_kv_usage", 0.9))
        self.t0 = time.monotonic()
        self.load_on = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def replica_states(self) -> dict[str, int]:
        from ray import serve

        app = serve.status().applications.get(APP)
        if app is None or WORKER not in app.deployments:
            return {}
        return {str(k): v for k, v in app.deployments[WORKER].replica_states.items()}

    def watch(self) -> None:
        """Record every change of the worker deployment's replica states, and the signal."""
        last: dict[str, int] | None = None
        while not self.stop.is_set():
            states = self.replica_states()
            if states != last:
                with self.lock:
                    self.record.timeline.append((self.now(), states))
                last = states
            self.sample_signal()
            time.sleep(0.25)

    def sample_signal(self) -> None:
        """What EngineLoadPolicy reads, as the replicas report it on /metrics now (no Serve
        handle here: its background tasks would reconnect to Ray after the run's shutdown);
        the first sample past a target (mean requests per replica, or mean KV usage) while
        the load runs is the overload."""
        try:
            text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        except httpx.HTTPError:  # a replica starting or stopping: the next sample
            return
        per_replica = _engine_gauges(text)
        if not per_replica:
            return
        requests = sum(g["requests"] for g in per_replica.values())
        kv = sum(g["kv_usage"] for g in per_replica.values()) / len(per_replica)
        with self.lock:
            self.record.signal.append((self.now(), requests, round(kv, 3), len(per_replica)))
            over = requests / len(per_replica) > self.target_requests or kv > self.target_kv
            if over and self.load_on.is_set() and self.record.overload_s is None:
                self.record.overload_s = self.now()

    def sent(self) -> None:
        with self.lock:
            self.record.requests_sent += 1

    def served(self, start: float, replica: str, kind: str) -> None:
        with self.lock:
            self.record.served.append((start, self.now(), replica, kind))

    def failed(self, what: str) -> None:
        with self.lock:
            self.record.failures.append(f"{self.now()}: {what}")

    def load_client(self, i: int) -> None:
        body = {"model": "demo", "prompt": f"Story {i}:", "max_tokens": 24, "ignore_eos": True}
        with httpx.Client(base_url=self.base_url, timeout=180) as client:
            while self.load_on.is_set():
                start = self.now()
                self.sent()
                try:
                    response = client.post("/v1/completions", json=body)
                    if response.status_code != 200 or not response.json()["choices"][0]["text"]:
                        self.failed(f"load {response.status_code} {response.text[:200]}")
                    else:
                        self.served(start, response.headers["x-kvray-replica"], "load")
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    self.failed(f"load {type(exc).__name__}: {exc}")

    def light_client(self) -> None:
        """One streaming request at a time, through both transitions."""
        body = {"model": "demo", "prompt": "Count:", "max_tokens": 16, "ignore_eos": True}
        body["stream"] = True
        with httpx.Client(base_url=self.base_url, timeout=180) as client:
            while not self.stop.is_set():
                start = self.now()
                self.sent()
                try:
                    self._stream_once(client, body, start)
                except httpx.HTTPError as exc:
                    self.failed(f"stream {type(exc).__name__}: {exc}")

    def _stream_once(self, client: httpx.Client, body: dict[str, Any], start: float) -> None:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data:")]
            ok = response.status_code == 200 and lines and lines[-1] == "data: [DONE]"
            if not ok or any(_is_error_event(line) for line in lines[:-1]):
                self.failed(f"stream {response.status_code} {lines[-2:]}")
            else:
                self.served(start, response.headers["x-kvray-replica"], "stream")

    def served_by(self, replica: str) -> int:
        with self.lock:
            return sum(1 for s in self.record.served if s[2] == replica)

    def new_replica(self) -> str | None:
        """A replica other than the first one that has answered a request, if any."""
        with self.lock:
            others = {s[2] for s in self.record.served} - {self.record.initial_replica}
        return next(iter(others), None)


_GAUGES = {
    "kvray:num_requests_running": "requests",
    "kvray:num_requests_waiting": "requests",
    "kvray:kv_cache_usage_perc": "kv_usage",
}


def _engine_gauges(text: str) -> dict[str, dict[str, float]]:
    """Engine requests (running + waiting) and KV usage per worker replica from /metrics."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name not in _GAUGES or 'replica="' not in line:
            continue
        replica = line.split('replica="', 1)[1].split('"', 1)[0]
        gauges = out.setdefault(replica, {"requests": 0.0, "kv_usage": 0.0})
        gauges[_GAUGES[name]] += float(line.rsplit(" ", 1)[1])
    return out


def _is_error_event(line: str) -> bool:
    """An SSE data line that is an error object, or not JSON at all (a chunk whose token reads
    `"error"` is neither: a substring test took one for an error once)."""
    try:
        event = json.loads(line.removeprefix("data:").strip())
    except ValueError:
        return True
    return not isinstance(event, dict) or "error" in event


def scale_up_and_down(run: Run) -> None:
    import ray

    record = run.record
    load = [threading.Thread(target=run.load_client, args=(i,)) for i in range(LOAD_CLIENTS)]
    record.load_start_s = run.now()
    run.load_on.set()
    for thread in load:
        thread.start()
    if wait_for(lambda: run.replica_states().get("RUNNING", 0) == 2):
        record.two_running_s = run.now()
        record.fake_gpus_free_at_two = ray.available_resources().get("fake_gpu", 0.0)
    if wait_for(lambda: run.new_replica() is not None):
        new = record.new_replica = run.new_replica() or ""
        with run.lock:
            record.new_replica_serving_s = min(s[1] for s in record.served if s[2] == new)
            if record.overload_s is not None:
                record.overload_to_serving_s = round(
                    record.new_replica_serving_s - record.overload_s, 2
                )
        wait_for(lambda: run.served_by(new) >= NEW_REPLICA_REQUESTS)
    run.load_on.clear()
    for thread in load:
        thread.join()
    record.load_stop_s = run.now()
    if wait_for(lambda: run.replica_states() == {"RUNNING": 1}):
        record.back_to_one_s = run.now()
        done = len(record.served)
        wait_for(lambda: len(record.served) >= done + 2, timeout_s=60)  # one replica still serves
    record.final_states = run.replica_states()
    _note_scale_in(record)


def _note_scale_in(record: Record) -> None:
    """Which replica scale-in stopped (the one of the two that served nothing after the
    count was back to one), and how many of its requests ended once it was stopping."""
    if record.back_to_one_s is None or record.new_replica is None or record.load_stop_s is None:
        return
    after = {s[2] for s in record.served if s[0] >= record.back_to_one_s}
    gone = {record.initial_replica, record.new_replica} - after
    if len(gone) != 1:
        return
    record.stopped_replica = gone.pop()
    stopping = [
        t for t, states in record.timeline if t >= record.load_stop_s and "STOPPING" in states
    ]
    if stopping:
        record.served_while_stopping = sum(
            1 for s in record.served if s[2] == record.stopped_replica and s[1] >= stopping[0]
        )


def deployed_policy(dashboard: str) -> str | None:
    """The worker deployment's autoscaling policy as the dashboard reports the deployed app."""
    response = httpx.get(
        f"{dashboard}/api/serve/applications/", headers=_auth_headers(), timeout=30
    )
    response.raise_for_status()
    app = response.json()["applications"][APP]
    auto = app["deployments"][WORKER]["deployment_config"].get("autoscaling_config") or {}
    policy = auto.get("policy") or {}
    return policy.get("policy_function") if isinstance(policy, dict) else None


def start_cluster() -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1"},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, resources={"fake_gpu": 1})
    return cluster


def _auth_headers() -> dict[str, str]:
    """Ray 2.60 turns on token auth for a local `ray.init()` and exports RAY_AUTH_MODE=token to
    child processes (this one, when pytest has run Ray before): then the dashboard wants the
    token, as KubeRay sends it on an auth-enabled cluster."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return {}
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    return {"authorization": f"Bearer {token}"}


def deploy(dashboard: str, config: dict[str, Any]) -> None:
    """What KubeRay does with serveConfigV2: PUT it to the head's dashboard."""
    headers = _auth_headers()

    def put() -> bool:
        try:
            response = httpx.put(
                f"{dashboard}/api/serve/applications/", json=config, timeout=60, headers=headers
            )
        except httpx.HTTPError:
            return False  # the dashboard is still starting
        response.raise_for_status()
        return True

    if not wait_for(put, timeout_s=120):
        raise TimeoutError("the dashboard never accepted the Serve config")


def first_response(base_url: str) -> str:
    """Wait until the app answers, then return the replica that served a first request."""
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 2}

    def healthy() -> bool:
        _raise_if_deploy_failed()
        try:
            return httpx.get(f"{base_url}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_for(healthy):
        raise TimeoutError("the app never became healthy")
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.headers["x-kvray-replica"]


def _raise_if_deploy_failed() -> None:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is not None and app.status == "DEPLOY_FAILED":
        raise RuntimeError(f"the Serve app failed to deploy: {app.message}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the record here (default: stdout)")
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )  # Ray worker processes inherit it from the nodes started below
    record = Record(loadavg_before=os.getloadavg())
    started = time.monotonic()
    port = free_port()
    import ray

    cluster = start_cluster()
    try:
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        cluster.wait_for_nodes()
        config = serve_config(port)
        deploy(f"http://{cluster.webui_url}", config)
        base_url = f"http://127.0.0.1:{port}"
        record.initial_replica = first_response(base_url)
        record.autoscaling_policy = deployed_policy(f"http://{cluster.webui_url}")
        record.setup_s = round(time.monotonic() - started, 1)
        record.fake_gpus_total = ray.cluster_resources().get("fake_gpu", 0.0)
        run = Run(base_url, record, config["applications"][0]["args"]["autoscaling"])
        record.initial_states = run.replica_states()
        watcher = threading.Thread(target=run.watch, daemon=True)
        light = threading.Thread(target=run.light_client)
        watcher.start()
        light.start()
        try:
            scale_up_and_down(run)
        finally:
            run.stop.set()
            run.load_on.clear()
            light.join()
            watcher.join()
    finally:
        ray.shutdown()
        cluster.shutdown()  # ends Serve with the nodes; a graceful serve.shutdown costs ~10 s
    record.loadavg_after = os.getloadavg()
    text = json.dumps(asdict(record), indent=1)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
