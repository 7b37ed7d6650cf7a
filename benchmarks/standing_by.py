"""What a kvray app standing idle costs an engine beside it, and which of its processes: the
demo engine stepped by hand in this process (a prompt step of `--prompts` new 64-token
requests, 4 by default, then their decode steps), in phases during which
one group of the app's processes is stopped (SIGSTOP, and SIGCONT when the phase ends) or
none is. `kvray bench serve --engine-beside-app` measures the whole of this cost ("standing
by"); this splits it by group. Phases rotate through the kinds in each repetition, and each
stopped group is compared with the running phases of the same repetitions.

    kvray serve -c FILE &     # the app, idle
    python -m benchmarks.standing_by [--reps 12] [--prompts 4] [--out FILE]

`--any-ray` measures any Ray on this machine instead, e.g. `benchmarks/bare_ray.py`'s (a Ray
with idle actors only: the floor of every app on Ray).

Groups (by each process's title, /proc/PID/cmdline):
- control: Ray's control plane as `kvray serve` lowers it (cluster/local_ray.py:
  is_control_plane), and the dashboard's head processes;
- serve: Serve's proxy actor and HAProxy manager;
- replicas: the app's ingress and worker replicas (and each kind alone: worker, ingress);
- all: every process of Ray (the above, the raylet, HAProxy, idle workers, the driver).
A phase stops its processes for ~2 s; Ray's and Serve's health checks allow far longer.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from functools import partial

from benchmarks import write_result
from benchmarks.background_load import set_slice
from cluster.local_ray import _argv, _threads, is_control_plane

SERVE_TITLES = ("ray::ProxyActor", "ray::HAProxyManager")


def group_of(argv: list[str]) -> str | None:
    """The group of a process by its argv (None: not Ray's)."""
    if not argv:
        return None
    title = os.path.basename(argv[0])
    if is_control_plane(argv) or title.startswith("ray-dashboard-"):
        return "control"
    if title.startswith(SERVE_TITLES):
        return "serve"
    if title.startswith("ray::ServeReplica"):
        return "replicas"
    joined = " ".join(argv[:3])
    if (
        title.startswith("ray::")
        or "/ray/" in joined
        or title == "haproxy"
        or "kvray serve" in joined
        or "benchmarks.bare_ray" in joined
    ):
        return "other"
    return None


def processes() -> dict[str, list[int]]:
    """Ray's processes on this machine by group, this one left out."""
    found: dict[str, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            group = group_of(_argv(int(entry)))
            if group:
                found.setdefault(group, []).append(int(entry))
    return found


@contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _threads_of(pids: list[int]) -> list[int]:
    return [tid for pid in pids for tid in _threads(pid)]


@contextmanager
def sched_idle(pids: list[int]) -> Iterator[None]:
    """Every thread of `pids` on SCHED_IDLE: preempted at once by any other thread's wakeup
    (Linux's fair class: an idle-policy task runs only while nothing else wants its core,
    with a weight of 3 against 1024 at niceness 0). Needs root to undo."""
    tids = _threads_of(pids)
    for tid in tids:
        with suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield
    finally:
        for tid in tids:
            with suppress(OSError):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


@contextmanager
def niceness(pids: list[int], value: int = 19) -> Iterator[None]:
    """Every thread of `pids` at niceness `value`, then back to what each had (lowering it
    back needs root). At 19 a thread weighs 15 against an engine thread's 1024 at 0: while the
    engine keeps every core busy, such threads together get ~1.4 % of each core."""
    before = {}
    for tid in _threads_of(pids):
        with suppress(OSError):
            before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, value)
    try:
        yield
    finally:
        for tid, old in before.items():
            with suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, old)


