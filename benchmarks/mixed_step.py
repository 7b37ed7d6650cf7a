"""Steps that carry prompt tokens, on a GPU: ms per step with the piecewise prompt graphs and
eagerly, next to the decode-only step of the same batch.

For each model shape (random bf16 weights drawn on the device) and decode batch B: B requests
decode at `--context` tokens of context, and each timed step also prefills one whole P-token
prompt beside them, as the scheduler packs a chunk next to decodes. A mixed step's time over
the decode-only step is what the prompt pacer budgets (a fixed cost plus a cost per prompt
token, worker/scheduler.py); eagerly its fixed part was the Python launches of a few hundred
small kernels. B = 0 is a lone prompt: its step time is the engine's part of a time to first
token.

    python benchmarks/mixed_step.py --shapes smollm2-135m llama3-8b --out mixed.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.decode_step import _engine, result_header, run_until_decoding
from worker.engine import Engine, EngineRequest
from worker.sampling import SamplingParams


def _timed(engine: Engine, steps: int) -> float:
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def _mixed_ms(engine: Engine, batch: int, prompt: int, steps: int, seed: int) -> float:
    """ms per step of `batch` decodes beside one whole `prompt`-token prompt (a new one each step)."""
    g = torch.Generator().manual_seed(seed)  # fresh prompts: no prefix-cache hits
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    chunks = [torch.randint(10, 30000, (prompt,), generator=g).tolist() for _ in range(steps + 3)]
    engine.scheduler.token_budget = batch + prompt
    stream = engine.submit([EngineRequest(f"c{seed}-{i}", p, one) for i, p in enumerate(chunks)])
    ms = _timed(engine, steps)
    while not stream.finished:
        engine.step()
    return ms


def run(
    shapes: list[str], batches: list[int], prompts: list[int], context: int, steps: int
) -> dict:
    results = result_header(context, steps)
    for shape in shapes:
        start = time.perf_counter()
        engine = _engine(
            shape,
            max(batches) + 4,
            context,
            64 * steps,
            extra_tokens=4 * max(prompts),
            prompt_graph_tokens=2048,
        )
        results.setdefault("engine_start_s", {})[shape] = time.perf_counter() - start
        runner = engine.executor.prompt_graphs
        assert runner is not None, "the engine captured no prompt graphs"
        seed = 0
        for batch in batches:
            params = SamplingParams(temperature=0, max_tokens=64 * steps, ignore_eos=True)
            g = torch.Generator().manual_seed(1000 + batch)
            decodes = [
                torch.randint(10, 30000, (context,), generator=g).tolist() for _ in range(batch)
            ]
            stream = (
                engine.submit(
                    [EngineRequest(f"d{batch}-{i}", p, params) for i, p in enumerate(decodes)]
                )
                if batch
                else None
            )
            if batch:
                engine.scheduler.token_budget = engine.config.token_budget
                run_until_decoding(engine)
                decode_ms = _timed(engine, steps)
            for prompt in prompts:
                ms = {}
                for graphs in (True, False):
                    engine.executor.prompt_graphs = runner if graphs else None
                    seed += 1
                    ms[graphs] = _mixed_ms(engine, batch, prompt, steps, seed)
                engine.executor.prompt_graphs = runner
                row = dict(shape=shape, batch=batch, prompt_tokens=prompt, bucket=runner.bucket(batch + prompt),
                           graphs_ms=ms[True], eager_ms=ms[False])  # fmt: skip
                line = f"{shape:14s} B={batch:3d} +{prompt:5d} prompt tokens (bucket {row['bucket']}): graphs {ms[True]:7.2f} ms  eager {ms[False]:7.2f} ms"
                if batch:
                    row.update(
                        decode_ms=decode_ms,
                        extra_graphs_ms=ms[True] - decode_ms,
                        extra_eager_ms=ms[False] - decode_ms,
                    )
                    line += f"  decode alone {decode_ms:6.2f} ms: extra {ms[True] - decode_ms:6.2f} vs {ms[False] - decode_ms:6.2f} ms"
                results["rows"].append(row)
                print(line, flush=True)
            if stream is not None:
                stream.close()
            while engine.has_work:
                engine.step()
        del engine
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[0, 32, 64])
    ap.add_argument("--prompts", nargs="+", type=int, default=[32, 128, 256, 512, 1024])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = run(args.shapes, args.batches, args.prompts, args.context, args.steps)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
