"""Why does the CPU engine step slower inside a worker replica than in the benchmark's process on
a many-core host? (Session 21, the GPU host's 16-core Xeon, 16 torch threads, concurrency 1:
engine TTFT 94.9 ms in the replica against 53.6-60.3 ms in process; CPU busy 26 % against 95 %.)

1. The app's engine launched in this process: lone 64-token prompts (one token out) submitted
   one at a time, the process's threads sampled from /proc over each (user and system ticks,
   minor faults, involuntary switches, and which CPU each running thread is
   on, every 5 ms), and the machine's context switches.
2. The kvray app (`--config`): lone 64-token prompts through HTTP while the worker replica's
   threads are sampled the same way; its OpenMP environment, CPU affinity and cgroup.

On the GPU host: python3 scripts/device/replica-threads.py --config /tmp/cpu.yaml --threads 16
(Ray Serve installed from .rayw, the demo shape at /tmp/demo-shape: scripts/device/serve-check).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, os.getcwd())
from cluster.local_ray import _threads  # noqa: E402

ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
            "LD_PRELOAD", "OMP_PROC_BIND", "KMP_AFFINITY", "OMP_DYNAMIC", "OMP_THREAD_LIMIT")  # fmt: skip


def per_thread(pid: int, name: str) -> Iterator[tuple[int, str]]:
    """(tid, text of /proc/PID/task/TID/NAME) for each thread of `pid` still there."""
    for tid in _threads(pid):
        try:
            yield tid, Path(f"/proc/{pid}/task/{tid}/{name}").read_text()
        except OSError:
            continue


def stat_fields(stat: str) -> list[str]:
    """A /proc stat line's fields after the command name (which may hold spaces)."""
    return stat[stat.rindex(")") + 2 :].split()


