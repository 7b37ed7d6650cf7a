"""Does the time a request takes to reach the engine after its predecessor's end raise the
engine's queue under a closed loop? The demo engine on CPU (prompt lane on, prefix cache off
so that repeated loads do the same work), `kvray bench serve`'s prompts at concurrency 4, each
request submitted `--delays` ms after its predecessor ended (Serve's path adds ~6 ms),
the delays in turns (ABBA) over `--reps` repetitions; each load's engine queue (arrival to
first scheduled) and TTFT.

    python -m benchmarks.arrival_delay [--delays 0,6,40] [--reps 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from benchmarks import write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--delays",
        default="0,6,40",
        help="ms between a request's end and its successor's submission",
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)

    from benchmarks.serve import warm_up_samples
    from benchmarks.stats import BenchSample, make_samples
    from worker.config import EngineConfig
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    samples = make_samples(args.num_prompts, 64, 64, 0.5, 0, 49152, 0)
    delays = [float(d) for d in args.delays.split(",")]
    counter = iter(range(10**9))

    async def request(engine: Engine, sample: BenchSample, max_tokens: int) -> tuple[float, float]:
        """Its engine queue and TTFT (s)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        start, ttft, queue = time.perf_counter(), 0.0, 0.0
        async for frame in engine.submit(
            [EngineRequest(f"r{next(counter)}", sample.prompt, params)]
        ):
            ttft = ttft or time.perf_counter() - start
            queue = next((d.metrics.queue_time for d in frame if d.metrics is not None), queue)
        return queue, ttft

    async def load(engine: Engine, delay_ms: float) -> dict[str, float]:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(sample: BenchSample) -> tuple[float, float]:
            async with gate:
                await asyncio.sleep(delay_ms / 1e3)
                return await request(engine, sample, sample.output_len)

        done = await asyncio.gather(*(one(s) for s in samples))
        queues = np.array([q for q, _ in done]) * 1e3
        return {
            "queue_mean_ms": float(queues.mean()),
            "queue_p90_ms": float(np.percentile(queues, 90)),
            "waited_over_20_ms": int((queues > 20).sum()),
            "ttft_p50_ms": 1e3 * statistics.median(t for _, t in done),
        }

    async def run() -> dict[str, list[dict[str, float]]]:
        engine = Engine.launched(EngineConfig(model="demo", device="cpu", prefix_cache=False))
        try:
            await asyncio.gather(*(request(engine, s, 4) for s in warm_up_samples(samples)))
            results: dict[str, list[dict[str, float]]] = {str(d): [] for d in delays}
            for rep in range(args.reps):
                for delay in delays if rep % 2 == 0 else delays[::-1]:
                    r = await load(engine, delay)
                    results[str(delay)].append(r)
                    print(
                        f"repetition {rep}  delay {delay:5.1f} ms: engine queue mean {r['queue_mean_ms']:6.1f} ms, "
                        f"p90 {r['queue_p90_ms']:6.1f}, {r['waited_over_20_ms']}/{len(samples)} waited > 20 ms; "
                        f"TTFT p50 {r['ttft_p50_ms']:6.1f} ms",
                        flush=True,
                    )
            return results
        finally:
            engine.shutdown()

    write_result(args.out, args, results=asyncio.run(run()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
