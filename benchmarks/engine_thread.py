"""Which thread builds a CPU engine, and which steps it: the demo engine's prompt and decode
steps when one thread does both, and when the engine is built on one thread and stepped on
another (a server's loop thread, as every server of kvray's did before `Engine.launched`).

GNU OpenMP (torch's CPU thread pool) gives every thread that runs parallel work a team of
its own. Once the teams' threads outnumber the cores, each thread spins only briefly at a
barrier before it sleeps on a futex, and a step's many small parallel ops each pay a wakeup.

    python -m benchmarks.engine_thread [--reps 3] [--threads N] [--shape smollm2-135m] [--out FILE]

`--shape` builds the demo's shape with random weights (a machine without the demo model).

Arrangements, each in a fresh process, alternated:
- main: built and stepped (`Engine.step`) on the main thread, as the offline `LLM` does;
- start: built on the main thread, stepped on the loop thread (`Engine(...)`, then `start()`);
- launched: built and stepped on the loop thread (`Engine.launched`);
- launched+lane: the same, after the CPU prompt lane has run a prompt (with 2 or 3 threads
  only: the lane runs on one torch thread and exists only there since session 22).
Each times 12 prompt steps of one new 64-token prompt, and the decode steps of 4 requests
generating 32 tokens each (the engine's own step log: wall time of each `step()`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import write_result

ARRANGEMENTS = ("main", "start", "launched", "launched+lane")


def measure(arrangement: str, threads: int, prompt_len: int, shape: str | None) -> dict[str, float]:
    """In this process: the engine arranged so; median prompt step and decode step, ms."""
    import tempfile

    import torch

    from worker.config import EngineConfig
    from worker.engine import Engine, EngineRequest
    from worker.model.random_model import get_shape, hf_config
    from worker.sampling import SamplingParams

    torch.set_num_threads(threads)
    if shape is None:
        config = EngineConfig(model="demo", device="cpu", max_running=8)
    else:
        model = Path(tempfile.mkdtemp(prefix="kvray-shape-"))
        (model / "config.json").write_text(json.dumps(hf_config(get_shape(shape), "float32")))
        config = EngineConfig(
            model=str(model), load_format="random", dtype="float32", device="cpu", max_running=8
        )
    launched = arrangement.startswith("launched")
    engine = Engine.launched(config) if launched else Engine(config)
    if arrangement == "start":
        engine.start()
    rng = random.Random()  # new prompts each run: never a prefix-cache hit
    serial = iter(range(10**9))

    def run(count: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        requests = [
            EngineRequest(
                f"r{next(serial)}", [rng.randrange(1, 40_000) for _ in range(prompt_len)], params
            )
            for _ in range(count)
        ]
        stream = engine.submit(requests)
        if arrangement == "main":
            while engine.has_work:
                engine.step()
        for _ in stream:  # to the end: every request finished
            pass

    for _ in range(3):
        run(1, 1)
    run(4, 8)
    if arrangement == "launched+lane":  # a prompt that arrives while another request decodes
        long = engine.submit([EngineRequest("long", [1] * prompt_len, SamplingParams(
            temperature=0, max_tokens=64, ignore_eos=True))])  # fmt: skip
        next(iter(long))  # it decodes now
        run(1, 1)
        for _ in long:
            pass
        assert engine.stats().num_lane_steps > 0, "the lane ran no step"
    engine.step_log = []
    for _ in range(12):
        run(1, 1)
    prompt = [r.seconds for r in engine.step_log if r.num_prompt_tokens == prompt_len]
    engine.step_log = []
    run(4, 32)
    decode = [r.seconds for r in engine.step_log if r.num_decodes == 4 and not r.num_prompt_tokens]
    engine.shutdown()
    return {
        "prompt_step_ms": 1e3 * statistics.median(prompt),
        "decode_step_ms": 1e3 * statistics.median(decode),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--shape", help="random weights of this shape (e.g. smollm2-135m), not the demo"
    )
    ap.add_argument("--one", choices=ARRANGEMENTS, help=argparse.SUPPRESS)  # a child's run
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.threads, args.prompt_len, args.shape)))
        return 0

    # the lane exists at 2-3 threads only (Executor._lane_possible)
    arrangements = ARRANGEMENTS if args.threads in (2, 3) else ARRANGEMENTS[:-1]
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in arrangements}
    for rep in range(args.reps):
        order = arrangements[rep % len(arrangements) :] + arrangements[: rep % len(arrangements)]
        for arrangement in order:
            child = [sys.executable, "-m", "benchmarks.engine_thread", "--one", arrangement]
            child += ["--threads", str(args.threads), "--prompt-len", str(args.prompt_len)]
            child += ["--shape", args.shape] if args.shape else []
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            runs[arrangement].append(json.loads(out.strip().splitlines()[-1]))
            last = runs[arrangement][-1]
            print(
                f"repetition {rep}  {arrangement:13s}  prompt step {last['prompt_step_ms']:6.1f} ms"
                f"  decode step {last['decode_step_ms']:5.1f} ms",
                flush=True,
            )
    print(f"\nmedian over {args.reps} processes each ({args.threads} torch threads)")
    summary = {}
    for arrangement, results in runs.items():
        summary[arrangement] = {
            key: statistics.median(r[key] for r in results) for key in results[0]
        }
        print(
            f"{arrangement:13s}  prompt step {summary[arrangement]['prompt_step_ms']:6.1f} ms"
            f"  decode step {summary[arrangement]['decode_step_ms']:5.1f} ms"
        )
    write_result(args.out, args, runs=runs, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
