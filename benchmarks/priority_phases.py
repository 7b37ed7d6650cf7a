"""How the priority of Ray's processes changes the engine's step under a steady Serve load:
alternate a setting every phase and read the mean engine step of each phase from the
workers' counters (`kvray:engine_step_seconds_total` / `kvray:engine_steps_total`).
Alternating within one run keeps this VM's minute-to-minute drift out of the comparison.

    kvray bench serve --skip-engine --num-prompts 600 -c FILE &   # the load, on :8000
    python -m benchmarks.priority_phases workers [--phases 12] [--seconds 15]
    python -m benchmarks.priority_phases control-plane [--phases 18]
    python -m benchmarks.priority_phases front [--phases 12]

workers: every thread of Ray's worker processes (the replicas, Serve's proxies and
controller) and HAProxy at niceness 0, then 15 (Ray's default for workers). control-plane:
the workers at 0, and the control plane (cluster/local_ray.py: is_control_plane) at
niceness 0, then 19, then SCHED_IDLE. front: the workers at 0, the control plane at 19, and
the request's path in front of the engine (the ingress replicas, HAProxy) at 0, then 10.
Lowering a niceness needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from typing import Any

from benchmarks.serve import parse_engine_steps
from cluster.app import INGRESS_NAME
from cluster.local_ray import _argv, _threads, is_control_plane


def _step_counters(url: str) -> tuple[float, int]:
    counters = parse_engine_steps(
        urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    )
    if counters is None:
        raise SystemExit(f"{url}/metrics exports no engine step counters")
    return counters


def _steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def _ray_processes() -> tuple[list[int], list[int], list[int]]:
    """(control plane, workers and HAProxy, the front: ingress replicas and HAProxy) among
    all processes of this machine."""
    control, workers, front = [], [], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        argv = _argv(int(entry))
        if is_control_plane(argv):
            control.append(int(entry))
        elif argv and (argv[0].startswith("ray::") or argv[0].endswith("/haproxy")):
            workers.append(int(entry))
            if argv[0].endswith("/haproxy") or INGRESS_NAME in argv[0]:
                front.append(int(entry))
    return control, workers, front


def _set(pids: list[int], niceness: int, idle: bool = False) -> None:
    for pid in pids:
        for tid in _threads(pid):
            try:
                policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except OSError:
                pass  # gone since


def _apply(experiment: str, setting: str) -> None:
    control, workers, front = _ray_processes()
    if experiment == "workers":
        _set(workers, int(setting))
        return
    _set(workers, 0)
    if experiment == "front":
        _set(control, 19)
        _set(front, int(setting))
        return
    _set(control, 19 if setting == "19" else 0, idle=setting == "idle")


SETTINGS = {"workers": ["0", "15"], "control-plane": ["0", "19", "idle"], "front": ["0", "10"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=sorted(SETTINGS))
    ap.add_argument("--phases", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured time of a phase")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", help="write the phases here (JSON)")
    args = ap.parse_args(argv)
    settings = SETTINGS[args.experiment]
    phases: list[dict[str, Any]] = []
    for i in range(args.phases):
        setting = settings[i % len(settings)]
        _apply(args.experiment, setting)
        time.sleep(2.0)  # a step begun under the previous setting ends
        (s0, n0), steal0 = _step_counters(args.url), _steal()
        time.sleep(args.seconds)
        (s1, n1), steal1 = _step_counters(args.url), _steal()
        mean_ms = 1e3 * (s1 - s0) / max(n1 - n0, 1)
        phases.append(
            {
                "setting": setting,
                "steps": n1 - n0,
                "step_mean_ms": mean_ms,
                "steal_jiffies": steal1 - steal0,
            }
        )
        print(
            f"phase {i:2d} {args.experiment} {setting:>4}: {n1 - n0:4.0f} steps, mean {mean_ms:6.1f} ms, steal {steal1 - steal0}",
            flush=True,
        )
    for setting in settings:
        means = [p["step_mean_ms"] for p in phases if p["setting"] == setting]
        print(f"{setting:>4}: {[round(m, 1) for m in means]} mean {statistics.fmean(means):.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "phases": phases},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
