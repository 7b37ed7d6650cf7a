"""cluster.local_ray: several Ray nodes on this machine (`kvray serve --ray-nodes`), each with
its own Serve HTTP proxy, all on one port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
from ray.serve.schema import ProxyStatus

from cluster.local_ray import (
    gpus_of_nodes,
    ray_session,
)
from tests.cluster.conftest import RayHarness, free_port

REPO = Path(__file__).resolve().parents[2]


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 1})
class WhereAmI:
    """Two replicas of one CPU on nodes of one CPU: one on each node (so each node gets a proxy)."""

    def __call__(self, request) -> str:
        return ray.get_runtime_context().get_node_id()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Niceness:
    def __call__(self, request) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)


def _run_driver(
    driver: str, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`driver` (Python source) run in a process of its own, from the repository's root."""
    return subprocess.run(
        [sys.executable, "-c", driver],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
        cwd=REPO,
        env=env,
    )


def _proxies_healthy(expected: int, timeout_s: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proxies = serve.status().proxies
        if len(proxies) == expected and all(s == ProxyStatus.HEALTHY for s in proxies.values()):
            return proxies
        time.sleep(0.5)
    raise AssertionError(f"proxies: {serve.status().proxies}")


def test_two_local_nodes_serve_through_a_proxy_each_on_one_port(ray_harness: RayHarness):
    ray_harness.stop()  # this test process's shared Ray, if a module before this one started it
    port = free_port()
    with ray_session(nodes=2, num_cpus=2, include_dashboard=False, log_to_driver=False):
        try:
            alive = [n for n in ray.nodes() if n["Alive"]]
            assert len(alive) == 2 and all(n["Resources"]["CPU"] == 1 for n in alive)
            serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "EveryNode"})
            serve.run(WhereAmI.bind(), name="where", route_prefix="/where")
            proxies = _proxies_healthy(2)  # the second one could bind the taken port: SO_REUSEPORT
            assert set(proxies) == {n["NodeID"] for n in alive}
            answers = {
                httpx.get(f"http://127.0.0.1:{port}/where", timeout=60).text for _ in range(24)
            }
            assert answers == set(proxies)  # both replicas answered, through either proxy

            # a replica started afterwards runs at kvray's worker niceness (tests/conftest.py
            # sets cluster.app.SERVE_ENV as kvray serve does), not Ray's 15
            serve.run(Niceness.bind(), name="niceness", route_prefix="/niceness")
            assert httpx.get(f"http://127.0.0.1:{port}/niceness", timeout=60).json() == 0
            answers = {
                httpx.get(f"http://127.0.0.1:{port}/where", timeout=60).text for _ in range(24)
            }
            assert answers == set(proxies)
        finally:
            serve.shutdown()
    assert not ray.is_initialized()


def test_gpus_split_over_local_nodes():
    assert gpus_of_nodes(2, 2) == [[0], [1]]
    assert gpus_of_nodes(2, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert gpus_of_nodes(4, 2) == [[0], [1], [], []]  # two CPU-only nodes: proxies and ingress
    assert gpus_of_nodes(3, 8) == [[0, 1], [2, 3], [4, 5]]  # equal shares; GPUs 6, 7 unused
    assert gpus_of_nodes(2, 0) == [[], []]


def test_free_ports_are_ones_ray_never_takes_after_we_pick():
    """CI once lost the app's port to Ray's dashboard agent, started after the port was picked
    (52365, its default); the kernel's ephemeral ports, which Ray's agents also bind, are out."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 1
    for port in ports:
        assert port != DEFAULT_DASHBOARD_AGENT_LISTEN_PORT and not low <= port <= high, port
        assert not 10002 <= port <= 19999, port  # Ray's worker ports


def test_local_nodes_cannot_join_an_address():
    with pytest.raises(ValueError, match="cannot join"), ray_session(nodes=2, address="auto"):
        pass


def test_kvray_serve_refuses_ray_nodes_with_an_address(ray_harness: RayHarness):
    from cluster.cli import main

    ray_harness.stop()

    with pytest.raises(SystemExit, match="cannot be combined with --address"):
        main(["serve", "--model", "demo", "--ray-nodes", "2", "--address", "auto"])
    assert not ray.is_initialized()


def test_kvray_serve_refuses_a_dashboard_with_an_address():
    from cluster.cli import main

    with pytest.raises(SystemExit, match="cannot be combined with --address"):
        main(["serve", "--model", "demo", "--dashboard", "--address", "auto"])


@pytest.mark.parametrize("flag", [[], ["--dashboard"]])
def test_kvray_serve_starts_rays_dashboard_only_when_asked(monkeypatch, flag):
    """Idle, the dashboard took 2.9-3.7 % of a core on the 2-core CPU (benchmarks/README.md,
    session 27): a Ray that `kvray serve` starts has none unless asked. Stopped at the start
    of that Ray, with what it was asked for."""
    import cluster.app
    import cluster.local_ray
    from cluster.cli import main

    class Started(Exception):
        pass

    asked: dict = {}

    def ray_session(**kwargs):
        asked.update(kwargs)
        raise Started

    monkeypatch.setattr(cluster.local_ray, "ray_session", ray_session)
    monkeypatch.setattr(cluster.local_ray, "set_own_ray_env", lambda: None)
    monkeypatch.setattr(cluster.app, "set_serve_env", lambda: None)
    with pytest.raises(Started):
        main(["serve", "--model", "demo", *flag])
    assert asked["include_dashboard"] is bool(flag)
    assert asked["address"] is None


def test_a_ray_of_kvrays_own_keeps_no_idle_workers():
    """Ray prestarts a Python worker per core for its first driver and keeps those no actor
    takes (14 `ray::IDLE` processes beside the app on a 16-core host). Stood in for on this
    machine by a Ray of 4 CPUs allowed to start 4 workers at once, with one actor: kvray's
    settings for its own Ray leave none idle once Ray's idle threshold has passed."""
    driver = (
        "import os, time\n"
        "os.environ['RAY_worker_maximum_startup_concurrency'] = '4'\n"
        "import ray\n"
        "from cluster.local_ray import _argv, _descendants, ray_session, set_own_ray_env\n"
        "if os.environ.get('OWN') == '1':\n"
        "    set_own_ray_env()\n"
        "@ray.remote(num_cpus=0)\n"
        "class Idle:\n"
        "    def ready(self): return True\n"
        "with ray_session(num_cpus=4, include_dashboard=False, log_to_driver=False):\n"
        "    actor = Idle.remote()\n"
        "    ray.get(actor.ready.remote())\n"
        "    time.sleep(4)\n"
        "    argvs = [_argv(pid) for pid in _descendants(os.getpid())]\n"
        "    print('idle', sum(bool(a) and a[0].startswith('ray::IDLE') for a in argvs))\n"
    )

    def idle_workers(own: bool) -> int:
        env = {**os.environ, "OWN": "1" if own else "0"}
        env.pop("RAY_num_workers_soft_limit", None)
        out = _run_driver(driver, timeout_s=120, env=env)
        return int(out.stdout.split("idle")[-1].split()[0])

    assert idle_workers(own=False) > 0  # Ray's default keeps them: the stand-in is one
    assert idle_workers(own=True) == 0
