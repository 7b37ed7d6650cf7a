"""Engine decode step on a GPU: ms/step in steady state, CUDA graphs on and off, vs the floor.

For each model shape (random bf16 weights drawn on the device) and batch size: B requests
with `--context` prompt tokens each are prefilled, then `--steps` steady decode steps are
timed: wall time per `engine.step()`, each of which waits for one step's sampled ids on the
host. Four runs of the same engine: graphs with overlap (the default: the next step is
queued before this one's ids are read), graphs without overlap (host work between steps),
and graphs off (with and without overlap). Also the GPU time alone: the bucket's graph replayed back to
back, timed with CUDA events. The floor is (weight bytes + KV bytes read) / 4.19 TB/s, the
H200's measured copy bandwidth. Also: time to first token of one `--context`-token prompt,
against its FLOP floor at 790 TFLOP/s.

    python benchmarks/decode_step.py --shapes smollm2-135m llama3-8b --out decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.model.random_model import get_shape, hf_config
from worker.sampling import SamplingParams

COPY_TBPS = 4.19e12
BF16_FLOPS = 790e12


def _engine(
    shape: str, max_running: int, context: int, steps: int, extra_tokens: int = 0, **overrides
) -> Engine:
    """`extra_tokens`: room for other requests (pages, and the longest prompt) beside the batch;
    `overrides`: other EngineConfig fields."""
    path = Path(tempfile.mkdtemp(prefix=f"kvray-{shape}-"))
    (path / "config.json").write_text(json.dumps(hf_config(get_shape(shape), "bfloat16")))
    pages = max_running * ((context + steps + 64) // 16 + 1) + extra_tokens // 16 + 16
    cfg = EngineConfig(model=str(path), load_format="random", dtype="bfloat16", device="cuda", max_running=max_running,
                       max_seq_len=max(context, extra_tokens) + steps + 128, num_pages=pages, token_budget=8192,
                       **overrides)  # fmt: skip
    return Engine(cfg)


def run_until_decoding(engine: Engine) -> None:
    """Step until every submitted request has finished its prompt and decodes one token a step."""
    engine.step()  # drains the inbox into the scheduler
    while engine.scheduler.waiting or any(
        r.num_pending > 1 or not r.output_ids for r in engine.scheduler.running
    ):
        engine.step()


def _time_steps(
    engine: Engine,
    batch: int,
    context: int,
    steps: int,
    tag: str,
    replay: list[float] | None = None,
) -> float:
    # Prompts finish prefill over several steps (B x context tokens at token_budget a step), and
    # the first ones decode meanwhile: room for that skew, so no request ends in the timed window.
    params = SamplingParams(temperature=0, max_tokens=steps + 48, ignore_eos=True)
    g = torch.Generator().manual_seed(
        3 * batch + "gsef".index(tag)
    )  # fresh prompts per run: no prefix hits
    prompts = [torch.randint(10, 30000, (context,), generator=g).tolist() for _ in range(batch)]
    stream = engine.submit(
        [EngineRequest(f"{tag}-{batch}-{i}", p, params) for i, p in enumerate(prompts)]
    )
    run_until_decoding(engine)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    overlapped = engine.num_overlapped_steps
    start = time.perf_counter()
    for _ in range(steps - 4):
        engine.step()
    elapsed = (time.perf_counter() - start) / (steps - 4)
    overlapped = engine.num_overlapped_steps - overlapped
    if engine.config.overlap and overlapped != steps - 4:  # the batch changed: not steady decode
        print(
            f"  warning: {tag} B={batch}: {overlapped} of {steps - 4} timed steps overlapped",
            flush=True,
        )
    if replay is not None:
        replay.append(_replay_ms(engine, batch))
    stream.close()
    while engine.has_work:
        engine.step()
    return elapsed * 1e3


def _replay_ms(engine: Engine, batch: int, n: int = 30) -> float:
    """GPU time of one decode step: the bucket's graph replayed back to back (same inputs)."""
    runner = engine.executor.graphs
    assert runner is not None
    graph = runner.graphs[runner.bucket(batch) or 0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def _set(engine: Engine, *, graphs, overlap: bool) -> None:
    engine.executor.graphs = graphs
    engine.config = engine.config.model_copy(update={"overlap": overlap})


def _ttft(engine: Engine, context: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = torch.randint(
        10, 30000, (context,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    times = []
    for i in range(5):
        stream = engine.submit([EngineRequest(f"ttft-{i}", [p + i for p in prompt], params)])
        torch.cuda.synchronize()
        start = time.perf_counter()
        while not stream.finished:
            engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[len(times[1:]) // 2]


def result_header(context: int, steps: int) -> dict:
    """What every GPU step benchmark's JSON starts with: when, where, and the run's shape."""
    return {
        "date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "host": platform.node(), "context": context, "steps": steps, "rows": [],
    }  # fmt: skip


def run(shapes: list[str], batches: list[int], context: int, steps: int) -> dict:
    results = {**result_header(context, steps), "prefill": []}
    for shape in shapes:
        engine = _engine(shape, max(batches), context, steps)
        weights = sum(p.numel() * p.element_size() for p in engine.executor.model.parameters())
        kv_per_token = 2 * engine.model_config.num_layers * engine.model_config.kv_size * 2
        n_params = sum(p.numel() for p in engine.executor.model.parameters())
        graphs = engine.executor.graphs
        for batch in batches:
            replay: list[float] = []
            _set(engine, graphs=graphs, overlap=True)
            overlapped = _time_steps(engine, batch, context, steps, "g", replay)
            _set(engine, graphs=graphs, overlap=False)
            sync = _time_steps(engine, batch, context, steps, "s")
            _set(engine, graphs=None, overlap=True)
            eager = _time_steps(engine, batch, context, steps, "e")
            _set(engine, graphs=None, overlap=False)
            eager_sync = _time_steps(engine, batch, context, steps, "f")
            floor = (weights + batch * (context + steps // 2) * kv_per_token) / COPY_TBPS * 1e3
            row = dict(shape=shape, batch=batch, graph_ms=overlapped, graph_no_overlap_ms=sync, gpu_replay_ms=replay[0],
                       eager_ms=eager, eager_no_overlap_ms=eager_sync, floor_ms=floor, graph_speedup=eager / overlapped, of_floor=floor / overlapped)  # fmt: skip
            results["rows"].append(row)
            print(f"{shape:14s} B={batch:4d}  graph {overlapped:7.3f} ms  (no overlap {sync:7.3f}, GPU alone {replay[0]:7.3f})  "
                  f"eager {eager:7.3f} ms (no overlap {eager_sync:7.3f})  floor {floor:6.3f} ms  graphs x{eager / overlapped:4.2f}  "
                  f"{100 * floor / overlapped:5.1f}% of floor", flush=True)  # fmt: skip
        _set(engine, graphs=graphs, overlap=True)
        ttft = _ttft(engine, context)
        flop_floor = 2 * n_params * context / BF16_FLOPS * 1e3
        results["prefill"].append(
            dict(shape=shape, tokens=context, ttft_ms=ttft, flop_floor_ms=flop_floor)
        )
        print(
            f"{shape:14s} TTFT {context} tokens: {ttft:.2f} ms (FLOP floor {flop_floor:.2f} ms)",
            flush=True,
        )
        del engine
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = run(args.shapes, args.batches, args.context, args.steps)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
