"""#4's figure over several runs of `benchmarks/serve_interleaved.py`: one run of 48 prompts
on a lent VM says little (its p50 difference spanned +0.5 to +12.3 ms over session 26's five),
so the runs' requests are pooled, and the intervals redraw requests within each run
(`pooled_difference`), so that no resample leans on one VM more than the pool does.

Prints each run's p50s and the pooled ones; serve - alone between the pooled p50s (the issue's
"adds to p50 TTFT") and as the paired median, serve - beside (the requests' own way through
Serve), beside - alone (Ray and Serve standing by), each with its 95 % interval; and the
Serve path (each request's TTFT less its worker engine's own).

    python -m benchmarks.interleaved_pool RUN.json... [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import write_result
from benchmarks.stats import pooled_difference

WAYS = ("serve", "beside", "alone")
COMPARED = (("serve", "alone"), ("serve", "beside"), ("beside", "alone"))


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pooled figures of runs as `serve_interleaved` writes them."""
    ttfts = [r["ttft_per_request_ms"] for r in runs]
    engines = [r["engine_ttft_per_request_ms"]["serve"] for r in runs]
    paths = [
        c - e
        for t, es in zip(ttfts, engines, strict=True)
        for c, e in zip(t["serve"], es, strict=True)
    ]
    result: dict[str, Any] = {
        "runs": len(runs),
        "ttft_p50_ms": {w: statistics.median(v for t in ttfts for v in t[w]) for w in WAYS},
        "serve_path_p50_ms": statistics.median(paths),
        "between_p50s_ms": {},
        "paired_ms": {},
    }
    for a, b in COMPARED:
        sides = [(t[a], t[b]) for t in ttfts]
        result["between_p50s_ms"][f"{a} - {b}"] = pooled_difference(sides, paired=False)
        result["paired_ms"][f"{a} - {b}"] = pooled_difference(sides, paired=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="serve_interleaved result JSON files")
    ap.add_argument("--out", help="write the pooled figures here (JSON)")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.runs]
    runs = [json.loads(p.read_text()) for p in paths]
    print(f"{'run':60}{'serve':>8}{'beside':>8}{'alone':>8}  (TTFT p50, ms)")
    for path, run in zip(paths, runs, strict=True):
        p50 = run["ttft_p50_ms"]
        print(f"{path.stem[-59:]:60}" + "".join(f"{p50[w]:8.1f}" for w in WAYS))
    pooled = pool(runs)
    pairs = pooled["paired_ms"]["serve - alone"]["pairs"]
    print(
        f"{f'pooled ({pairs} pairs)':60}"
        + "".join(f"{pooled['ttft_p50_ms'][w]:8.1f}" for w in WAYS)
    )
    for name, title in (("between_p50s_ms", "between the p50s"), ("paired_ms", "paired median")):
        for compared, d in pooled[name].items():
            print(
                f"  {compared}, {title}: {d['median']:+.1f} ms (95 % {d['low']:+.1f} to {d['high']:+.1f})"
            )
    print(f"  the Serve path (client - worker engine), p50: {pooled['serve_path_p50_ms']:.2f} ms")
    write_result(args.out, args, **pooled, sources=[p.name for p in paths])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
