"""Who has the CPUs while a lone request waits for its first token: the same prompts through
Serve and into an engine in this process (beside the idle app), with the kernel's scheduler
events recorded (tracefs: sched_switch, sched_wakeup; needs root).

At concurrency 1 the engine's own TTFT is a few ms longer inside the worker replica than in
the benchmark's process (benchmarks/README.md, "Sessions 18-19"). Within each request's
window, from the client's send to its first token, this adds up the CPU time of every
thread by the process it belongs to, the time the engine's threads were runnable but not
running, and the CPUs' idle time; so a longer TTFT is told apart into the engine computing
longer (the same work, slower) and the engine waiting for a CPU someone else had (and whom).

    kvray serve -c FILE &     # the app, idle
    python -m benchmarks.sched_trace [--reps 30] [--out FILE]

Each repetition sends one streamed completion of `--prompt-len` random token ids (never a
prefix-cache hit) through Serve and one of the same ids to the in-process engine, in
alternating order, each after a short pause. The engine is the worker replica's process on
the Serve side and this process on the other (which holds the client too; its client is
idle while the prompt step runs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import time
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path

import aiohttp

from benchmarks import write_result
from benchmarks.back_to_back import streamed_ttft_ms

TRACING = Path("/sys/kernel/tracing")
SERVE, ENGINE = "serve", "engine"

SWITCH = re.compile(
    r"^\s*(?P<task>.+?)-(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>[\d.]+): sched_switch: "
    r"prev_comm=.* prev_pid=(?P<prev>\d+) prev_prio=\d+ prev_state=(?P<state>\S+) ==> "
    r"next_comm=.* next_pid=(?P<next>\d+) next_prio=\d+"
)
WAKEUP = re.compile(r"\s(?P<ts>[\d.]+): sched_wakeup: comm=.* pid=(?P<pid>\d+) prio=")
MARKER = re.compile(r"\s(?P<ts>[\d.]+): tracing_mark_write: kvray (?P<side>\w+) (?P<what>\w+)")


def _write(path: str, value: str) -> None:
    (TRACING / path).write_text(value)


def start_tracing(buffer_kb: int) -> None:
    _write("tracing_on", "0")
    _write("trace", "")
    _write("buffer_size_kb", str(buffer_kb))
    _write("events/sched/sched_switch/enable", "1")
    _write("events/sched/sched_wakeup/enable", "1")
    _write("tracing_on", "1")


def stop_tracing() -> str:
    _write("tracing_on", "0")
    _write("events/sched/sched_switch/enable", "0")
    _write("events/sched/sched_wakeup/enable", "0")
    text = (TRACING / "trace").read_text()
    _write("trace", "")
    return text


def thread_owners() -> tuple[dict[int, int], dict[int, str]]:
    """Every live thread's process, and its name, by tid."""
    owners, comms = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                for tid in os.listdir(f"/proc/{entry}/task"):
                    owners[int(tid)] = int(entry)
                    comms[int(tid)] = Path(f"/proc/{entry}/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
    return owners, comms


def process_name(pid: int) -> str:
    """A short name for a process: Ray's title, or the program."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if not args:
        return "kernel"
    first = args[0].split(" ")[0]
    if first.startswith("ray::ServeReplica"):
        return "worker replica" if "Worker" in first else "ingress replica"
    if first.startswith("ray::"):
        return first
    joined = " ".join(args[:3])
    for key in ("gcs_server", "raylet", "haproxy", "dashboard", "log_monitor", "agent"):
        if key in joined:
            return key
    return os.path.basename(first)


def worker_pid() -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                title = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if title.startswith(b"ray::ServeReplica") and b"Worker" in title:
                return int(entry)
    raise SystemExit("no worker replica on this machine: start the app first (kvray serve)")


def account(
    text: str, engine_pid: dict[str, int], owners: dict[int, int], comms: dict[int, str]
) -> dict[str, list[dict[str, float]]]:
    """Per side, per request window: ms of CPU by process name (the engine's process as
    "engine"), "engine runnable" (summed over its threads), and "idle" (summed over CPUs)."""
    marks: list[tuple[float, str, str]] = []
    events: list[tuple[float, str, int, int, int, str]] = []  # ts, kind, cpu, a, b, state
    for line in text.splitlines():
        if "sched_switch" in line:
            m = SWITCH.match(line)
            if m:
                events.append(
                    (float(m["ts"]), "s", int(m["cpu"]), int(m["prev"]), int(m["next"]), m["state"])
                )
        elif "sched_wakeup" in line:
            m = WAKEUP.search(line)
            if m:
                events.append((float(m["ts"]), "w", -1, int(m["pid"]), 0, ""))
        elif "tracing_mark_write" in line:
            m = MARKER.search(line)
            if m:
                marks.append((float(m["ts"]), m["side"], m["what"]))
    windows: list[tuple[float, float, str]] = []
    for (t0, side, what), (t1, side1, what1) in zip(marks, marks[1:], strict=False):
        if what == "start" and what1 == "first" and side == side1:
            windows.append((t0, t1, side))
    starts = [w[0] for w in windows]
    per_window: list[dict[str, float]] = [defaultdict(float) for _ in windows]

    def add(a: float, b: float, key: str) -> None:
        """Add the part of [a, b] inside request windows to their `key`."""
        i = max(0, bisect_right(starts, a) - 1)
        while i < len(windows) and windows[i][0] < b:
            lo, hi = max(a, windows[i][0]), min(b, windows[i][1])
            if hi > lo:
                per_window[i][key] += 1e3 * (hi - lo)
            i += 1

    names: dict[int, str] = {}

    def who(tid: int, side_pid: int, per_thread: bool = False) -> str:
        if tid == 0:
            return "idle"
        pid = owners.get(tid, -1)
        if pid == side_pid:
            return f"engine {comms.get(tid, '?')}/{tid}" if per_thread else "engine"
        if pid not in names:
            names[pid] = "gone" if pid == -1 else process_name(pid)
        return names[pid]

    running: dict[int, tuple[int, float]] = {}  # cpu -> (tid, since)
    runnable: dict[int, float] = {}  # tid -> since
    for ts, kind, cpu, a, b, state in events:
        if kind == "w":
            runnable.setdefault(a, ts)
            continue
        side = windows[max(0, bisect_right(starts, ts) - 1)][2] if windows else SERVE
        side_pid = engine_pid[side]
        if cpu in running:
            tid, since = running[cpu]
            add(since, ts, who(tid, side_pid))
            if owners.get(tid) == side_pid:
                add(since, ts, who(tid, side_pid, per_thread=True))
        if state.startswith("R") and a != 0:
            runnable[a] = ts  # preempted: still wants a CPU
        else:
            runnable.pop(a, None)
        if b in runnable:
            waited_since = runnable.pop(b)
            if owners.get(b) == side_pid:
                add(waited_since, ts, "engine runnable")
        running[cpu] = (b, ts)
    by_side: dict[str, list[dict[str, float]]] = {SERVE: [], ENGINE: []}
    for (t0, t1, side), parts in zip(windows, per_window, strict=True):
        parts["window"] = 1e3 * (t1 - t0)
        by_side[side].append(dict(parts))
    return by_side


async def run(
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], str, tuple[dict[int, int], dict[int, str]]]:
    import torch

    from worker.config import EngineConfig
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    engine = Engine.launched(EngineConfig(model="demo", device="cpu"))
    serial = iter(range(10**9))
    marker = open(TRACING / "trace_marker", "w", buffering=1)  # noqa: SIM115

    tracing = False

    def mark(side: str, what: str) -> None:
        if tracing:  # (a write while tracing is off fails)
            marker.write(f"kvray {side} {what}\n")

    async def in_process(prompt: list[int]) -> float:
        params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
        start, first = time.perf_counter(), None
        mark(ENGINE, "start")
        async for _ in engine.submit([EngineRequest(f"t{next(serial)}", prompt, params)]):
            if first is None:
                first = 1e3 * (time.perf_counter() - start)
                mark(ENGINE, "first")
        assert first is not None
        return first

    url = f"{args.base_url}/v1/completions"
    rng = random.Random(args.seed)
    ttfts: dict[str, list[float]] = {SERVE: [], ENGINE: []}
    async with aiohttp.ClientSession() as session:

        async def through_serve(prompt: list[int]) -> float:
            return await streamed_ttft_ms(
                session,
                url,
                prompt,
                on_send=lambda: mark(SERVE, "start"),
                on_first=lambda: mark(SERVE, "first"),
            )

        for _ in range(3):  # warm-up, untraced
            prompt = [rng.randrange(1, 40_000) for _ in range(args.prompt_len)]
            await through_serve(prompt)
            await in_process(prompt)
        start_tracing(args.buffer_kb)
        tracing = True
        try:
            for rep in range(args.reps):
                prompt = [rng.randrange(1, 40_000) for _ in range(args.prompt_len)]
                order = (SERVE, ENGINE) if rep % 2 == 0 else (ENGINE, SERVE)
                for side in order:
                    await asyncio.sleep(args.pause)
                    call = through_serve if side == SERVE else in_process
                    ttfts[side].append(await call(prompt))
        finally:
            owners = thread_owners()  # before the engine's threads go
            tracing = False
            text = stop_tracing()
            marker.close()
    engine.shutdown()
    return ttfts, text, owners


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pause", type=float, default=0.3, help="seconds idle before a request")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--buffer-kb", type=int, default=65536, help="trace buffer per CPU")
    ap.add_argument(
        "--seed",
        type=int,
        help="prompts' seed (default: new each run: the worker's prefix cache keeps what an earlier run sent)",
    )
    ap.add_argument("--out", help="write the result here (JSON)")
    ap.add_argument("--trace-out", help="write the raw trace here")
    args = ap.parse_args(argv)

    engine_pid = {SERVE: worker_pid(), ENGINE: os.getpid()}
    ttfts, text, (owners, comms) = asyncio.run(run(args))
    if args.trace_out:
        Path(args.trace_out).write_text(text)
    by_side = account(text, engine_pid, owners, comms)
    keys = sorted({k for windows in by_side.values() for w in windows for k in w})
    order = ["window", "engine", "engine runnable", "idle"]
    keys = order + [k for k in keys if k not in order]
    print(f"\nper request window (client send -> first token), mean ms over {args.reps}")
    print(f"{'':24s} {'serve':>9s} {'in-process':>11s} {'difference':>11s}")
    summary = {}
    for key in keys:
        means = {s: sum(w.get(key, 0.0) for w in ws) / max(1, len(ws)) for s, ws in by_side.items()}
        summary[key] = means
        if key.startswith("engine ") and max(means.values()) < 0.5:
            continue  # one of the engine process's threads, nearly idle: in the JSON only
        print(
            f"{key:24s} {means[SERVE]:9.2f} {means[ENGINE]:11.2f} {means[SERVE] - means[ENGINE]:+11.2f}"
        )
    paired = [a - b for a, b in zip(ttfts[SERVE], ttfts[ENGINE], strict=True)]
    print(
        f"client TTFT median: serve {statistics.median(ttfts[SERVE]):.1f}, in-process "
        f"{statistics.median(ttfts[ENGINE]):.1f} ms; paired median {statistics.median(paired):+.1f}"
    )
    write_result(args.out, args, ttft_ms=ttfts, windows=by_side, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