def thread_ticks(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread's (user, system) ticks."""
    return {
        tid: (int(f[11]), int(f[12]))
        for tid, stat in per_thread(pid, "stat")
        for f in [stat_fields(stat)]
    }


def preemptions(pid: int) -> dict[int, int]:
    """Each thread's involuntary context switches (preempted while it could run)."""
    return {
        tid: int(status.rsplit("nonvoluntary_ctxt_switches:", 1)[1].split()[0])
        for tid, status in per_thread(pid, "status")
    }


def machine_switches() -> int:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("ctxt "):
            return int(line.split()[1])
    return 0


class Stacking(threading.Thread):
    """Samples every 5 ms which CPU each running thread of `pid` is on (itself left out);
    counts the samples in which two of them report the same CPU (one runnable, waiting for
    the other: a team member sharing a core). Itself a thread that wakes: on a machine whose
    every core is an engine thread it preempts one now and then, as anything else would."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.stacked, self.cpus = pid, 0, 0, set()
        self.done = threading.Event()

    def run(self) -> None:
        me = threading.get_native_id()
        while not self.done.is_set():
            running = []
            for tid, stat in per_thread(self.pid, "stat"):
                fields = stat_fields(stat)
                if tid != me and fields[0] == "R":
                    running.append(int(fields[36]))
            self.samples += 1
            self.stacked += len(running) != len(set(running))
            self.cpus |= set(running)
            time.sleep(0.005)


def futex_groups(pid: int, born: bool = False) -> list:
    """Sizes of the groups of 3 or more threads of `pid` blocked in futex() on one address: an
    idle OpenMP team is one (its workers wait at their dock), so two teams show as two. With
    `born`, (size, when its first thread started, in clock ticks since boot) each."""
    waiting: dict[str, list[int]] = collections.defaultdict(list)
    for tid, call in per_thread(pid, "syscall"):
        fields = call.split()
        if len(fields) > 1 and fields[0] == "202":  # futex(uaddr, ...)
            waiting[fields[1]].append(tid)
    groups = sorted((tids for tids in waiting.values() if len(tids) >= 3), key=len, reverse=True)
    if not born:
        return [len(tids) for tids in groups]
    return [(len(tids), thread_born(pid, min(tids))) for tids in groups]


def thread_born(pid: int, tid: int) -> int:
    """When a thread started, in clock ticks since boot."""
    return int(stat_fields(Path(f"/proc/{pid}/task/{tid}/stat").read_text())[19])


def ticks_now() -> int:
    return round(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def faults(pid: int) -> int:
    return int(stat_fields(Path(f"/proc/{pid}/stat").read_text())[7])


def busy_threads(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> dict:
    user = {t: after[t][0] - before.get(t, (0, 0))[0] for t in after}
    system = {t: after[t][1] - before.get(t, (0, 0))[1] for t in after}
    deltas = sorted((user[t] + system[t] for t in after), reverse=True)
    return {
        "threads": len(after),
        "threads_that_ran": sum(d > 0 for d in deltas),
        "user_ticks": sum(user.values()),
        "system_ticks": sum(system.values()),
        "top16": deltas[:16],
    }


def lone_prompts(pid: int, send, requests: int, sample_cpus: bool = True) -> dict:
    """`send(i)` a lone 64-token prompt at a time; each one's time and the threads of `pid`."""
    times, samples, minflt, preempted, switches, stacking = [], [], [], [], [], []
    for i in range(requests):
        before, f0, p0, m0 = thread_ticks(pid), faults(pid), preemptions(pid), machine_switches()
        sampler = Stacking(pid)
        if sample_cpus:
            sampler.start()
        start = time.perf_counter()
        send(i)
        times.append(round(1e3 * (time.perf_counter() - start), 1))
        sampler.done.set()
        if sample_cpus:
            sampler.join()
        after, p1 = thread_ticks(pid), preemptions(pid)
        samples.append(busy_threads(before, after))
        minflt.append(faults(pid) - f0)
        ran = [t for t in after if sum(after[t]) > sum(before.get(t, (0, 0)))]
        preempted.append(sum(p1.get(t, 0) - p0.get(t, 0) for t in ran))
        switches.append(machine_switches() - m0)
        stacking.append((sampler.stacked, sampler.samples, len(sampler.cpus)))
        time.sleep(0.2)
    time.sleep(1)  # the team's spin ends: its threads wait at the dock
    return {
        "futex_groups": futex_groups(pid),
        "request_ms": times,
        "minor_faults": minflt,
        "threads_per_request": samples[-4:],
        "team_preemptions": preempted,  # involuntary switches of the threads that ran
        "machine_switches": switches,  # every CPU's context switches during the request
        "stacked_samples": stacking,  # (samples with two running threads on one CPU, samples, CPUs seen)
    }


def where_the_engine_is(raw: str) -> dict:
    """py-spy's raw native stacks (`--threads --idle`): the engine loop thread's samples taken
    inside a step, by where they end: waiting for the GIL (`take_gil` on the stack), collecting
    garbage, in libgomp (the master at a barrier: waiting for the team's last member), in the
    ops' own code (torch, MKL, oneDNN), in Python, or elsewhere; and the leaves most seen."""
    kinds: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    others: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1]
        threads[name] += int(count)
        if name != "kvray-engine":
            others[name][frames[-1][:120]] += int(count)
        if name != "kvray-engine" or not any(f.startswith("Engine.step (") for f in frames):
            continue
        leaf = frames[-1]
        library = leaf.rsplit("(", 1)[-1].rstrip(")") if leaf.endswith(")") else ""
        if any("take_gil" in f for f in frames):
            kind = "gil_wait"
        elif any(f.startswith(("gc_collect", "gc_collect_main", "collect ")) for f in frames):
            kind = "gc"
        elif "libgomp" in library:
            kind = "omp_barrier"
        elif any(k in library for k in ("libtorch", "libmkl", "libdnnl", "libc10")):
            kind = "op_code"
        elif ".py:" in library or "libpython" in library:
            kind = "python"
        else:
            kind = library or "other"
        kinds[kind] += int(count)
        leaves[leaf[:160]] += int(count)
    return {
        "engine_step_samples": sum(kinds.values()),
        "by_kind": dict(kinds.most_common()),
        "top_leaves": leaves.most_common(15),
        "samples_per_thread": dict(threads.most_common(12)),
        "other_threads_leaves": {n: c.most_common(3) for n, c in others.items()},
    }


def spied(pid: int, send, py_spy: str | None, seconds: float, name: str) -> dict:
    """py-spy (native stacks, every thread, `seconds` at 50 Hz) on `pid` while lone prompts
    go one after another; the raw stacks gzipped to $OUT/NAME.txt.gz."""
    if not py_spy:
        return {}
    raw = Path(f"/tmp/{name}.txt")
    spy = subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--native", "--threads", "--idle", "--rate", "50",
         "--duration", str(int(seconds)), "--format", "raw", "-o", str(raw)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    sent = 0
    while spy.poll() is None:
        send(2000 + sent)
        sent += 1
    said = (spy.stdout.read() if spy.stdout else "")[-400:]
    if not raw.exists():
        return {"py_spy_failed": said}
    text = raw.read_text()
    Path(os.environ.get("OUT", "/tmp"), f"{name}.txt.gz").write_bytes(gzip.compress(text.encode()))
    return {"py_spy": where_the_engine_is(text) | {"prompts_sent": sent, "said": said[-200:]}}


def prompt(i: int) -> list[int]:
    return [100 + (i * 7 + j) % 30000 for j in range(64)]


