"""`kvray bench offline`: engine throughput on a batch of random requests, nano-vllm's method.

N requests with prompt lengths and output lengths drawn uniformly from two ranges, random
token-id prompts, `ignore_eos` so every request produces exactly its output length, all
submitted at once to `LLM(model, **engine options)`. A short warm-up run on other prompts
comes first and is not timed. Output tok/s = requested output tokens / wall seconds of
the one `generate` call.

`--compare-hf` runs transformers `generate` on the same prompts and lengths in the same
process. transformers has no continuous batching, so it gets the most favourable static
batching this script can give it: requests sorted by output length (longest first) and cut
into groups of `--hf-batch-size` (default: the engine's max_running), each group left-padded
to its longest prompt and generated greedily for the group's longest output. Only the
requested tokens count as output; the rest is HF's padding waste, reported separately.
Sorting by output length uses knowledge a real server never has, so the ratio errs in HF's
favour. With greedy decoding the script also reports how many requests produced the same
tokens in both, a check that both did the same work.

`--compare-bf16` (with `--kv-cache-dtype fp8`, greedy) runs the same workload again on an
engine with the unquantized cache (kv_cache_dtype auto: bf16 on CUDA, the dtype on CPU) and
reports both throughputs and the greedy agreement: the share of requests whose tokens are
all the same, and the mean length of the matching prefix.

`--constrained-fraction F` constrains that share of the requests (every 1/F-th, warm-up
included) by a JSON schema that never lets them end before their length
(benchmarks/schema_corpus.py: ENDLESS), beside unconstrained ones: what structured output
costs a batch. A random-weights model borrows `--tokenizer-from`'s tokenizer for it (the
demo's by default).

Runs as `kvray bench offline ...` or `python -m benchmarks.offline ...`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    BF16_TFLOPS,
    COPY_TBPS,
    copy_tokenizer,
    decode_layout,
    environment,
)
from benchmarks.schema_corpus import ENDLESS
from benchmarks.step import active_params, decode_weight_bytes
from worker.config import EngineAdvanced, EngineConfig
from worker.engine import StepRecord
from worker.guided import GuidedDecoding
from worker.kv_sizing import kv_bytes_per_token
from worker.llm import LLM
from worker.model.config import ModelConfig
from worker.model.demo import demo_model_dir, resolve_model_path
from worker.model.random_model import SHAPES, ensure_random_model
from worker.sampling import SamplingParams

WARMUP_OUTPUT_TOKENS = 16


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> Workload:
    """Uniform lengths in the closed ranges, uniform token ids in [0, vocab)."""
    g = torch.Generator().manual_seed(seed)
    in_lens = torch.randint(input_range[0], input_range[1] + 1, (n,), generator=g).tolist()
    out_lens = torch.randint(output_range[0], output_range[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in in_lens]
    return Workload(prompts, out_lens)


# -- arguments ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="HF model directory or 'demo' (the default)")
    model.add_argument(
        "--random-shape",
        choices=sorted(SHAPES),
        help="benchmark a random-weight model of this shape",
    )
    parser.add_argument(
        "--random-dtype", default="bfloat16", help="dtype of the random weights on disk"
    )
    parser.add_argument(
        "--random-dir", help="where random models are cached (default: the kvray model cache)"
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument(
        "--input-len-range", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-len-range", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--prompt-seed", type=int, default=0, help="seed of the random lengths and prompts"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (as --compare-hf); nano-vllm uses 0.6",
    )
    parser.add_argument(
        "--warmup-requests", type=int, default=4, help="untimed requests (other prompts) run first"
    )
    parser.add_argument(
        "--compare-hf",
        action="store_true",
        help="also time transformers generate on the same prompts",
    )
    parser.add_argument(
        "--compare-bf16",
        action="store_true",
        help="with --kv-cache-dtype fp8: also run the unquantized cache, report greedy agreement",
    )
    parser.add_argument(
        "--hf-batch-size",
        type=int,
        help="transformers group size (default: the engine's max_running)",
    )
    parser.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.0,
        help="share of the requests constrained by a JSON schema (0 to 1)",
    )
    parser.add_argument(
        "--tokenizer-from",
        default="demo",
        help="model dir (or 'demo') lending its tokenizer to a random model, for the grammars",
    )
    parser.add_argument("--result-json", help="write the full result to this file")
    engine = parser.add_argument_group("engine options (EngineConfig; unset = its default)")
    for name, info in _engine_fields().items():
        _add_config_option(engine, name, info.annotation, info.description or "", info.default)


def _engine_fields() -> dict[str, Any]:
    """EngineConfig's fields and its advanced ones, flat (`LLM` takes them so)."""
    top = {k: v for k, v in EngineConfig.model_fields.items() if k not in ("model", "advanced")}
    return {**top, **EngineAdvanced.model_fields}


