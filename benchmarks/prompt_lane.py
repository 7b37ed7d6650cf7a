"""The CPU prompt lane: what a prompt beside the decode steps costs them, and what it costs
the prompt.

B requests decode on the demo model (64-token prompts) and the engine's decode steps are
timed in three ways, alternately: alone; while the prompt lane runs fresh prompts on its own
thread, one after another (`Engine.lane_step`, as a server's lane thread does); and, without
the lane, each with one fresh prompt in the step itself (what a decode step carrying a prompt
costs, the inter-token gap the lane removes). The prompts' own times are reported as well,
in the lane. With `--oversubscribed`, the decode steps are also timed beside the lane while
they keep every thread (what `Executor.claim_lane` prevents: more threads than cores).

    python -m benchmarks.prompt_lane --batches 1 4 8 16 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import threading
import time
from datetime import UTC, datetime

import torch

from benchmarks.cpu_step_threads import _fmt
from benchmarks.decode_step import run_until_decoding
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.sampling import SamplingParams

_ids = itertools.count()
_ONE = SamplingParams(
    temperature=0, max_tokens=1, ignore_eos=True
)  # a prompt that ends at its first token


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def _decode_steps(engine: Engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _beside_lane(engine: Engine, steps: int, prompt) -> tuple[list[float], list[float]]:
    """Decode steps timed while the lane runs prompts back to back; and the lane's step times."""
    stop = threading.Event()
    lane_times: list[float] = []

    def lane() -> None:
        while not stop.is_set():
            engine.submit([EngineRequest(f"p{next(_ids)}", prompt(), _ONE)])
            start = time.perf_counter()
            while not engine.lane_step():  # the engine's step in flight holds the threads: wait
                time.sleep(0.001)
            lane_times.append(time.perf_counter() - start)

    thread = threading.Thread(target=lane)
    thread.start()
    time.sleep(0.05)  # the first lane step is under way
    try:
        decode = _decode_steps(engine, steps)
    finally:
        stop.set()
        thread.join()
    return decode, lane_times


def _oversubscribed(engine: Engine, steps: int, prompt) -> tuple[list[float], list[float]]:
    """`_beside_lane` with the engine's steps on every thread while the lane runs."""
    executor = engine.executor
    claim = executor.claim_lane

    def take_threads_anyway() -> bool:
        return True  # lane_busy stays False: the engine's steps keep all their threads

    executor.claim_lane = take_threads_anyway  # type: ignore[method-assign]
    try:
        return _beside_lane(engine, steps, prompt)
    finally:
        executor.claim_lane = claim  # type: ignore[method-assign]


def _with_prompt(engine: Engine, steps: int, prompt) -> list[float]:
    """Each timed step also takes one fresh prompt whole (the lane off)."""
    engine.scheduler.lane_on = False
    times = []
    try:
        for _ in range(steps):
            engine.submit([EngineRequest(f"q{next(_ids)}", prompt(), _ONE)])
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            engine.step()  # the prompt's request ends: the next timed step is the same batch again
    finally:
        engine.scheduler.lane_on = True
    return times


def run(
    batches: list[int], prompt_len: int, steps: int, rounds: int, oversubscribed: bool = False
) -> dict:
    g = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(10, 30000, (prompt_len,), generator=g).tolist()

    results: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "prompt_len": prompt_len,
        "steps": steps,
        "batches": {},
    }
    for batch in batches:
        engine = Engine(EngineConfig(model="demo", device="cpu", max_running=max(batch + 1, 8)))
        lane = engine.executor.lane
        if lane is None:
            raise SystemExit("the prompt lane needs two torch threads or more")
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        engine.submit([EngineRequest(f"d{i}", prompt(), params) for i in range(batch)])
        run_until_decoding(engine)
        engine.scheduler.lane_on = (
            True  # what Engine.start() sets; this thread is the engine's loop
        )
        row: dict = {
            "alone_ms": [],
            "beside_lane_ms": [],
            "beside_lane_max_ms": [],
            "lane_prompt_ms": [],
            "in_step_ms": [],
        }
        for _ in range(rounds):
            row["alone_ms"].append(_median_ms(_decode_steps(engine, steps)))
            decode, lane_times = _beside_lane(engine, steps, prompt)
            row["beside_lane_ms"].append(_median_ms(decode))
            row["beside_lane_max_ms"].append(1e3 * max(decode))
            row["lane_prompt_ms"].append(_median_ms(lane_times))
            row["in_step_ms"].append(_median_ms(_with_prompt(engine, max(3, steps // 3), prompt)))
            if oversubscribed:
                decode, lane_times = _oversubscribed(engine, steps, prompt)
                row.setdefault("oversubscribed_ms", []).append(_median_ms(decode))
                row.setdefault("oversubscribed_lane_prompt_ms", []).append(_median_ms(lane_times))
        results["batches"][batch] = row
        print(
            f"B={batch:3d}  decode step alone {_fmt(row['alone_ms'])} ms | beside the lane {_fmt(row['beside_lane_ms'])}"
            f" (max {_fmt(row['beside_lane_max_ms'])}) | with a {prompt_len}-token prompt in it {_fmt(row['in_step_ms'])}"
            f" | the lane's prompt step {_fmt(row['lane_prompt_ms'])} ms on {lane.threads} thread(s)",
            flush=True,
        )
        if oversubscribed:
            print(
                f"        oversubscribed: decode step {_fmt(row['oversubscribed_ms'])} ms, the lane's prompt step"
                f" {_fmt(row['oversubscribed_lane_prompt_ms'])} ms",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per median")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--oversubscribed",
        action="store_true",
        help="also: the engine's steps on every thread beside the lane",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = run(args.batches, args.prompt_len, args.steps, args.rounds, args.oversubscribed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
