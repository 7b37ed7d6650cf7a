"""Does an engine step more slowly inside a Ray worker process than in a plain one?

Under `kvray bench serve` the worker replica's engine steps 1.4-2.4 ms (2-5 %) longer than
the same engine in the benchmark's own process, on the 2-core VM and on the GPU host's 16
cores alike. This runs one load, `--concurrency` requests decoding `--tokens` tokens each
through the engine's own loop thread (`Engine.start`, streams read by an asyncio consumer, as
a replica reads them), by turns in this process and in a plain Ray actor (no Serve, no HTTP,
no frames sent on) started with kvray's Ray settings (`SERVE_ENV`: workers at niceness 0) and
the same torch threads; `--reps` fresh engines in each place. What differs between a Serve
replica and this actor is then Serve's own work in the replica process.

    python -m benchmarks.replica_step [--config FILE] [--threads T] [--concurrency 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from benchmarks import write_result


async def decode_load(
    engine_config: Any, threads: int | None, concurrency: int, tokens: int
) -> dict[str, float]:
    """`concurrency` requests of 64 prompt tokens decoding `tokens` each, on a fresh engine;
    its mean step and the streams' inter-token gaps (p50)."""
    import torch

    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)
    engine = Engine.launched(engine_config)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    gaps: list[float] = []

    async def one(i: int) -> None:
        last = None
        async for _frame in engine.submit(
            [EngineRequest(f"r{i}", list(range(1000 + 64 * i, 1064 + 64 * i)), params)]
        ):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    try:
        await one(-1)  # warm-up
        gaps.clear()
        before = engine.stats()
        await asyncio.gather(*(one(i) for i in range(concurrency)))
        after = engine.stats()
    finally:
        engine.shutdown()
    steps = after.num_steps - before.num_steps
    return {
        "step_mean_ms": 1e3 * (after.step_seconds_total - before.step_seconds_total) / steps,
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", help="a kvray YAML (engine, worker_cpu_threads); default: the demo on CPU"
    )
    ap.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: the config's worker_cpu_threads, else every core)",
    )
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)

    import ray

    from cluster.app import load_config, set_serve_env
    from cluster.local_ray import ray_session

    config = load_config(args.config or {"engine": {"model": "demo", "device": "cpu"}})
    threads = args.threads or config.worker_cpu_threads or os.cpu_count()
    load = (config.engine, threads, args.concurrency, args.tokens)
    set_serve_env()
    results: dict[str, list[dict[str, float]]] = {"this process": [], "Ray actor": []}
    with ray_session(include_dashboard=False, log_to_driver=False):

        @ray.remote(num_cpus=0)
        class Place:
            async def run(self, *load: Any) -> dict[str, float]:
                return await decode_load(*load)

        actor = Place.remote()  # type: ignore[attr-defined]
        ray.get(actor.run.remote(*load))  # imports and first engine out of the way
        for rep in range(args.reps):
            order = ["this process", "Ray actor"] if rep % 2 == 0 else ["Ray actor", "this process"]
            for place in order:
                r = (
                    asyncio.run(decode_load(*load))
                    if place == "this process"
                    else ray.get(actor.run.remote(*load))
                )
                results[place].append(r)
                print(
                    f"repetition {rep}  {place:12s}  step mean {r['step_mean_ms']:6.2f} ms  ITL p50 {r['itl_p50_ms']:6.2f} ms"
                    f"  (niceness {r['niceness']}, {r['torch_threads']} threads)",
                    flush=True,
                )
    for place, rs in results.items():
        steps = [r["step_mean_ms"] for r in rs]
        print(
            f"{place:12s}  step mean by repetition "
            + ", ".join(f"{s:.2f}" for s in steps)
            + f"  (median {statistics.median(steps):.2f} ms)"
        )
    write_result(args.out, args, results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