@contextmanager
def short_slice(pids: list[int], nanoseconds: int = 100_000) -> Iterator[None]:
    """Every thread of `pids` with an EEVDF slice of `nanoseconds` (Linux 6.12+), so that a
    woken engine thread waits at most that long for its core (the default slice, ~3 ms, is
    what a running task keeps before a wakeup may preempt it)."""
    tids = _threads_of(pids)
    for tid in tids:
        with suppress(OSError):
            set_slice(nanoseconds, tid)
    try:
        yield
    finally:
        for tid in tids:
            with suppress(OSError):
                set_slice(0, tid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--decode-steps", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="new requests in the prompt step")
    ap.add_argument("--any-ray", action="store_true", help="a Ray without kvray's replicas will do")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--kinds",
        help="comma-separated treatments (default: all): running, stopped:GROUP, control:SCHED_IDLE, control:0.1ms-slice, all:nice19, all:SCHED_IDLE",
    )
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)

    import torch

    from worker.config import EngineConfig
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    groups = processes()
    if not groups.get("replicas") and not (args.any_ray and groups):
        raise SystemExit("no kvray replicas on this machine: start the app first (kvray serve)")
    everything = [pid for pids in groups.values() for pid in pids]
    members = {name: groups.get(name, []) for name in ("control", "serve", "replicas")}
    members["all"] = everything
    # the replicas one kind at a time: the worker replica (its engine idle) and the ingress
    for kind in ("Worker", "Ingress"):
        members[kind.lower()] = [
            pid for pid in members["replicas"] if kind in " ".join(_argv(pid)[:1])
        ]
    for name, pids in members.items():
        print(f"{name:9s} {len(pids)} processes", flush=True)

    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model="demo", device="cpu", max_running=8))
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    rng = random.Random(0)
    serial = iter(range(10**9))

    def phase() -> tuple[float, float]:
        """A prompt step of the new requests (random tokens: never a prefix-cache hit), then
        their decode steps; every phase alike. Its prompt step and decode step p50, ms."""
        ids = [f"r{next(serial)}" for _ in range(args.prompts)]
        engine.submit(
            [
                EngineRequest(i, [rng.randrange(1, 40_000) for _ in range(args.prompt_len)], params)
                for i in ids
            ]
        )
        times = []
        for _ in range(1 + args.decode_steps):
            start = time.perf_counter()
            engine.step()
            times.append(1e3 * (time.perf_counter() - start))
        for i in ids:
            engine.abort(i)
        engine.step()  # the aborts take effect
        return times[0], statistics.median(times[1:])

    for _ in range(3):
        phase()
    treatments: dict[str, Callable[[], AbstractContextManager[object]]] = {"running": nullcontext}
    treatments |= {f"stopped:{name}": partial(stopped, pids) for name, pids in members.items()}
    treatments["control:SCHED_IDLE"] = partial(sched_idle, members["control"])
    treatments["control:0.1ms-slice"] = partial(short_slice, members["control"])
    treatments["all:nice19"] = partial(niceness, members["all"])
    treatments["all:SCHED_IDLE"] = partial(sched_idle, members["all"])
    chosen = args.kinds.split(",") if args.kinds else list(treatments)
    kinds = ["running", *(k for k in chosen if k != "running")]
    decode: dict[str, list[float]] = {k: [] for k in kinds}  # one median per phase
    prompt: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(args.reps):
        order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
        for kind in order:
            with treatments[kind]():
                time.sleep(0.2)  # let what was mid-wakeup settle either way
                p, d = phase()
            time.sleep(0.3)  # what the stopped ones catch up on, outside the next phase
            prompt[kind].append(p)
            decode[kind].append(d)
        print(
            f"repetition {rep:2d}  "
            + "  ".join(f"{k} {prompt[k][-1]:.1f}/{decode[k][-1]:.1f}" for k in kinds),
            flush=True,
        )

    print(f"\nmedian of phases, prompt step / decode step (ms); {args.reps} repetitions")
    summary = {}
    for kind in kinds:
        # paired with the running phase of the same repetition
        dp = [a - b for a, b in zip(prompt["running"], prompt[kind], strict=True)]
        dd = [a - b for a, b in zip(decode["running"], decode[kind], strict=True)]
        summary[kind] = {
            "prompt_ms": statistics.median(prompt[kind]),
            "decode_ms": statistics.median(decode[kind]),
            "running_minus_this_prompt_ms": statistics.median(dp),
            "running_minus_this_decode_ms": statistics.median(dd),
        }
        line = f"{kind:20s} {summary[kind]['prompt_ms']:7.1f} / {summary[kind]['decode_ms']:6.1f}"
        if kind != "running":
            line += f"   running - this, paired: {statistics.median(dp):+5.1f} / {statistics.median(dd):+5.1f}"
        print(line)
    write_result(
        args.out, args, processes=members, prompt_ms=prompt, decode_ms=decode, summary=summary
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
