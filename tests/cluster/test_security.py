"""Nobody reaches a worker replica but through Ray: a replica listens on no port of kvray's
own (only those every Serve replica has: its Ray core worker's and Serve's inter-deployment
gRPC server, both behind Ray's token authentication), and HTTP without the API key gets 401."""

from __future__ import annotations

import os

import httpx
from ray import serve

from tests.cluster.conftest import Served


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class PlainReplica:
    """A Serve replica with no kvray code: what every replica listens on."""

    def ports(self) -> list[int]:
        return listening_ports(os.getpid())


def test_a_worker_replica_listens_on_no_port_of_its_own(served: Served) -> None:
    # it has served requests, so anything opened on first use would be open by now
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 2}
    response = httpx.post(
        f"{served.base_url}/v1/completions", json=body, headers=served.headers(), timeout=120
    )
    assert response.status_code == 200
    plain = serve.run(PlainReplica.bind(), name="plain-ports", route_prefix="/plain-ports")
    try:
        baseline = len(plain.ports.remote().result(timeout_s=60))
    finally:
        serve.delete("plain-ports")
    stats = served.worker_stats()
    assert stats
    for replica_id, s in stats.items():
        ports = listening_ports(int(s["pid"]))
        assert len(ports) == baseline, (replica_id, ports, baseline)


def test_http_without_the_api_key_gets_401_and_no_tokens(served: Served) -> None:
    body = {"model": "demo", "prompt": "The capital of France is", "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": served.api_key}):
        response = httpx.post(
            f"{served.base_url}/v1/completions", json=body, headers=headers, timeout=60
        )
        assert response.status_code == 401, response.text
        assert "choices" not in response.json()
