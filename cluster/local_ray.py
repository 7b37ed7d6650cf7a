"""A fresh Ray on this machine for `kvray serve` and the benchmarks: one node, or several.

Serve runs one HTTP proxy per Ray node, and every streamed token is one SSE chunk through a
proxy. On a multi-GPU host that one proxy caps streamed throughput (measured on two H200s:
two replicas behind one proxy delivered 0.81x one replica at 1,024 streams; with one Ray
node per GPU, 1.82x). `ray_session(nodes=N)` starts N nodes here, each with an equal share of
the CPUs and GPUs (with more nodes than GPUs, the nodes past the GPUs have none: more proxies
and ingress room without another GPU); their proxies bind the same port (SO_REUSEPORT), so
the kernel spreads client connections over them. `lower_control_plane` then puts the control
plane of such a Ray below the engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

# per node when there are several: the default takes 30 % of RAM each
OBJECT_STORE_BYTES = 2 * 1024**3


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


# Ray's control plane, by a process's argv[0] (the process title Ray gives it) or a script it
# runs: the GCS, the dashboard with its agents, the log and autoscaler monitors, and Serve's
# controller; and whatever those start (the dashboard's module processes, forked by a
# forkserver of its own, ~2 % of a core between them on the 2-core CPU while idle). Serve's
# proxies and the replicas are not in it: requests go through them. Nor is the raylet: it
# forks the workers, which start at its niceness plus Ray's `worker_niceness` (measured:
# workers started after a raylet went to 19 ran at 19).
CONTROL_PLANE_TITLES = (
    "gcs_server",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "ray::ServeController",
)
CONTROL_PLANE_SCRIPTS = (
    "dashboard/dashboard.py",
    "dashboard/agent.py",
    "runtime_env/agent/main.py",
    "log_monitor.py",
    "autoscaler/_private/monitor.py",
)
CONTROL_PLANE_NICENESS = 19

# Settings for a Ray that kvray starts for itself (`kvray serve` without --address, the
# benchmarks' apps), set before it starts: every process of it inherits them. Serve's
# controller runs its reconcile loop every 0.1 s by default, and each pass asks the GCS for
# every node's free resources. Idle on the 2-core CPU that took 3.3-3.4 % of a core in the
# controller, and all of Ray's processes took 10.8-11.5 %; at 0.5 s, 1.2-1.5 % and 7.1-8.4 %
# (benchmarks/README.md, "Sessions 18-19"): CPU that an engine on the same cores loses. The
# price: the controller notices a dead replica, a scaling decision or a deployment's next
# step up to 0.5 s later (the demo app was ready in 10-12 s either way). A cluster of your
# own (Kubernetes, `ray start`) keeps Serve's default unless you export it there too.
# Ray also starts one Python worker per core for the first driver and keeps those that no
# actor takes, idle, for as long as it runs (up to one per free CPU): on the GPU host's
# 16-core CPU, 14 `ray::IDLE` processes beside the app, each with its core worker's timers
# (~0.9 % of a core apiece, measured on the 2-core CPU). A soft limit of 0 idle workers keeps
# the first driver's prestart (the app's actors still find workers started) and ends the
# ones left idle after Ray's idle threshold (1 s).
OWN_RAY_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_num_workers_soft_limit": "0"}


def set_own_ray_env() -> None:
    """Put OWN_RAY_ENV into this process's environment, keeping any value the user set;
    before this process starts a Ray of its own."""
    for key, value in OWN_RAY_ENV.items():
        os.environ.setdefault(key, value)


def lower_control_plane(niceness: int = CONTROL_PLANE_NICENESS) -> list[int]:
    """Put the control plane of the Ray this process started (its descendants that
    `is_control_plane`, and theirs), every thread of it, at `niceness`; their pids.

    On a small machine the engine shares the cores with these processes, and each of their
    periodic wakeups preempts one of its threads while the other waits for it (~0.1 core of
    such work on the 2-core CPU). At 19 they run in the gaps between the engine's steps
    instead: its mean step under a steady Serve load was 3-8 % shorter (93.6 against 96.3
    ms and 90.2 against 98.1 ms in two runs, phases alternated within each;
    benchmarks/README.md, "Session 11"). Raising one's own processes' niceness needs no
    privilege. Linux only (it reads /proc); elsewhere a no-op."""
    if not os.path.isdir("/proc/self/task"):
        return []
    children = _children()
    lowered: list[int] = []
    for pid in _descendants(os.getpid(), children):
        if pid in lowered or not is_control_plane(_argv(pid)):
            continue
        for member in (pid, *_descendants(pid, children)):
            if member in lowered:
                continue
            for tid in _threads(member):
                with suppress(OSError):  # gone since, or not ours
                    os.setpriority(os.PRIO_PROCESS, tid, niceness)  # per thread on Linux
            lowered.append(member)
    return lowered


def is_control_plane(argv: list[str]) -> bool:
    """Whether a process with this argv is part of Ray's control plane (CONTROL_PLANE_TITLES,
    CONTROL_PLANE_SCRIPTS)."""
    if not argv:
        return False
    title = os.path.basename(argv[0])
    if any(title.startswith(t) for t in CONTROL_PLANE_TITLES):
        return True
    return any(arg.endswith(script) for arg in argv[1:3] for script in CONTROL_PLANE_SCRIPTS)


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


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


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