def _add_config_option(group: Any, name: str, annotation: Any, doc: str, default: Any) -> None:
    flag, helptext = "--" + name.replace("_", "-"), f"{doc} (default: {default})"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if annotation is bool:  # --x / --no-x (`type=bool` would read "false" as True)
        group.add_argument(
            flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=helptext
        )
        return
    if typing.get_origin(annotation) is typing.Literal:
        group.add_argument(
            flag, dest=name, choices=typing.get_args(annotation), default=None, help=helptext
        )
    else:
        group.add_argument(flag, dest=name, type=annotation, default=None, help=helptext)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line."""
    return {k: getattr(args, k) for k in _engine_fields() if getattr(args, k, None) is not None}


# -- the run -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    _check_args(args)
    path = _model_path(args)
    vocab = ModelConfig.from_dir(path).vocab_size
    workload = make_workload(
        args.num_requests,
        tuple(args.input_len_range),
        tuple(args.output_len_range),
        vocab,
        args.prompt_seed,
    )
    load_before = os.getloadavg()
    llm = LLM(str(path), **engine_options(args))
    cfg = llm.engine.config
    assert cfg.max_seq_len is not None
    if args.input_len_range[1] + args.output_len_range[1] > cfg.max_seq_len:
        raise ValueError(
            f"longest prompt + output exceeds max_seq_len={cfg.max_seq_len}; pass --max-seq-len"
        )
    print(
        f"kvray bench offline: {path} ({cfg.dtype}, {cfg.device}, backend {cfg.advanced.backend}, cache {cfg.advanced.cache}, "
        f"max_running {cfg.max_running}, token_budget {cfg.token_budget})",
        flush=True,
    )
    num_pages = llm.engine.executor.cache.num_total_pages
    _warm_up(llm, args, vocab)
    costs = None
    if cfg.device.startswith("cuda"):
        model = llm.engine.executor.model
        costs = FloorCosts(
            lambda b: decode_weight_bytes(model, b),
            kv_bytes_per_token(llm.engine.model_config, cfg.kv_torch_dtype),
            active_params(model),
        )
    kvray = _bench_engine(llm, workload, args.temperature, args.constrained_fraction, costs)
    if costs is not None:
        kvray["floor"] = floor = workload_floor(workload, costs)
        floor["of_floor"] = kvray["output_tok_s"] / floor["output_tok_s"]
    outputs = kvray.pop("token_ids")
    del llm
    _release_memory()  # before transformers loads: the engine's KV cache holds most of a GPU
    unquantized = None
    if args.compare_bf16:
        unquantized = _bench_unquantized(path, args, workload, vocab)
        unquantized["agreement"] = greedy_agreement(outputs, unquantized.pop("token_ids"))
        unquantized["fp8_speedup"] = kvray["output_tok_s"] / unquantized["output_tok_s"]
        _release_memory()
    result: dict[str, Any] = {
        "benchmark": "offline",
        **environment(),
        "torch_threads": torch.get_num_threads(),
        "params": {k: v for k, v in vars(args).items() if k != "func"},
        "engine_config": {**cfg.model_dump(), "num_pages": num_pages},
        "model": _model_info(path, args),
        "workload": {
            "num_requests": args.num_requests,
            "input_len_range": list(args.input_len_range),
            "output_len_range": list(args.output_len_range),
            "input_tokens": workload.input_tokens,
            "output_tokens": workload.output_tokens,
        },
        "kvray": kvray,
        "hf": None,
        "ratio_vs_hf": None,
        "unquantized_kv": unquantized,
        "load_avg_before": list(load_before),
    }
    if args.compare_hf:
        batch = args.hf_batch_size or cfg.max_running
        hf = bench_hf(path, workload, cfg.torch_dtype, cfg.device, batch)
        hf_outputs = hf.pop("token_ids")
        if args.temperature == 0:
            hf["same_tokens_as_kvray"] = sum(
                a == b for a, b in zip(outputs, hf_outputs, strict=True)
            )
        result["hf"] = hf
        result["ratio_vs_hf"] = kvray["output_tok_s"] / hf["output_tok_s"]
    result["load_avg_after"] = list(os.getloadavg())
    _print_summary(result)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


@dataclass(frozen=True)
class FloorCosts:
    """What the floors below charge, from the model's shape: the weight bytes a step of
    `tokens` rows reads (`weight_bytes(tokens)`; MoE reads only the experts it routes to),
    the KV bytes of one token of context, and the parameters one token's forward uses."""

    weight_bytes: Callable[[int], float]
    kv_bytes_per_token: int
    params_per_token: int

    def step_seconds(self, step: StepRecord) -> float:
        """The fastest an H200 could run one recorded step, in the cost model of
        `workload_floor`: its linear layers the longer of reading the weights at the copy
        bandwidth and their FLOPs for every row (decodes and prompt tokens) at the bf16 peak,
        then its decodes' KV at the copy bandwidth (the prompts' attention left out)."""
        rows = step.num_decodes + step.num_prompt_tokens
        linear = max(self.weight_seconds(rows), self.token_seconds * rows)
        return linear + self.kv_seconds(step.decode_context_tokens)

    @property
    def token_seconds(self) -> float:
        """One token's linear-layer FLOPs at the bf16 peak."""
        return 2 * self.params_per_token / (BF16_TFLOPS * 1e12)

    def weight_seconds(self, rows: int) -> float:
        """A step of `rows` rows reading its weights at the copy bandwidth."""
        return self.weight_bytes(rows) / (COPY_TBPS * 1e12)

    def kv_seconds(self, tokens: float) -> float:
        """`tokens` tokens of KV read at the copy bandwidth."""
        return tokens * self.kv_bytes_per_token / (COPY_TBPS * 1e12)


