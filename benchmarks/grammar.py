"""`kvray bench grammar`: what constrained decoding costs on the host, over the schema corpus
(benchmarks/schema_corpus.py), on CPU; no model runs.

For one tokenizer (the demo's by default): the one-time build of llguidance's tables of its
vocabulary; then for every schema, `--repeat` times, the check the ingress and the worker
run (no tokenizer), the compile the worker runs in its pool (the schema against the
vocabulary), and the first mask. Then one walk per schema through its grammar (a seeded
draw among the printable tokens each mask allows, up to `--walk-tokens` tokens), timing
every mask the engine would fill for it, on a copy of the compiled matcher as the engine
uses one. p50 / p99 over the corpus; `--compare-xgrammar` times xgrammar's compile of the
same schemas too (if it is installed), the figure the library was chosen by.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.common import environment, hardware_text, write_result
from benchmarks.schema_corpus import SCHEMAS
from worker.grammar import CompiledGrammar, GrammarCompiler, MaskBuilder
from worker.guided import GuidedDecoding
from worker.model.demo import resolve_model_path
from worker.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", default="demo", help="model directory, or 'demo'")
    parser.add_argument("--repeat", type=int, default=5, help="compiles timed per schema")
    parser.add_argument("--walk-tokens", type=int, default=64, help="most tokens of one walk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare-xgrammar", action="store_true", help="also time xgrammar's compile"
    )
    parser.add_argument("--result-json", help="write the figures to this file")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import llguidance

    print(f"kvray bench grammar: {hardware_text(environment())}", flush=True)
    load_before = os.getloadavg()
    tokenizer = Tokenizer.from_dir(resolve_model_path(args.tokenizer))
    vocab = tokenizer.vocab_size
    compiler = GrammarCompiler(tokenizer.hf_tokenizer, vocab, tokenizer.eos_token_ids)
    start = time.perf_counter()
    tables = compiler.tokenizer()
    tables_s = time.perf_counter() - start
    check, compile_, first = [], [], []
    compiled: dict[str, CompiledGrammar] = {}
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    for name, schema in SCHEMAS.items():
        text = GuidedDecoding.from_schema(schema).grammar_text()
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            error = llguidance.LLMatcher.validate_grammar(text)
            t1 = time.perf_counter()
            matcher = llguidance.LLMatcher(tables, text, log_level=0)
            t2 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            t3 = time.perf_counter()
            if error or matcher.is_error():
                raise SystemExit(f"{name}: {error or matcher.get_error()}")
            check.append(t1 - t0)
            compile_.append(t2 - t1)
            first.append(t3 - t2)
        compiled[name] = CompiledGrammar(matcher, compile_[-1])
    fill, build = _walk_masks(compiled, tokenizer, vocab, args.walk_tokens, args.seed)
    result: dict[str, Any] = {
        "tokenizer": args.tokenizer,
        "vocab_size": vocab,
        "schemas": len(SCHEMAS),
        "repeat": args.repeat,
        "tables_ms": 1e3 * tables_s,
        "check_ms": _stats(check),
        "compile_ms": _stats(compile_),
        "first_mask_ms": _stats(first),
        "walk_fill_ms": _stats(fill),
        "walk_build_ms": _stats(build),
        "walk_tokens": len(fill),
        "xgrammar_compile_ms": _xgrammar(tokenizer, vocab, args.repeat)
        if args.compare_xgrammar
        else None,
        "load_avg_before": list(load_before),
        "load_avg_after": list(os.getloadavg()),
    }
    _print(result)
    write_result(args.result_json, "grammar", result)
    return result


def _walk_masks(
    compiled: dict[str, CompiledGrammar], tokenizer: Tokenizer, vocab: int, most: int, seed: int
) -> tuple[list[float], list[float]]:
    """Seconds of each mask of one walk per schema, each on a copy of the compiled matcher:
    llguidance's fill alone, and MaskBuilder's (the fill again, the row index, the copy)."""
    rng = random.Random(seed)
    printable = [t for t in range(vocab) if _printable(tokenizer.decode([t]))]
    builder = MaskBuilder(vocab, 1, torch.device("cpu"))
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    fill, build = [], []
    for grammar in compiled.values():
        state = grammar.state()
        for _ in range(most):
            start = time.perf_counter()
            state.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            filled = time.perf_counter()
            mask = builder.build([state], [0], batch=1)  # fills it again, and copies it
            fill.append(filled - start)
            build.append(time.perf_counter() - filled)
            allowed = mask.apply(torch.zeros(1, vocab))[0].isfinite()
            choices = [t for t in printable if allowed[t]]
            if not choices or state.done:
                break
            state.consume([rng.choice(choices)])
    return fill, build


def _printable(text: str) -> bool:
    return bool(text) and text.isascii() and text.isprintable()


def _xgrammar(tokenizer: Tokenizer, vocab: int, repeat: int) -> dict[str, float] | str:
    try:
        import xgrammar as xgr
    except ImportError:
        return "xgrammar is not installed"
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf_tokenizer, vocab_size=vocab, stop_token_ids=sorted(tokenizer.eos_token_ids)
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    seconds = []
    for schema in SCHEMAS.values():
        for _ in range(repeat):
            start = time.perf_counter()
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            seconds.append(time.perf_counter() - start)
    return _stats(seconds)


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * s for s in seconds)
    return {
        "p50": statistics.median(ms),
        "p99": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
        "max": ms[-1],
        "mean": statistics.fmean(ms),
        "n": len(ms),
    }


def _print(r: dict[str, Any]) -> None:
    load = ", ".join(f"{x:.1f}" for x in r["load_avg_after"])
    print(f"{r['schemas']} schemas x {r['repeat']}, vocabulary {r['vocab_size']}, load {load}")
    print(f"tokenizer tables (once per engine): {r['tables_ms']:.0f} ms")
    rows = [("check (no tokenizer)", "check_ms"), ("compile", "compile_ms")]
    rows += [("first mask", "first_mask_ms"), ("a mask along a walk", "walk_fill_ms")]
    rows += [("MaskBuilder, same masks", "walk_build_ms")]
    for label, key in rows:
        s = r[key]
        print(
            f"  {label:24s} p50 {s['p50']:8.3f} ms  p99 {s['p99']:8.3f} ms  max {s['max']:8.3f} ms"
        )
    xgr = r["xgrammar_compile_ms"]
    if isinstance(xgr, dict):
        print(f"  {'xgrammar compile':24s} p50 {xgr['p50']:8.3f} ms  p99 {xgr['p99']:8.3f} ms")
    elif xgr is not None:
        print(f"  xgrammar: {xgr}")
