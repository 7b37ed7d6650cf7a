"""Where a step's time goes: torch profiler (GPU kernels, CPU ops) and cProfile (Python) over
a few steps, for one model shape and batch size, graphs on or off; steady decode, or with
`--prefill N` steps that also carry an N-token prompt chunk (as offline throughput's do).

    python benchmarks/profile_step.py --shape llama3-8b --batch 128 [--no-graphs] [--prefill 1920]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_step import _engine, run_until_decoding
from worker.engine import EngineRequest
from worker.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="each step also runs a prompt chunk of this many tokens",
    )
    args = ap.parse_args()
    prompts_after = 12 if args.prefill else 0  # one chunk a step: warm-up and profiled steps
    engine = _engine(
        args.shape,
        args.batch + prompts_after,
        args.context,
        64,
        extra_tokens=prompts_after * args.prefill,
    )
    if args.no_graphs:
        engine.executor.graphs = None
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [
        torch.randint(10, 30000, (args.context,), generator=g).tolist() for _ in range(args.batch)
    ]
    engine.submit([EngineRequest(f"p{i}", p, params) for i, p in enumerate(prompts)])
    run_until_decoding(engine)
    if args.prefill:  # from now on every step: the batch's decodes, then one whole prompt
        engine.scheduler.token_budget = args.batch + args.prefill
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        chunks = [
            torch.randint(10, 30000, (args.prefill,), generator=g).tolist()
            for _ in range(prompts_after)
        ]
        engine.submit([EngineRequest(f"c{i}", p, one) for i, p in enumerate(chunks)])
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    tag = f"{args.shape} B={args.batch}{f' +{args.prefill} prompt tokens' if args.prefill else ''} graphs={'off' if args.no_graphs else 'on'}"
    print(f"== {tag}: GPU time by kernel (5 steps)")
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=60
        )
    )
    print(f"== {tag}: CPU time by op (5 steps)")
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60
        )
    )
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"== {tag}: Python, 10 steps, by own time\n{s.getvalue()}")


if __name__ == "__main__":
    main()