def workload_floor(workload: Workload, costs: FloorCosts) -> dict[str, float]:
    """The fastest an H200 could run `workload` one step at a time, as the engine does, all
    requests starting together, as here: a request's prompt step gives its first token, then
    decode step k (k >= 1) carries every request with more than k output tokens; its linear
    layers take the longer of reading the weights at the copy bandwidth and their 2 x params
    FLOPs a token at the bf16 peak (at the 8B shape the latter past ~190 requests), then it
    reads each request's KV (prompt + k tokens); the prompts take 2 x params FLOPs a token at
    the peak. Prompt tokens sharing steps with decodes could go below it; this is the floor
    of steps in series.

    `overlapped_*`: the same steps if each one's memory traffic (weights and KV) and its
    FLOPs ran concurrently, a step taking the longer of the two (attention's KV reads under
    the linear layers' tensor-core time, as splitting a batch across streams could do)."""
    ins = torch.tensor([len(p) for p in workload.prompts], dtype=torch.float64)
    outs = torch.tensor(workload.output_lens)
    flop_s = costs.token_seconds
    decode_s = overlapped_s = 0.0
    for k in range(1, int(outs.max()) if len(outs) else 0):
        live = outs > k
        batch = int(live.sum())
        weights_s = costs.weight_seconds(batch)
        kv_s = costs.kv_seconds(float((ins[live] + k).sum()))
        decode_s += max(weights_s, flop_s * batch) + kv_s
        overlapped_s += max(weights_s + kv_s, flop_s * batch)
    prefill_s = flop_s * workload.input_tokens

    def tok_s(seconds: float) -> float:
        return workload.output_tokens / seconds if seconds else 0.0

    return {
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "output_tok_s": tok_s(decode_s + prefill_s),
        "overlapped_decode_s": overlapped_s,
        "overlapped_output_tok_s": tok_s(overlapped_s + prefill_s),
    }


