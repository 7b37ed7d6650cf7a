"""What a small background load costs the CPU engine's decode steps, by the background's
priority: the demo engine (4 requests decoding, 2 torch threads) stepped by hand, beside
nothing, or beside `--procs` processes that each spin 1 ms every 14 ms (~7 % of a core each,
about what Ray's and Serve's processes keep busy on a small machine) at niceness 19 (where
kvray puts Ray's control plane), at 19 with a 0.1 ms EEVDF slice (`sched_setattr`; Linux
6.6+), or at 0. Phases alternate, `--steps` steps each; the context grows by one token a step,
so compare phases of one repetition.

    python -m benchmarks.background_load [--kinds none,n19,n19-short,n0] [--procs 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import struct
import time

from benchmarks import write_result

SYS_SCHED_SETATTR = 314  # x86_64
SPIN_MS, PERIOD_MS = 1.0, 14.0


def set_slice(nanoseconds: int, tid: int = 0) -> None:
    """A thread's EEVDF slice (0: the default; `tid` 0: this thread), its policy SCHED_OTHER
    and niceness kept."""
    libc = ctypes.CDLL(None, use_errno=True)
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    # struct sched_attr: size, policy, flags, nice, priority, runtime (the slice), deadline, period, util min/max
    attr = ctypes.create_string_buffer(
        struct.pack("IIQiIQQQII", 56, 0, 0, nice, 0, nanoseconds, 0, 0, 0, 0)
    )
    if libc.syscall(SYS_SCHED_SETATTR, tid, attr, 0) != 0:
        raise OSError(ctypes.get_errno(), "sched_setattr")


def background(niceness: int, slice_ns: int) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, niceness)
    if slice_ns:
        set_slice(slice_ns)
    while True:
        end = time.perf_counter() + SPIN_MS / 1e3
        while time.perf_counter() < end:
            pass
        time.sleep((PERIOD_MS - SPIN_MS) / 1e3)


KINDS = {"n19": (19, 0), "n19-short": (19, 100_000), "n0": (0, 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="none,n19,n19-short,n0")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)

    import torch

    from worker.config import EngineConfig
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    torch.set_num_threads(2)
    engine = Engine(EngineConfig(model="demo", device="cpu", max_running=8))
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    engine.submit(
        [
            EngineRequest(f"r{i}", list(range(1000 + 64 * i, 1064 + 64 * i)), params)
            for i in range(4)
        ]
    )

    def steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            engine.step()
            times.append(1e3 * (time.perf_counter() - start))
        return times

    steps(10)
    kinds = args.kinds.split(",")
    medians: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(args.reps):
        for kind in kinds:
            procs = (
                [
                    mp.Process(target=background, args=KINDS[kind], daemon=True)
                    for _ in range(args.procs)
                ]
                if kind != "none"
                else []
            )
            for p in procs:
                p.start()
            time.sleep(0.3)
            median = statistics.median(steps(args.steps))
            for p in procs:
                p.kill()
                p.join()
            medians[kind].append(median)
            print(f"repetition {rep}  {kind:10s} decode step p50 {median:6.1f} ms", flush=True)
    for kind in kinds:
        print(
            f"{kind:10s} "
            + ", ".join(f"{m:.1f}" for m in medians[kind])
            + f"  (median {statistics.median(medians[kind]):.1f} ms)"
        )
    write_result(args.out, args, decode_step_p50_ms=medians)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
