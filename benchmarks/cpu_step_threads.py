"""CPU engine steps on fewer torch threads: is a step bound by memory or by arithmetic?

For each decode batch B, B requests decode on the demo model (64-token prompts) and their
steps are timed alternately on every thread and on one thread fewer; then, on the same batch,
steps that also carry one whole fresh prompt. A decode step of a few requests reads every
weight once and computes little, so a thread fewer barely slows it; that is what
`EngineConfig.cpu_small_step_tokens` relies on (docs/architecture.md, "One step").

    python -m benchmarks.cpu_step_threads --batches 1 4 8 16 32 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from datetime import UTC, datetime

import torch

from benchmarks.decode_step import run_until_decoding
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.sampling import SamplingParams

_ids = itertools.count()


def _step_ms(
    engine: Engine, threads: int, steps: int, prompt: list[list[int]] | None = None
) -> float:
    """Median ms of `steps` engine steps on `threads` torch threads; with `prompt`, each step
    also takes one of those prompts whole (a new request, one output token)."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    torch.set_num_threads(threads)
    times = []
    for _ in range(steps):
        if prompt is not None:
            engine.submit([EngineRequest(f"p{next(_ids)}", prompt.pop(), one)])
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
        if prompt is not None:
            engine.step()  # the prompt's request ends: the next timed step is the same batch again
    return statistics.median(times)


def run(batches: list[int], prompt_len: int, steps: int, rounds: int) -> dict:
    threads = torch.get_num_threads()
    fewer = max(1, threads - 1)
    g = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(10, 30000, (prompt_len,), generator=g).tolist() for _ in range(n)]

    results: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": [threads, fewer],
        "prompt_len": prompt_len,
        "steps": steps,
        "batches": {},
    }
    for batch in batches:
        # cpu_small_step_tokens=None: the step's thread count is the one set here
        engine = Engine(
            EngineConfig(
                model="demo",
                device="cpu",
                max_running=max(batch + 1, 8),
                cpu_small_step_tokens=None,
            )
        )
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        engine.submit([EngineRequest(f"d{i}", p, params) for i, p in enumerate(prompts(batch))])
        run_until_decoding(engine)
        row: dict = {
            "decode_ms": {threads: [], fewer: []},
            "with_prompt_ms": {threads: [], fewer: []},
        }
        for _ in range(rounds):
            for n in (threads, fewer):
                row["decode_ms"][n].append(_step_ms(engine, n, steps))
                row["with_prompt_ms"][n].append(
                    _step_ms(engine, n, max(3, steps // 3), prompts(steps))
                )
        torch.set_num_threads(threads)
        results["batches"][batch] = row
        print(
            f"B={batch:3d}  decode: {threads} threads {_fmt(row['decode_ms'][threads])} ms, {fewer} {_fmt(row['decode_ms'][fewer])} ms"
            f"  | + a {prompt_len}-token prompt: {threads} {_fmt(row['with_prompt_ms'][threads])}, {fewer} {_fmt(row['with_prompt_ms'][fewer])}",
            flush=True,
        )
    return results


def _fmt(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=9, help="timed steps per median")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternations of the two thread counts"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = run(args.batches, args.prompt_len, args.steps, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