def _check_args(args: argparse.Namespace) -> None:
    if args.compare_bf16 and (getattr(args, "kv_cache_dtype", None) != "fp8" or args.temperature):
        raise ValueError("--compare-bf16 needs --kv-cache-dtype fp8 and greedy decoding")
    if args.compare_hf and getattr(args, "load_format", None) == "random":
        raise ValueError(
            "--compare-hf needs the weights on disk: transformers cannot use --load-format random"
        )
    if not 0 <= args.constrained_fraction <= 1:
        raise ValueError("--constrained-fraction is a share, from 0 to 1")
    for name in ("input_len_range", "output_len_range"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            raise ValueError(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    if args.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")


def _model_path(args: argparse.Namespace) -> Path:
    if args.random_shape is None:
        return resolve_model_path(args.model or "demo")
    root = Path(args.random_dir) if args.random_dir else demo_model_dir().parent
    # drawing 8B numbers on the GPU takes seconds
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # that engine draws its own: config.json is enough
    weights = getattr(args, "load_format", None) != "random"
    path = ensure_random_model(
        root, args.random_shape, args.random_dtype, device=device, weights=weights
    )
    if args.constrained_fraction > 0:
        copy_tokenizer(resolve_model_path(args.tokenizer_from), path)
    return path


def _warm_up(llm: LLM, args: argparse.Namespace, vocab: int) -> None:
    """Untimed: other prompts (no prefix-cache hits for the timed run), a few short outputs."""
    if args.warmup_requests < 1:
        return
    out = (WARMUP_OUTPUT_TOKENS, WARMUP_OUTPUT_TOKENS)
    warm = make_workload(
        args.warmup_requests, tuple(args.input_len_range), out, vocab, args.prompt_seed + 1_000_003
    )
    params = _params(warm, args.temperature, args.constrained_fraction)
    llm.generate(
        warm.prompts, [p.model_copy(update={"max_tokens": WARMUP_OUTPUT_TOKENS}) for p in params]
    )


def _bench_unquantized(
    path: Path, args: argparse.Namespace, workload: Workload, vocab: int
) -> dict[str, Any]:
    """The same run (warm-up included) with kv_cache_dtype auto, everything else as given."""
    llm = LLM(str(path), **{**engine_options(args), "kv_cache_dtype": "auto"})
    print(f"unquantized KV cache: {llm.engine.executor.cache.num_total_pages} pages", flush=True)
    _warm_up(llm, args, vocab)
    result = _bench_engine(llm, workload, args.temperature, args.constrained_fraction)
    result["num_pages"] = llm.engine.executor.cache.num_total_pages
    return result


def greedy_agreement(ours: list[list[int]], ref: list[list[int]]) -> dict[str, float]:
    """How far two runs' tokens for the same requests agree: requests identical throughout,
    and the matching prefix (tokens until the first difference), mean and share of all."""
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(ours, ref, strict=True)
    ]
    same = sum(x == y for x, y in zip(ours, ref, strict=True))
    return {
        "requests": len(ref),
        "identical_requests": same,
        "identical_share": same / len(ref),
        "mean_matching_prefix": sum(prefixes) / len(ref),
        "matching_prefix_share": sum(prefixes) / max(1, sum(len(y) for y in ref)),
    }


def _params(workload: Workload, temperature: float, constrained: float) -> list[SamplingParams]:
    """Each request's parameters: request i is constrained when (i + 1) x share passes a
    whole number (every 1/share-th, spread over the workload)."""
    guided = GuidedDecoding.from_schema(ENDLESS)
    return [
        SamplingParams(
            temperature=temperature,
            max_tokens=n,
            ignore_eos=True,
            guided=guided if int((i + 1) * constrained) > int(i * constrained) else None,
        )
        for i, n in enumerate(workload.output_lens)
    ]


def _bench_engine(
    llm: LLM,
    workload: Workload,
    temperature: float,
    constrained: float = 0.0,
    costs: FloorCosts | None = None,
) -> dict[str, Any]:
    params = _params(workload, temperature, constrained)
    before = llm.engine.stats()
    _sync(llm.engine.config.device)
    steps: list[StepRecord] = []
    llm.engine.step_log = steps
    with CpuWatch() as watch:
        outputs = llm.generate(workload.prompts, params)
        _sync(llm.engine.config.device)
    llm.engine.step_log = None
    seconds = watch.seconds
    after = llm.engine.stats()
    bad = [
        o
        for o, n in zip(outputs, workload.output_lens, strict=True)
        if o.finish_reason != "length" or len(o.token_ids) != n
    ]
    if bad:
        raise RuntimeError(
            f"{len(bad)} requests did not produce their requested length (first: {bad[0].finish_reason}, {bad[0].error})"
        )
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "constrained_requests": sum(p.guided is not None for p in params),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "total_tok_s": (tokens + workload.input_tokens) / seconds,
        "steps": after.num_steps - before.num_steps,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_hit_tokens": after.prefix_hits - before.prefix_hits,
        "others_cpu_cores": watch.others_cores,
        "decode_layout": decode_layout(llm.engine),
        "step_profile": step_profile(steps, costs),
        "token_ids": [o.token_ids for o in outputs],
    }


