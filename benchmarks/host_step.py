"""Host time of an engine step's bookkeeping, with the model's forward left out.

A step whose batch changed (a request finished or joined) cannot advance its metadata on
the device: the host rebinds every buffer and rebuilds the sampling batch. On a GPU this
host work sits between two GPU steps, so its cost per request matters at large batches.
This times those pieces on a tiny random model (the forward is not part of any figure):

- bind: `KVCache._bind_from_host` for B running decodes;
- sampling build: `SamplingBatchInfo.build` for B greedy requests;
- schedule: `Scheduler.schedule` with B running decodes;
- step host work: one whole steady `engine.step()` minus its forward and sampling.

    python -m benchmarks.host_step --batches 64 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.model.random_model import get_shape, hf_config
from worker.request import ScheduledTask
from worker.sampling import SamplingParams


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def measure(batch: int, repeat: int) -> dict:
    path = Path(tempfile.mkdtemp(prefix="kvray-host-step-"))
    (path / "config.json").write_text(json.dumps(hf_config(get_shape("tiny"), "float32")))
    cfg = EngineConfig(model=str(path), load_format="random", dtype="float32", device="cpu", max_running=batch,
                       max_seq_len=512, num_pages=batch * 32, token_budget=8192, overlap=False)  # fmt: skip
    engine = Engine(cfg)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    engine.submit(
        [
            EngineRequest(f"r{i}", [(7 * j + i) % 500 for j in range(64)], params)
            for i in range(batch)
        ]
    )
    engine.step()  # drains the inbox into the scheduler
    while engine.scheduler.waiting or any(not r.output_ids for r in engine.scheduler.running):
        engine.step()
    ex, cache = engine.executor, engine.executor.cache
    tasks = [ScheduledTask(r, 1) for r in engine.scheduler.running]
    assert len(tasks) == batch
    rows = [t.request.row for t in tasks]
    starts = cache._task_len[rows]
    seq_lens = [int(s) + 1 for s in starts]

    def build() -> None:
        ex._sampling = None
        ex._sampling_info(tasks, list(range(batch)), False)

    forward = ex.forward
    forward_s = [0.0]

    def timed_forward(b, all_logits=False):
        start = time.perf_counter()
        out = forward(b, all_logits)
        forward_s[0] += time.perf_counter() - start
        return out

    ex.forward = timed_forward  # type: ignore[method-assign]

    def step() -> None:
        forward_s[0] = 0.0
        engine.step()

    row = {
        "batch": batch,
        "bind_ms": _median_ms(
            lambda: cache._bind_from_host(tasks, rows, starts, seq_lens, batch, ()), repeat
        ),
        "sampling_build_ms": _median_ms(build, repeat),
        "schedule_ms": _median_ms(engine.scheduler.schedule, repeat),
    }
    cache.invalidate_bind()
    ex._sampling = None
    engine.step()  # back to a steady batch after the timed rebinds
    totals = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        totals.append(time.perf_counter() - start - forward_s[0])
    row["steady_step_host_ms"] = sorted(totals)[len(totals) // 2] * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, float]] = []
    result = {
        "benchmark": "host_step",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "torch": torch.__version__,
        "rows": rows,
    }
    for batch in args.batches:
        row = measure(batch, args.repeat)
        rows.append(row)
        print(f"B={batch:4d}  bind {row['bind_ms']:6.2f} ms  sampling build {row['sampling_build_ms']:6.2f} ms  "
              f"schedule {row['schedule_ms']:6.2f} ms  steady step host {row['steady_step_host_ms']:6.2f} ms", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
