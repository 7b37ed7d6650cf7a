"""The cyclic garbage collector's pauses under an engine's decode load, with the startup heap
frozen (`worker.heap.freeze_heap`, what the worker and ingress replicas do) or not: the demo
engine on CPU in a process that has also imported Ray Serve and kvray's app (a replica's
heap), `--loads` runs of `--concurrency` requests decoding `--tokens` tokens each; every
collection timed by generation (`gc.callbacks`).

    python -m benchmarks.gc_pauses [--freeze] [--loads 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from typing import Any

from benchmarks import write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--freeze", action="store_true", help="freeze the heap after the first (warm-up) load"
    )
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)

    import ray.serve  # noqa: F401  (a replica's heap)

    import cluster.app  # noqa: F401
    from benchmarks.replica_step import decode_load
    from worker.config import EngineConfig
    from worker.heap import freeze_heap

    config = EngineConfig(model="demo", device="cpu")
    asyncio.run(decode_load(config, None, args.concurrency, 16))
    tracked = len(gc.get_objects())
    frozen = freeze_heap() if args.freeze else 0
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(1e3 * (time.perf_counter() - started[0]))

    gc.callbacks.append(timed)
    start = time.perf_counter()
    steps = [
        asyncio.run(decode_load(config, None, args.concurrency, args.tokens))["step_mean_ms"]
        for _ in range(args.loads)
    ]
    seconds = time.perf_counter() - start
    gc.callbacks.remove(timed)
    print(
        f"{tracked} objects tracked, {frozen} frozen; {seconds:.1f} s of load, step means "
        + ", ".join(f"{s:.1f}" for s in steps)
        + " ms"
    )
    for generation, ms in pauses.items():
        print(
            f"generation {generation}: {len(ms):4d} collections, {sum(ms):7.1f} ms in all, longest {max(ms, default=0.0):6.1f} ms"
        )
    write_result(
        args.out,
        args,
        objects_tracked=tracked,
        objects_frozen=frozen,
        load_seconds=seconds,
        step_mean_ms=steps,
        pauses_ms={str(g): ms for g, ms in pauses.items()},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
