"""Where the inter-token latency tail comes from (#8): the in-process engine on serve_cluster's
latency load (Poisson arrivals, prompts around 512 tokens, 128 output tokens), once per
variant, with every step's time recorded.

A variant is a comma-separated list of `key=value`: EngineConfig fields (`prefill_slowdown=1.8`,
`prompt_graph_tokens=0`, ...) and `switch_ms`, the interpreter's GIL switch interval in ms
(`sys.setswitchinterval`; Python's default is 5). Each prints ITL p50 / p99, TTFT, and its
steps: decode-only vs carrying prompt tokens, and how many took over twice the decode-only
median; an ITL p99 over 2x p50 needs about 1 % of the gaps there.

    python -m benchmarks.itl_tail --shape llama3-8b --tokenizer-from /tmp/kvray-tok \\
        --variants "default;switch_ms=0.5;prefill_slowdown=1.8" --out itl-tail.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

import torch

from benchmarks.serve import _engine_run
from benchmarks.stats import make_arrivals, make_samples
from worker.config import EngineConfig
from worker.model.random_model import get_shape, write_random_model
from worker.tokenizer import Tokenizer


def parse_variant(text: str) -> tuple[dict[str, Any], float | None]:
    """`"prefill_slowdown=1.8,switch_ms=0.5"` -> ({"prefill_slowdown": 1.8}, 0.5)."""
    fields: dict[str, Any] = {}
    switch_ms = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item == "default":
            continue
        key, _, value = item.partition("=")
        if key == "switch_ms":
            switch_ms = float(value)
        else:
            fields[key] = json.loads(value)
    return fields, switch_ms


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(tempfile.mkdtemp(prefix=f"kvray-{args.shape}-"))
    write_random_model(model_dir, args.shape, weights=False)
    if args.tokenizer_from:  # the engine detokenizes as a worker replica's does
        for src in Path(args.tokenizer_from).iterdir():
            if src.name.startswith(("tokenizer", "chat_template")):
                (model_dir / src.name).write_bytes(src.read_bytes())
    vocab = (
        Tokenizer.from_dir(model_dir).vocab_size
        if args.tokenizer_from
        else get_shape(args.shape).vocab_size
    )
    samples = make_samples(args.prompts, args.input_len, args.output_len, 0.5, 0, vocab, args.seed)
    arrivals = make_arrivals(args.prompts, args.rate, 1.0, args.seed)
    results: dict[str, Any] = {
        "date": date.today().isoformat(), "host": platform.node(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "shape": args.shape, "load": vars(args), "variants": {},
    }  # fmt: skip
    default_switch = sys.getswitchinterval()
    for variant in args.variants.split(";"):
        fields, switch_ms = parse_variant(variant)
        config = EngineConfig(
            model=str(model_dir), load_format="random", max_running=256, max_waiting=4096, **fields
        )
        sys.setswitchinterval(default_switch if switch_ms is None else switch_ms / 1e3)
        try:
            summary = asyncio.run(
                _engine_run(config, samples, arrivals, args.concurrency, step_log=True)
            )
        finally:
            sys.setswitchinterval(default_switch)
            gc.collect()
            torch.cuda.empty_cache()
        results["variants"][variant] = summary
        _show(variant, summary)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return results


def _show(variant: str, s: dict[str, Any]) -> None:
    itl, ttft, steps = s["itl_ms"], s["ttft_ms"], s["steps"]
    print(
        f"{variant:40} ITL p50 {itl['p50']:6.2f} p99 {itl['p99']:6.2f} ms ({itl['p99'] / itl['p50']:.2f}x)  "
        f"TTFT p50 {ttft['p50']:7.2f} p99 {ttft['p99']:7.2f} ms  {s['output_throughput']:7.1f} tok/s",
        flush=True,
    )
    rows = {"decode only": steps["decode_only"], "with prompt": steps["with_prompt"]}
    rows |= {f"  prompt tokens {k}": v for k, v in steps["with_prompt_by_tokens"].items()}
    for name, k in rows.items():
        print(
            f"    {name:26} {k['steps']:5} steps  p50 {k['p50']:6.2f} p99 {k['p99']:6.2f} ms  "
            f"over 2x decode p50: {k['over_2x_decode_p50']}  launch p50 {k['launch_ms']['p50']:.2f} ms, schedule p50 {k['schedule_ms']['p50']:.2f} ms",
            flush=True,
        )
    print(f"    slow decode-only steps: {steps['slow_decode_only']}", flush=True)
    if "pacer" in s:
        print(f"    pacer: {s['pacer']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shape", default="llama3-8b", help="model shape, random bf16 weights drawn on the device"
    )
    p.add_argument(
        "--tokenizer-from", help="a directory with tokenizer.json (the demo's, for the 8B shape)"
    )
    p.add_argument("--variants", default="default", help="';'-separated variants (see above)")
    p.add_argument("--prompts", type=int, default=160)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    run(p.parse_args())


if __name__ == "__main__":
    main()
