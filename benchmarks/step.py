"""`kvray bench step`: one engine step on a GPU, ms per step beside its floor.

Decode: for each model shape (random bf16 weights drawn on the device) and batch B, B
requests of `--context` prompt tokens are prefilled, then `--steps` steady decode steps are
timed, each `engine.step()` waiting for its sampled ids on the host. Four variants of one
engine: CUDA graphs with overlapped scheduling (the default: the next step is queued before
this one's ids are read), graphs without overlap, and eager with and without overlap; plus
the GPU time alone (the bucket's graph replayed back to back, CUDA events). The floor is
(weight bytes + KV bytes read) / 4.19 TB/s, the H200's copy bandwidth; an MoE layer's
weight bytes are those of the routed experts B tokens pick (their expected number under
uniform routing, which random weights give), and MLA's KV bytes its latent rows. Also the kernels one
eager decode step launches (torch profiler; every one costs host time when a step runs
eagerly), and the time to first token of one `--context`-token prompt against its FLOP
floor at 790 TFLOP/s (2 x active parameters a token).

Mixed: B requests decode while each timed step also prefills one whole P-token prompt, as
the scheduler packs a chunk beside decodes; prompt CUDA graphs against eager, and the
decode-only step of the same batch. B = 0 is a lone prompt step.

`--constrained F`: each decode row is timed once more in the default variant (graphs and
overlap) with F of its B requests (at least one) constrained by a JSON schema that never
lets them end (benchmarks/schema_corpus.py: ENDLESS), and reports the step's overhead over
the unconstrained one. The grammars need a tokenizer: `--tokenizer-from` (the demo's by
default; on a machine without it, the `.tok/` that scripts/prepare-wheels writes), whose
vocabulary the grammar then works over.

`--prefill-kernel`: the engine's prompt attention (`auto`, `kvray`, `flash`, or `fa3`,
FlashInfer's FlashAttention-3), for the TTFT and mixed steps.

`--profile`: where eager steps spend their time (GPU time and kernels per category: GEMM,
attention, KV store, norm/rope/activation, sampling; the twelve costliest kernels by name;
and the host time the GPU does not cover) for decode at the smallest and largest batch and
for one lone prompt.

`--trace DIR`: Chrome traces (host and GPU, `.json.gz`) of one lone prompt as the TTFT is
timed and of graph decode steps at the smallest batch, each with where the GPU sat idle:
before the first kernel, between kernels (the longest gaps) and after the last.
`--trace-python` records every Python call in them too, to name the host's time.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    BF16_TFLOPS,
    COPY_TBPS,
    copy_tokenizer,
    decode_layout,
    environment,
    hardware_text,
    write_result,
)
from benchmarks.schema_corpus import ENDLESS
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.guided import GuidedDecoding
from worker.kv_sizing import kv_bytes_per_token
from worker.model.demo import resolve_model_path
from worker.model.moe import MoE
from worker.model.random_model import get_shape, hf_config
from worker.sampling import SamplingParams
from worker.stats import StepRecord

VARIANTS = (  # (key, CUDA graphs, overlap)
    ("graph_ms", True, True),
    ("graph_no_overlap_ms", True, False),
    ("eager_ms", False, True),
    ("eager_no_overlap_ms", False, False),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"])
    parser.add_argument("--only", choices=["decode", "mixed"], help="one kind of step")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    parser.add_argument("--context", type=int, default=1024, help="tokens of context a request")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps a row")
    parser.add_argument("--mixed-batches", nargs="+", type=int, default=[0, 32, 64])
    parser.add_argument("--prompts", nargs="+", type=int, default=[32, 128, 512, 1024])
    parser.add_argument("--mixed-steps", type=int, default=10, help="timed mixed steps a row")
    parser.add_argument(
        "--ttft-runs",
        type=int,
        default=16,
        help="timed lone prompts; their median is the TTFT (docs/performance.md: why 16)",
    )
    parser.add_argument("--profile", action="store_true", help="print step breakdowns too")
    parser.add_argument(
        "--trace", metavar="DIR", help="write Chrome traces of a prompt and decode steps"
    )
    parser.add_argument(
        "--trace-python",
        action="store_true",
        help="with --trace: record every Python call too (a slower host, but its time named)",
    )
    parser.add_argument(
        "--prefill-kernel",
        choices=["auto", "kvray", "flash", "fa3"],
        default="auto",
        help="the engine's prompt attention (EngineConfig.advanced.prefill_kernel)",
    )
    parser.add_argument(
        "--constrained",
        type=float,
        default=0.0,
        help="also time decode with this share of the batch constrained by a JSON schema",
    )
    parser.add_argument(
        "--tokenizer-from", default="demo", help="model dir (or 'demo') lending its tokenizer"
    )
    parser.add_argument("--result-json", help="write the rows to this file")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("kvray bench step needs a CUDA GPU")
    print(f"kvray bench step: {hardware_text(environment())}", flush=True)
    result: dict[str, Any] = {"context": args.context, "decode": [], "prefill": [], "mixed": []}
    for shape in args.shapes:
        if args.only in (None, "decode"):
            _decode_shape(args, shape, result)
        if args.only in (None, "mixed"):
            result["mixed"] += _mixed_shape(args, shape)
        torch.cuda.empty_cache()
    write_result(args.result_json, "step", result)
    return 0


def make_engine(
    shape: str,
    max_running: int,
    context: int,
    steps: int,
    extra_tokens: int = 0,
    tokenizer_from: str | None = None,
    prefill_kernel: str = "auto",
) -> Engine:
    """An engine of random bf16 weights of `shape`, room for `max_running` requests of
    `context` + `steps` tokens and `extra_tokens` more (other prompts beside the batch);
    with the tokenizer of `tokenizer_from`, if given."""
    path = Path(tempfile.mkdtemp(prefix=f"kvray-{shape}-"))
    (path / "config.json").write_text(json.dumps(hf_config(get_shape(shape), "bfloat16")))
    if tokenizer_from is not None:
        copy_tokenizer(resolve_model_path(tokenizer_from), path)
    pages = max_running * ((context + steps + 64) // 16 + 1) + extra_tokens // 16 + 16
    config = EngineConfig(
        model=str(path),
        dtype="bfloat16",
        device="cuda",
        max_running=max_running,
        max_seq_len=max(context, extra_tokens) + steps + 128,
        num_pages=pages,
        token_budget=8192,
        advanced={"load_format": "random", "prefill_kernel": prefill_kernel},
    )
    return Engine(config)


def decode_weight_bytes(model: torch.nn.Module, tokens: int) -> float:
    """Weight bytes one decode step of `tokens` tokens must read: every weight, except that an
    MoE layer reads only the routed experts its tokens pick (their expected number when
    routing is uniform, as with random weights: E (1 - (1 - k/E)^tokens))."""
    total = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    for moe in _moe_layers(model):
        num, k = len(moe.experts), moe.gate.moe.top_k
        untouched = num * (1 - k / num) ** tokens
        total -= untouched * sum(p.numel() * p.element_size() for p in moe.experts[0].parameters())
    return total


def active_params(model: torch.nn.Module) -> int:
    """Parameters one token's forward uses (an MoE layer: k of its routed experts)."""
    total = sum(p.numel() for p in model.parameters())
    for moe in _moe_layers(model):
        num, k = len(moe.experts), moe.gate.moe.top_k
        total -= (num - k) * sum(p.numel() for p in moe.experts[0].parameters())
    return total


