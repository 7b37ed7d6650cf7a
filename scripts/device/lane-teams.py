"""Which OpenMP teams a CPU engine's process holds after its prompt lane has run, and what they
cost the loop thread's prompt steps. No Ray: the app's engine launched in this process.

On the GPU host's 16 cores (session 22) the worker replica held a team of 7 threads beside the
loop's 15 after `kvray bench serve`'s warm-up pair (replica-threads.py, `futex_groups`): libgomp
then counts 23 threads on 16 cores and every barrier sleeps after ~100 spins.

Each variant in a fresh process: lone 64-token prompts (the engine's own step times), then pairs
of requests 50 ms apart (the second's prompt goes to the lane while the first decodes), then
lone prompts again; the process's futex groups (an idle team waits at one address) after each
phase and after each lane step, and the thread counts the loop set. Variants: `lane` (the
lane on, as it was on every CPU engine of 2 or more threads before session 22) and `default`.

    python3 scripts/device/lane-teams.py --config /tmp/cpu.yaml [--threads 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

VARIANTS = ("lane", "default")


def futex_groups() -> list[int]:
    """Sizes of the groups of 3 or more of this process's threads blocked on one futex."""
    waiting: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] == "202":
            waiting[fields[1]] += 1
    return sorted((n for n in waiting.values() if n >= 3), reverse=True)


def measure(config_path: str, threads: int, variant: str) -> dict:
    sys.path.insert(0, os.getcwd())
    import torch

    from cluster.app import load_config
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    torch.set_num_threads(threads)
    if variant == "lane":
        from worker.executor import Executor

        Executor._lane_possible = lambda self: torch.get_num_threads() >= 2  # type: ignore[method-assign]
    engine = Engine.launched(load_config(config_path).engine)
    if variant == "lane" and engine.executor.lane is not None:
        engine.executor.lane.threads = threads // 2  # its share as it was: half the threads
    lane_log: list[dict] = []
    loop_threads: collections.Counter[int | None] = collections.Counter()

    step_threads = engine.executor.step_threads

    def counted_step_threads(num_tokens: int) -> int | None:
        n = step_threads(num_tokens)
        loop_threads[n] += 1
        return n

    engine.executor.step_threads = counted_step_threads  # type: ignore[method-assign]
    lane_step = engine.lane_step

    def logged_lane_step() -> bool:
        ran = lane_step()
        if ran:
            lane_log.append(
                {"groups_after_step": futex_groups(), "torch_threads": torch.get_num_threads()}
            )
        return ran

    engine.lane_step = logged_lane_step  # type: ignore[method-assign]
    time.sleep(0.5)

    def run(i: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        prompt = [100 + (i * 7 + j) % 30000 for j in range(64)]
        for _ in engine.submit([EngineRequest(f"r{i}", prompt, params)]):
            pass

    def lone_prompts(first: int, n: int = 10) -> list[float]:
        engine.step_log = []
        for i in range(n):
            run(first + i, 1)
        return [round(1e3 * r.seconds, 1) for r in engine.step_log]

    lone_prompts(0, 3)  # warm
    result: dict = {"variant": variant, "groups_built": futex_groups()}
    before = lone_prompts(100)
    result["groups_before_pairs"] = futex_groups()
    for k in range(3):
        first = threading.Thread(target=run, args=(200 + 2 * k, 16))
        first.start()
        time.sleep(0.05)
        run(201 + 2 * k, 16)
        first.join()
    time.sleep(0.5)
    result["groups_after_pairs"] = futex_groups()
    after = lone_prompts(300)
    time.sleep(0.5)
    result |= {
        "groups_end": futex_groups(),
        "lane_steps": engine._num_lane_steps,
        "lane_log": lane_log,
        "loop_threads": {str(k): v for k, v in loop_threads.items()},
        "prompt_step_ms_before": before,
        "prompt_step_ms_after": after,
        "median_before": statistics.median(before),
        "median_after": statistics.median(after),
    }
    engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.variant:  # one variant, in this process
        print(json.dumps(measure(args.config, args.threads, args.variant)), flush=True)
        return
    results = []
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--config", args.config, "--threads", str(args.threads)]
        done = subprocess.run([*cmd, "--variant", variant], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        results.append(
            json.loads(lines[-1]) if lines else {"variant": variant, "error": done.stderr[-2000:]}
        )
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
