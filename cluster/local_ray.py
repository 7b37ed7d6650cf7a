"""A fresh Ray on this machine for `kvray serve` and the benchmarks: one node, or several.

Serve runs one HTTP proxy per Ray node, and every streamed token is one SSE chunk through a
proxy, so on a multi-GPU host one proxy caps streamed throughput (docs/performance.md).
`ray_session(nodes=N)` starts N nodes here, each with an equal share of
the CPUs and GPUs (with more nodes than GPUs, the nodes past the GPUs have none: more proxies
and ingress room without another GPU); their proxies bind the same port (SO_REUSEPORT), so
the kernel spreads client connections over them.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# per node when there are several: the default takes 30 % of RAM each
OBJECT_STORE_BYTES = 2 * 1024**3

# Above Ray's worker ports (10002-19999), below Serve's direct-ingress ports (30000+) and the
# kernel's ephemeral range (32768+), where Ray's agents bind after we pick (52365 is one).
FREE_PORTS = range(20000, 30000)


def free_port() -> int:
    """A port free now on 127.0.0.1 that no Ray or Serve process started later will take."""
    for port in random.sample(FREE_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {FREE_PORTS}")


@contextmanager
def ray_session(
    *,
    nodes: int = 1,
    address: str | None = None,
    num_cpus: int | None = None,
    runtime_env: Any = None,
    **init_kwargs: Any,
) -> Iterator[None]:
    """Ray initialised for the `with` block and shut down after it: joined at `address`, or
    started here with `nodes` nodes. `init_kwargs` go to `ray.init` (e.g. `log_to_driver`;
    `include_dashboard` applies to every node)."""
    import ray

    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    if address is not None and nodes != 1:
        raise ValueError("several local nodes start a new Ray: they cannot join an address")
    if nodes == 1:
        ray.init(
            address=address or "local", num_cpus=num_cpus, runtime_env=runtime_env, **init_kwargs
        )
        try:
            yield
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    dashboard = init_kwargs.pop("include_dashboard", False)
    cluster = Cluster()
    try:
        _add_nodes(cluster, nodes, num_cpus, dashboard)
        ray.init(address=cluster.address, runtime_env=runtime_env, **init_kwargs)
        try:
            yield
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


# Settings for a Ray that kvray starts for itself (`kvray serve` without --address, the
# benchmarks' apps), set before it starts: every process of it inherits them. Serve's
# controller reconciles every 0.5 s instead of 0.1 s (each pass asks the GCS for every node's
# free resources: CPU an engine on the same cores loses), at the price of noticing a dead
# replica or a scaling decision up to 0.5 s later. Ray keeps no idle Python workers beyond
# what the app's actors take (by default it keeps one per free CPU, each with timers of its
# own). A cluster of your own (Kubernetes, `ray start`) keeps Ray's defaults unless you
# export these there too.
OWN_RAY_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_num_workers_soft_limit": "0"}


def set_own_ray_env() -> None:
    """Put OWN_RAY_ENV into this process's environment, keeping any value the user set;
    before this process starts a Ray of its own."""
    for key, value in OWN_RAY_ENV.items():
        os.environ.setdefault(key, value)


def _descendants(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every process below `root` (`children`: a `_children()` map, or read now)."""
    children = _children() if children is None else children
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _children() -> dict[int, list[int]]:
    """Each process's children, by pid."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    return children


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    # a process title set in place may be one string with spaces instead of NUL-separated args
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    return args[0].split(" ") + args[1:] if len(args) == 1 else args


def gpus_of_nodes(nodes: int, num_gpus: int) -> list[list[int]]:
    """GPU ids of each of `nodes` nodes: equal shares (node i: i*k..(i+1)*k-1); with more nodes
    than GPUs, one GPU each for the first nodes and none for the rest."""
    per = max(1, num_gpus // nodes)
    return [
        list(range(i * per, (i + 1) * per)) if (i + 1) * per <= num_gpus else []
        for i in range(nodes)
    ]


def _add_nodes(cluster: Any, nodes: int, num_cpus: int | None, dashboard: bool) -> None:
    """`nodes` nodes with equal shares of the CPUs, and the GPUs as gpus_of_nodes splits them."""
    cpus = max(1, (num_cpus or os.cpu_count() or 1) // nodes)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for gpus in gpus_of_nodes(nodes, _gpu_count()):
            node: dict[str, Any] = {
                "num_cpus": cpus,
                "object_store_memory": OBJECT_STORE_BYTES,
                "include_dashboard": dashboard,
            }
            if gpus:  # a node takes its GPU ids from CUDA_VISIBLE_DEVICES as it starts
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
                node["num_gpus"] = len(gpus)
            else:
                node["num_gpus"] = 0
            cluster.add_node(**node)
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0