def _moe_layers(model: torch.nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def run_until_decoding(engine: Engine) -> None:
    """Step until every submitted request has finished its prompt and decodes one token a step."""
    engine.step()  # drains the inbox into the scheduler
    while engine.stats().num_waiting or any(
        r.num_pending > 1 or not r.output_ids for r in engine.scheduler.running
    ):
        engine.step()


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)  # fresh prompts per row: no prefix-cache hits
    return [torch.randint(10, 30000, (length,), generator=g).tolist() for _ in range(count)]


Graphs = tuple[Any, Any]  # an executor's decode and prompt graph runners


def _graphs(engine: Engine) -> Graphs:
    return engine.executor.graphs, engine.executor.prompt_graphs


def _set(engine: Engine, graphs: Graphs | None, overlap: bool) -> None:
    """Graphs on (both kinds) or off (None: every step eager), and overlap on or off."""
    engine.executor.graphs, engine.executor.prompt_graphs = graphs or (None, None)
    advanced = engine.config.advanced.model_copy(update={"overlap": overlap})
    engine.config = engine.config.model_copy(update={"advanced": advanced})


# -- decode ----------------------------------------------------------------------------------


def _decode_shape(args: argparse.Namespace, shape: str, result: dict[str, Any]) -> None:
    tokenizer = args.tokenizer_from if args.constrained > 0 else None
    engine = make_engine(
        shape, max(args.batches), args.context, args.steps, 0, tokenizer, args.prefill_kernel
    )
    model = engine.executor.model
    kv_per_token = kv_bytes_per_token(engine.model_config, torch.bfloat16)  # MLA: latent rows
    graphs = _graphs(engine)
    kernels = _kernels_per_step(engine)
    if choice := engine.executor.decode_layout:
        result.setdefault("decode_layout", {})[shape] = decode_layout(engine)
        print(f"{shape:14s} decode layout at start (µs token-split / head-major -> kept): "
              f"{choice.summary() or 'not measured'}", flush=True)  # fmt: skip
    for number, batch in enumerate(args.batches):
        row: dict[str, Any] = {"shape": shape, "batch": batch, "kernels_per_step": kernels}
        for index, (key, with_graphs, overlap) in enumerate(VARIANTS):
            _set(engine, graphs if with_graphs else None, overlap)
            seed = 100 * number + index
            replay = key == "graph_ms" and graphs[0] is not None
            row[key], gpu_ms, host = _time_decode(
                engine, batch, args.context, args.steps, seed, replay
            )
            if gpu_ms is not None:
                row["gpu_replay_ms"] = gpu_ms
            if key == "graph_ms":
                row["host_ms"] = host
        if args.constrained > 0:
            _set(engine, graphs, True)
            row["constrained"] = n = max(1, round(args.constrained * batch))
            row["graph_constrained_ms"], _, row["constrained_host_ms"] = _time_decode(
                engine, batch, args.context, args.steps, 100 * number + 9, False, n
            )
            row["constrained_overhead"] = row["graph_constrained_ms"] / row["graph_ms"] - 1
            print(
                f"{shape:14s} B={batch:4d}  {n} constrained: {row['graph_constrained_ms']:7.3f} ms "
                f"({100 * row['constrained_overhead']:+.1f} % over unconstrained)\n"
                f"{'':20s} host a step, unconstrained: {_host_text(row['host_ms'])}\n"
                f"{'':20s} host a step, constrained:   {_host_text(row['constrained_host_ms'])}",
                flush=True,
            )
        kv_bytes = batch * (args.context + args.steps // 2) * kv_per_token
        weights = decode_weight_bytes(model, batch)
        row["floor_ms"] = (weights + kv_bytes) / (COPY_TBPS * 1e12) * 1e3
        row["of_floor"] = row["floor_ms"] / row["graph_ms"]
        result["decode"].append(row)
        print(
            f"{shape:14s} B={batch:4d}  graph {row['graph_ms']:7.3f} ms (no overlap "
            f"{row['graph_no_overlap_ms']:.3f}, GPU alone {row.get('gpu_replay_ms', 0):.3f})  "
            f"eager {row['eager_ms']:7.3f} ms (no overlap {row['eager_no_overlap_ms']:.3f})  "
            f"floor {row['floor_ms']:6.3f} ms ({100 * row['of_floor']:4.1f} %)  "
            f"{kernels} kernels/step",
            flush=True,
        )
    _set(engine, graphs, True)
    runs = _ttft_runs_ms(engine, args.context, args.ttft_runs)
    ttft = runs[len(runs) // 2]
    quarter = len(runs) // 4
    flop_floor = 2 * active_params(model) * args.context / (BF16_TFLOPS * 1e12) * 1e3
    result["prefill"].append(
        {"shape": shape, "tokens": args.context, "ttft_ms": ttft, "ttft_runs_ms": runs,
         "flop_floor_ms": flop_floor}
    )  # fmt: skip
    print(
        f"{shape:14s} TTFT {args.context} tokens: {ttft:.2f} ms, the median of {len(runs)} runs "
        f"(middle half {runs[quarter]:.2f}-{runs[-1 - quarter]:.2f}, all {runs[0]:.2f}-{runs[-1]:.2f}; "
        f"FLOP floor {flop_floor:.2f} ms)"
    )
    if args.profile:
        result.setdefault("profile", []).append(
            _profile_shape(engine, shape, args.batches, args.context)
        )
    if args.trace:
        result.setdefault("trace", []).append(
            _trace_shape(
                engine, shape, min(args.batches), args.context, Path(args.trace), args.trace_python
            )
        )


HOST_PARTS = ("schedule", "launch", "device_wait", "mask_wait", "step_p50", "step_max")


def _host_text(host: dict[str, float]) -> str:
    return ", ".join(f"{part} {host[part]:.3f}" for part in HOST_PARTS) + " ms"


def _time_decode(
    engine: Engine,
    batch: int,
    context: int,
    steps: int,
    seed: int,
    replay: bool,
    constrained: int = 0,
) -> tuple[float, float | None, dict[str, float]]:
    """ms per steady decode step of `batch` requests, the first `constrained` of them by a
    grammar; with `replay`, also the GPU time alone; and the host's mean ms a step choosing
    tasks, launching, and (within those) blocked on the device or on grammar masks, with the
    median and longest step."""
    # Prompts finish prefill over several steps, and the first ones decode meanwhile: room for
    # that skew, so no request ends in the timed window.
    params = SamplingParams(temperature=0, max_tokens=steps + 48, ignore_eos=True)
    guided = params.model_copy(update={"guided": GuidedDecoding.from_schema(ENDLESS)})
    requests = [
        EngineRequest(f"d{seed}-{i}", p, guided if i < constrained else params)
        for i, p in enumerate(_prompts(batch, context, seed))
    ]
    stream = engine.submit(requests)
    run_until_decoding(engine)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    overlapped = engine.num_overlapped_steps
    log: list[StepRecord] = []
    engine.step_log = log
    start = time.perf_counter()
    for _ in range(steps - 4):
        engine.step()
    ms = (time.perf_counter() - start) / (steps - 4) * 1e3
    engine.step_log = None
    n = max(1, len(log))
    host = {
        "schedule": sum(r.schedule_seconds for r in log) / n * 1e3,
        "launch": sum(r.launch_seconds for r in log) / n * 1e3,
        "device_wait": sum(r.device_wait_seconds for r in log) / n * 1e3,
        "mask_wait": sum(r.mask_wait_seconds for r in log) / n * 1e3,
        # a mean over steady steps, or a few slow ones? (the engine.step() calls' wall times)
        "step_p50": sorted(r.seconds for r in log)[len(log) // 2] * 1e3 if log else 0.0,
        "step_max": max((r.seconds for r in log), default=0.0) * 1e3,
    }
    if (running := engine.stats().num_running) != batch:  # a smaller batch was timed
        raise RuntimeError(f"B={batch}: {batch - running} requests ended before the timing did")
    overlapped = engine.num_overlapped_steps - overlapped
    if engine.config.advanced.overlap and overlapped != steps - 4:  # the batch changed: not steady
        print(f"  warning: B={batch}: {overlapped} of {steps - 4} timed steps overlapped")
    gpu_ms = _replay_ms(engine, batch) if replay else None
    stream.close()
    while engine.has_work:
        engine.step()
    return ms, gpu_ms, host


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
    return float(start.elapsed_time(end)) / n


def _kernels_per_step(engine: Engine) -> int:
    """GPU kernels (copies and memsets left out) of one steady eager decode step at B=1: the
    kernels its decode graph holds. (Before 2026-12-05 the prompt graphs stayed on here, and
    a step without decode graphs ran through them, with cuBLAS's linear layers: that path's
    kernels were counted.)"""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graphs = _graphs(engine)
    _set(engine, None, False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    stream = engine.submit([EngineRequest("kernels", list(range(10, 42)), params)])
    run_until_decoding(engine)
    engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    stream.close()
    while engine.has_work:
        engine.step()
    _set(engine, graphs, True)
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(1 for n in names if not n.startswith(("Memcpy", "Memset")))


def _ttft_runs_ms(engine: Engine, context: int, runs: int) -> list[float]:
    """`runs` lone `context`-token prompts (after one warm-up), submit to first token, sorted:
    the benchmark reports their median and their spread, against which an A/B is read."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = _prompts(1, context, 1)[0]
    times = []
    for i in range(runs + 1):
        stream = engine.submit([EngineRequest(f"ttft-{i}", [p + i for p in prompt], params)])
        torch.cuda.synchronize()
        start = time.perf_counter()
        while not stream.finished:
            engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])


# Kernel name fragments -> where a step's GPU time goes (first match wins: FlashAttention's
# kernel names carry cutlass types, so attention comes before GEMM).
CATEGORIES = (
    ("attention", ("decode_split", "decode_head", "decode_combine", "prefill_kernel", "flash", "fmha",
                   "prefillwith", "vectorsparse", "mla_decode", "mla_combine")),
    ("gemm", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk")),
    ("kv store", ("store_kv",)),
    ("kv gather", ("index", "repeat_interleave", "cumsum")),
    ("norm/rope/act", ("rms_norm", "rotary", "silu")),
    ("sampling", ("argmax", "softmax", "sort", "topk", "multinomial", "exponential")),
)  # fmt: skip


def category(kernel: str) -> str:
    name = kernel.lower()
    for label, fragments in CATEGORIES:
        if any(f in name for f in fragments):
            return label
    return "copy" if name.startswith(("memcpy", "memset")) else "other"


def kernel_label(name: str) -> str:
    """A kernel's name without its namespaces, template arguments and parameters."""
    bare = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    return re.split(r"[<(]", bare)[0].split("::")[-1].strip()[:60]


def step_breakdown(engine: Engine, steps: int = 5) -> dict[str, Any]:
    """Where `steps` eager engine steps spend their time: GPU microseconds and kernels per
    category, each step's wall time, and the host time the GPU does not cover."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) / steps * 1e6
    by: dict[str, dict[str, float]] = {}
    named: dict[str, dict[str, float]] = {}  # the same, per kernel (its name up to the template)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            for table, key in ((by, category(e.name)), (named, kernel_label(e.name))):
                row = table.setdefault(key, {"us": 0.0, "kernels": 0})
                row["us"] += e.time_range.elapsed_us() / steps
                row["kernels"] += 1 / steps
    gpu_us = sum(r["us"] for r in by.values())
    top = dict(sorted(named.items(), key=lambda kv: -kv[1]["us"])[:12])
    return {
        "wall_us": wall_us,
        "gpu_us": gpu_us,
        "host_gap_us": wall_us - gpu_us,
        "by": by,
        "top_kernels": top,
    }


def _print_breakdown(label: str, b: dict[str, Any]) -> None:
    print(
        f"== {label}: {b['wall_us']:.0f} us a step eagerly, {b['gpu_us']:.0f} us of it GPU kernels"
    )
    for name, row in sorted(b["by"].items(), key=lambda kv: -kv[1]["us"]):
        share = 100 * row["us"] / max(b["gpu_us"], 1e-9)
        print(f"   {name:14s} {row['us']:9.1f} us {share:5.1f} %  {row['kernels']:6.1f} kernels")
    print("   by kernel (µs a step, launches a step, µs a launch):")
    for name, row in b["top_kernels"].items():
        each = row["us"] / max(row["kernels"], 1e-9)
        print(f"     {name:60s} {row['us']:8.1f} {row['kernels']:6.1f} {each:7.2f}")


def _profile_shape(engine: Engine, shape: str, batches: list[int], context: int) -> dict[str, Any]:
    """Eager step breakdowns: decode at the smallest and largest batch, and one lone prompt."""
    graphs = _graphs(engine)
    _set(engine, None, False)
    out: dict[str, Any] = {"shape": shape}
    for batch in sorted({min(batches), max(batches)}):
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        requests = [
            EngineRequest(f"p{batch}-{i}", p, params)
            for i, p in enumerate(_prompts(batch, context, 7 + batch))
        ]
        stream = engine.submit(requests)
        run_until_decoding(engine)
        for _ in range(3):
            engine.step()
        out[f"decode_b{batch}"] = b = step_breakdown(engine)
        _print_breakdown(f"{shape} decode B={batch}, context {context}", b)
        stream.close()
        while engine.has_work:
            engine.step()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(2):  # the first is a warm-up
        stream = engine.submit([EngineRequest(f"pp{i}", _prompts(1, context, 90 + i)[0], params)])
        b = step_breakdown(engine, steps=1)  # drains the inbox and runs the whole prompt
        while not stream.finished:
            engine.step()
    out["prompt"] = b
    _print_breakdown(f"{shape} one {context}-token prompt", b)
    _set(engine, graphs, True)
    return out


def idle_spans(kernels: list[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    """Where the GPU sat idle from `start` to `end` (µs), given its kernels' (start, end):
    before the first kernel, between kernels (in all, and the five longest gaps as (offset
    from `start`, length)) and after the last. Kernels are clipped to the span (the profiler's
    warm-up launch lies before it)."""
    inside = [(max(s, start), min(e, end)) for s, e in kernels if e > start and s < end]
    busy: list[list[float]] = []
    for s, e in sorted(inside):
        if busy and s <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], e)
        else:
            busy.append([s, e])
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)]
    return {
        "wall_us": end - start,
        "busy_us": sum(e - s for s, e in busy),
        "before_us": (busy[0][0] if busy else end) - start,
        "between_us": sum(b - a for a, b in gaps),
        "after_us": end - busy[-1][1] if busy else 0.0,
        "longest": [[a - start, b - a] for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:5]],
    }


TRACED = "kvray.traced"  # the record_function span of a traced run


def _traced(run: Callable[[], None], path: Path, python: bool = False) -> dict[str, Any]:
    """`run()` under the profiler, host and GPU: its Chrome trace to `path`, and where the GPU
    sat idle over the host's span of it. `python`: Python calls in the trace too."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=python) as prof:
        # The first launch under the profiler pays its setup (~1.8 ms on an H100): before
        # the traced span, where it would read as the run's own idle time.
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        with record_function(TRACED):
            run()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    events = prof.events()
    span = next(e.time_range for e in events if e.name == TRACED)
    return {"trace": path.name, **idle_spans(device_intervals(events), span.start, span.end)}


def device_intervals(events: Iterable[Any]) -> list[tuple[float, float]]:
    """(start, end) of the GPU's kernels and copies among profiler events, leaving out the GPU
    side of a `record_function` span, which covers every kernel inside it."""
    from torch.autograd import DeviceType

    return [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    ]


def _trace_shape(
    engine: Engine, shape: str, batch: int, context: int, out: Path, python: bool = False
) -> dict[str, Any]:
    """Traces of one lone prompt, run as `_ttft_runs_ms` runs it, and of 5 decode steps at `batch`
    (graphs and overlap on, as the default variant runs)."""
    out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    stream = engine.submit([EngineRequest("trace-prompt", _prompts(1, context, 77)[0], params)])

    def prompt() -> None:
        while not stream.finished:
            engine.step()

    traces = {"prompt": _traced(prompt, out / f"{shape}-prompt.json.gz", python)}
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    requests = [
        EngineRequest(f"trace-{i}", p, params) for i, p in enumerate(_prompts(batch, context, 78))
    ]
    stream = engine.submit(requests)
    run_until_decoding(engine)
    for _ in range(3):
        engine.step()

    def decode() -> None:
        for _ in range(5):
            engine.step()

    traces[f"decode_b{batch}"] = _traced(decode, out / f"{shape}-decode-b{batch}.json.gz", python)
    stream.close()
    while engine.has_work:
        engine.step()
    for label, row in traces.items():
        longest = ", ".join(f"{length:.0f} at {at:.0f}" for at, length in row["longest"])
        print(
            f"   {shape} {label} traced: {row['wall_us']:.0f} us, GPU busy {row['busy_us']:.0f}; "
            f"idle before the first kernel {row['before_us']:.0f}, between kernels "
            f"{row['between_us']:.0f} (longest {longest}), after the last {row['after_us']:.0f}; "
            f"{out / row['trace']}",
            flush=True,
        )
    return {"shape": shape, **traces}


# -- mixed -----------------------------------------------------------------------------------


def _mixed_shape(args: argparse.Namespace, shape: str) -> list[dict[str, Any]]:
    steps = args.mixed_steps
    batches = args.mixed_batches
    engine = make_engine(
        shape,
        max(batches) + 4,
        args.context,
        64 * steps,
        extra_tokens=4 * max(args.prompts),
        prefill_kernel=args.prefill_kernel,
    )
    runner = engine.executor.prompt_graphs
    rows: list[dict[str, Any]] = []
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=64 * steps, ignore_eos=True)
        decodes = _prompts(batch, args.context, 1000 + batch)
        requests = [EngineRequest(f"m{batch}-{i}", p, params) for i, p in enumerate(decodes)]
        stream = engine.submit(requests) if batch else None
        decode_ms = None
        if batch:
            engine.scheduler.token_budget = engine.config.token_budget
            run_until_decoding(engine)
            decode_ms = _timed_ms(engine, steps)
        for prompt in args.prompts:
            row: dict[str, Any] = {"shape": shape, "batch": batch, "prompt_tokens": prompt}
            for key, graphs in (("graphs_ms", runner), ("eager_ms", None)):
                if key == "graphs_ms" and runner is None:
                    continue  # the engine captured no prompt graphs
                engine.executor.prompt_graphs = graphs
                row[key] = _mixed_ms(
                    engine, batch, prompt, steps, seed=len(rows) * 2 + (graphs is None)
                )
            engine.executor.prompt_graphs = runner
            line = f"{shape:14s} B={batch:3d} +{prompt:5d} prompt tokens: eager {row['eager_ms']:7.2f} ms"
            if "graphs_ms" in row:
                line += f"  prompt graphs {row['graphs_ms']:7.2f} ms"
            if decode_ms is not None:
                row["decode_ms"] = decode_ms
                line += f"  (decode alone {decode_ms:6.2f} ms)"
            rows.append(row)
            print(line, flush=True)
        if stream is not None:
            stream.close()
        while engine.has_work:
            engine.step()
    return rows


def _timed_ms(engine: Engine, steps: int) -> float:
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
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    chunks = _prompts(steps + 3, prompt, 5000 + seed)
    engine.scheduler.token_budget = batch + prompt
    stream = engine.submit([EngineRequest(f"c{seed}-{i}", p, one) for i, p in enumerate(chunks)])
    ms = _timed_ms(engine, steps)
    while not stream.finished:
        engine.step()
    return ms