BATCH_BANDS = (8, 32, 64, 128, 256)


def step_profile(steps: list[StepRecord], costs: FloorCosts | None = None) -> list[dict[str, Any]]:
    """Where the run's time went: steps grouped by kind (carrying prompt tokens, or decode
    only, queued early or not) and, for decode, by batch size; with `costs` (GPU runs) each
    group's floor too (`FloorCosts.step_seconds`), so the groups furthest from it show."""
    groups: dict[tuple[str, int], list[StepRecord]] = {}
    for s in steps:
        if s.num_prompt_tokens:
            key = ("prompt", 0)
        else:
            band = next((b for b in BATCH_BANDS if s.num_decodes <= b), s.num_decodes)
            key = ("decode, overlapped" if s.overlapped else "decode, not overlapped", band)
        groups.setdefault(key, []).append(s)
    rows = []
    for (kind, band), group in sorted(groups.items()):
        seconds = sum(s.seconds for s in group)
        n = len(group)
        row = {
            "kind": kind,
            "batch_up_to": band or None,
            "steps": n,
            "seconds": seconds,
            "mean_ms": 1e3 * seconds / n,
            "mean_host_ms": 1e3 * sum(s.launch_seconds + s.schedule_seconds for s in group) / n,
            "mean_decodes": sum(s.num_decodes for s in group) / n,
            "mean_prompt_tokens": sum(s.num_prompt_tokens for s in group) / n,
            "mean_decode_context": sum(s.decode_context_tokens for s in group) / n,
        }
        if costs is not None:
            floor = sum(costs.step_seconds(s) for s in group)
            row["floor_ms"] = 1e3 * floor / n
            row["of_floor"] = floor / seconds if seconds else 0.0
        rows.append(row)
    return rows


def bench_hf(
    path: Path, workload: Workload, dtype: torch.dtype, device: str, batch_size: int
) -> dict[str, Any]:
    """transformers generate, greedy, static groups sorted by output length (see the module doc)."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    order = sorted(range(len(workload.prompts)), key=lambda i: -workload.output_lens[i])
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    _hf_generate(model, [workload.prompts[0][:8]] * 2, 4, pad, device)  # warm-up, untimed
    outputs: list[list[int]] = [[] for _ in workload.prompts]
    generated = 0
    _sync(device)
    with CpuWatch() as watch:
        for group in groups:
            new = max(workload.output_lens[i] for i in group)
            rows = _hf_generate(model, [workload.prompts[i] for i in group], new, pad, device)
            generated += new * len(group)
            for i, row in zip(group, rows, strict=True):
                outputs[i] = row[: workload.output_lens[i]]
    seconds = watch.seconds
    useful = workload.output_tokens
    return {
        "transformers": transformers.__version__,
        "batch_size": batch_size,
        "num_groups": len(groups),
        "output_tokens": useful,
        "generated_tokens": generated,
        "seconds": seconds,
        "output_tok_s": useful / seconds,
        "others_cpu_cores": watch.others_cores,
        "token_ids": outputs,
    }


def _hf_generate(
    model: Any, prompts: list[list[int]], new_tokens: int, pad: int, device: str
) -> list[list[int]]:
    """One left-padded greedy batch; exactly `new_tokens` new ids per row (no EOS stopping)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )
    new = out[:, width:].tolist()
    if any(len(row) != new_tokens for row in new):
        raise RuntimeError("transformers stopped early; the comparison would be unfair")
    return new


# -- reporting ---------------------------------------------------------------------------


