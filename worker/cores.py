"""The cores this process may run on: what sizes its CPU thread pools (torch's on a CPU
worker, the grammar masks' fill on a GPU worker) inside a container or a cpuset."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")  # a container's own cgroup (its cgroup namespace)


def usable_cores(cgroup: Path = CGROUP_ROOT) -> int:
    """The cores this process may use: those of its affinity mask (a cpuset, `taskset`,
    Kubernetes' static CPU manager), capped by its container's CPU limit (`cgroup_cpu_limit`,
    rounded down, at least 1), not the machine's count.

    GNU OpenMP, torch's CPU pool, sleeps at every barrier when it has more threads than the
    cores it may run on; under a CPU limit, threads beyond it spin on a budget the kernel
    then stops for the rest of each period."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks here (not Linux)
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup)
    return cores if limit is None else max(1, min(cores, int(limit)))


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """This container's CPU limit in cores (a pod's `limits.cpu`): cgroup v2's `cpu.max`, else
    v1's CFS quota over its period; None without one (or off Linux)."""
    try:  # v2: "max 100000" (no limit) or "200000 100000" (2 cores)
        quota, period = (root / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:  # v1: a quota of -1 is no limit
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        limit = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):  # "max"
        return None
    return limit if limit > 0 else None