def describe(pid: int) -> dict:
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
        if "=" in item
    )
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {
        "env": {k: environ.get(k) for k in ENV_KEYS},
        "environ": sorted(k for k in environ if "TOKEN" not in k and "KEY" not in k),
        "smaps": [
            line
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            if line.startswith(("Rss", "AnonHugePages"))
        ],
        "status": [
            line
            for line in status
            if line.startswith(("Cpus_allowed_list", "Threads", "voluntary", "nonvoluntary"))
        ],
        "cgroup": Path(f"/proc/{pid}/cgroup").read_text().strip(),
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
    }


def in_process(
    config: str, threads: int, requests: int, py_spy: str | None = None, sample_cpus: bool = True
) -> dict:
    """The app's engine (its config) launched in this process, lone prompts submitted to it
    from this thread as the replica's event loop would, its threads sampled while it lives."""
    import torch

    from cluster.app import load_config
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine.launched(load_config(config).engine)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def send(i: int) -> None:
        for _ in engine.submit([EngineRequest(f"r{i}", prompt(i), params)]):
            pass

    for i in range(3):
        send(1000 + i)
    engine.step_log = []
    try:
        result = lone_prompts(os.getpid(), send, requests, sample_cpus)
        result["step_ms"] = [round(1e3 * r.seconds, 1) for r in engine.step_log]
        spied_from = len(engine.step_log)
        result |= spied(os.getpid(), send, py_spy, 10, "spy-in-process")
        seconds = [r.seconds for r in engine.step_log[spied_from:]]
        result["step_ms_mean_spied"] = round(1e3 * sum(seconds) / max(len(seconds), 1), 1)
        return result | describe(os.getpid())
    finally:
        engine.shutdown()


def engine_step_totals() -> tuple[float, float]:
    """The worker replica's engine steps so far, and their seconds (its /metrics)."""
    metrics = urllib.request.urlopen("http://127.0.0.1:8000/metrics").read().decode()
    totals = {}
    for line in metrics.splitlines():
        if line.startswith(("kvray:engine_steps_total", "kvray:engine_step_seconds_total")):
            totals[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return totals["kvray:engine_steps_total"], totals["kvray:engine_step_seconds_total"]


def worker_pid() -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and b"KvrayWorker" in argv[0]:
                return int(entry)
    raise SystemExit("no worker replica")


def app(config: str, requests: int, py_spy: str | None = None) -> dict:
    log = Path(os.environ.get("OUT", "/tmp"), "replica-threads-serve.log").open("w")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "-c", config],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(180):
            time.sleep(1)
            try:
                urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2)
                break
            except OSError:
                continue
        model = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/models"))["data"][0][
            "id"
        ]
        pid = worker_pid()

        def send(i: int, max_tokens: int = 1) -> None:
            body = {
                "model": model,
                "prompt": prompt(i),
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            req = urllib.request.Request(
                "http://127.0.0.1:8000/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=60).read()

        # as `kvray bench serve` warms up: two requests at once (one may take the prompt lane)
        phases = {"ready": ticks_now()}
        pair = [threading.Thread(target=send, args=(900 + i, 16)) for i in range(2)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join()
        phases["warm_up_pair"] = ticks_now()
        for i in range(3):
            send(1000 + i)
        result = lone_prompts(pid, send, requests)
        phases["lone_prompts"] = ticks_now()
        result["teams_born"] = futex_groups(pid, born=True)
        result["phases_ended"] = phases  # clock ticks since boot, as teams_born
        steps_before = engine_step_totals()
        result |= spied(pid, send, py_spy, 10, "spy-replica")
        steps, seconds = (b - a for a, b in zip(steps_before, engine_step_totals(), strict=True))
        result["step_ms_mean_spied"] = round(1e3 * seconds / max(steps, 1), 1)
        idle_before = thread_ticks(pid)
        time.sleep(2)
        idle = busy_threads(idle_before, thread_ticks(pid))
        metrics = urllib.request.urlopen("http://127.0.0.1:8000/metrics").read().decode()
        steps = [
            line
            for line in metrics.splitlines()
            if line.startswith(("kvray:engine_step_seconds_total", "kvray:engine_steps_total"))
        ]
        return result | {
            "idle_2s": idle,
            "engine_steps": steps,
            **describe(pid),
        }
    finally:
        server.send_signal(2)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--out")
    ap.add_argument("--py-spy", help="a py-spy binary: where the engine thread's steps spend time")
    ap.add_argument(
        "--no-cpu-sampling",
        action="store_true",
        help="in process, no 5 ms sampler (on 16 cores it slows the engine it shares a process with)",
    )
    args = ap.parse_args()
    results = {
        "in_process": in_process(
            args.config, args.threads, args.requests, args.py_spy, not args.no_cpu_sampling
        )
    }
    print("in_process", json.dumps(results["in_process"]), flush=True)
    results["app"] = app(args.config, args.requests, args.py_spy)
    print("app", json.dumps(results["app"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