class CpuWatch:
    """Wall seconds of a timed section, and the CPU other processes used meanwhile.

    On a shared machine a CPU figure is only as good as its quiet: one busy neighbour on a
    2-core machine slows a 2-thread matmul several-fold. `others_cores` is the average
    number of cores that processes other than this one kept busy (from /proc/stat and
    /proc/self/stat; None where those do not exist).
    """

    def __enter__(self) -> CpuWatch:
        self._ticks = _cpu_ticks()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        end = _cpu_ticks()
        self.others_cores: float | None = None
        if self._ticks is not None and end is not None and self.seconds > 0:
            busy, mine = end[0] - self._ticks[0], end[1] - self._ticks[1]
            self.others_cores = round(
                max(0, busy - mine) / os.sysconf("SC_CLK_TCK") / self.seconds, 3
            )


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy ticks of all CPUs, ticks of this process) since boot."""
    try:
        cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        me = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = cpu[3] + cpu[4]  # idle + iowait
    return sum(cpu[:8]) - idle, int(me[11]) + int(me[12])  # user..steal; utime + stime


def _model_info(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    cfg = ModelConfig.from_dir(path)
    return {
        "path": str(path),
        "random_shape": args.random_shape,
        "architecture": cfg.architecture,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }


def _print_summary(r: dict[str, Any]) -> None:
    k, w = r["kvray"], r["workload"]
    print(
        f"requests {w['num_requests']} ({k['constrained_requests']} constrained), input tokens "
        f"{w['input_tokens']}, output tokens {k['output_tokens']}"
    )
    print(
        f"kvray:        {k['seconds']:8.2f} s  {k['output_tok_s']:10.1f} output tok/s  ({k['steps']} steps, "
        f"{k['preemptions']} preemptions, other processes used {k['others_cpu_cores']} cores)"
    )
    floor = k.get("floor")
    if floor is not None:
        print(
            f"floor (H200 copy bandwidth and bf16 peak, steps in series): decode "
            f"{floor['decode_s']:.2f} s + prompts {floor['prefill_s']:.2f} s = "
            f"{floor['output_tok_s']:.0f} output tok/s; measured {100 * floor['of_floor']:.1f} % of it"
        )
        print(
            f"  with each decode step's memory traffic under its FLOPs: decode "
            f"{floor['overlapped_decode_s']:.2f} s, {floor['overlapped_output_tok_s']:.0f} output tok/s"
        )
    floors = "  floor ms  of floor" if floor is not None else ""
    print(
        "  where the time went:  kind                    batch<=  steps  seconds  ms/step  host ms"
        f"  decodes  prompt tok{floors}"
    )
    for row in k["step_profile"]:
        floor_cols = (
            f"{row['floor_ms']:10.2f}{100 * row['of_floor']:9.1f}%" if "floor_ms" in row else ""
        )
        print(
            f"  {'':20}{row['kind']:24}{row['batch_up_to'] or '':>7}{row['steps']:7d}{row['seconds']:9.2f}"
            f"{row['mean_ms']:9.2f}{row['mean_host_ms']:9.2f}{row['mean_decodes']:9.1f}"
            f"{row['mean_prompt_tokens']:12.1f}{floor_cols}"
        )
    u = r["unquantized_kv"]
    if u is not None:
        a = u["agreement"]
        print(
            f"unquantized KV: {u['seconds']:8.2f} s  {u['output_tok_s']:10.1f} output tok/s  "
            f"({u['num_pages']} pages; fp8 {r['engine_config']['num_pages']}; fp8 / unquantized throughput {u['fp8_speedup']:.2f}x)"
        )
        print(
            f"greedy agreement fp8 vs unquantized: {a['identical_requests']}/{a['requests']} requests identical, "
            f"mean matching prefix {a['mean_matching_prefix']:.1f} tokens ({100 * a['matching_prefix_share']:.1f}% of all)"
        )
    hf = r["hf"]
    if hf is not None:
        print(
            f"transformers: {hf['seconds']:8.2f} s  {hf['output_tok_s']:10.1f} output tok/s  "
            f"(groups of {hf['batch_size']}, {hf['generated_tokens']} tokens generated, "
            f"other processes used {hf['others_cpu_cores']} cores)"
        )
        same = (
            f", same tokens in {hf['same_tokens_as_kvray']}/{w['num_requests']} requests"
            if "same_tokens_as_kvray" in hf
            else ""
        )
        print(f"ratio kvray / transformers: {r['ratio_vs_hf']:.2f}x{same}")


def _release_memory() -> None:
    gc.collect()  # the engine and its streams reference each other: refcounts alone keep them
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.offline", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
