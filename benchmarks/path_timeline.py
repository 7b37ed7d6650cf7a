"""Where a first token's time goes between the ingress and the engine, hop by hop: the
timeline that a Serve run records with `KVRAY_TIMELINE_DIR` set (cluster/timeline.py),
joined by request. What it leaves out is the HTTP front (the client and the proxy, both
ways), which `kvray bench serve` prints as its client's TTFT less the ingress's.

    KVRAY_TIMELINE_DIR=/tmp/tl python -m cluster.cli bench serve ... --skip-engine
    python -m benchmarks.path_timeline /tmp/tl [--out FILE]

Only requests that passed every point count (streamed requests sent over submit links).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

# (from, to, what happens in between); "published" is the engine's first token: queued +
# the engine's own TTFT
HOPS = (
    ("arrived", "dispatched", "ingress: parse, validate, tokenize"),
    ("dispatched", "routed", "ingress: batch window"),
    ("routed", "sent", "ingress: router's choice"),
    ("sent", "received", "submit written, read by the worker"),
    ("received", "queued", "worker: decode, Engine.submit"),
    ("queued", "published", "engine: queue and prompt step (its TTFT)"),
    ("published", "first_written", "worker: engine thread to the frame written"),
    ("first_written", "first_read", "frame socket to the ingress"),
    ("first_read", "first_sent", "ingress: deliver, detokenize, SSE chunk out"),
)


def read_timelines(directory: Path) -> dict[str, dict[str, float]]:
    """Every request's points, from the files of every process that recorded some."""
    timelines: dict[str, dict[str, float]] = defaultdict(dict)
    for path in sorted(directory.glob("*.txt")):
        for line in path.read_text().splitlines():
            request_id, point, seconds = line.split(" ")
            timelines[request_id][point] = float(seconds)
    for points in timelines.values():
        if "queued" in points and "engine_ttft" in points:
            points["published"] = points["queued"] + points["engine_ttft"]
        if "queued" in points and "engine_queue" in points:
            points["scheduled"] = points["queued"] + points["engine_queue"]
    return dict(timelines)


def summarize(timelines: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Mean, p50 and p90 (ms) of each hop over the requests that passed every point."""
    names = {p for hop in HOPS for p in hop[:2]}
    complete = [t for t in timelines.values() if names <= t.keys()]

    def stats(values: list[float]) -> dict[str, float]:
        ms = sorted(1e3 * v for v in values)
        return {
            "mean": statistics.fmean(ms),
            "p50": statistics.median(ms),
            "p90": ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))],
        }

    out: dict[str, Any] = {"requests": len(timelines), "complete": len(complete), "hops": []}
    if not complete:
        return out
    for start, end, what in HOPS:
        out["hops"].append({"from": start, "to": end, "what": what, **stats([t[end] - t[start] for t in complete])})
    out["to_engine"] = stats([t["queued"] - t["arrived"] for t in complete])
    out["from_engine"] = stats([t["first_sent"] - t["published"] for t in complete])
    out["ingress_path"] = stats([t["queued"] - t["arrived"] + t["first_sent"] - t["published"] for t in complete])
    if all("scheduled" in t for t in complete):  # the engine's queue, from the worker's metrics
        out["engine_queue"] = stats([t["scheduled"] - t["queued"] for t in complete])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path, help="the KVRAY_TIMELINE_DIR of the run")
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)
    summary = summarize(read_timelines(args.directory))
    print(f"{summary['complete']} of {summary['requests']} requests passed every point")
    if not summary["complete"]:
        return 1
    print(f"{'hop':58}{'mean':>9}{'p50':>9}{'p90':>9}  (ms)")
    rows = [(f"{h['from']} -> {h['to']}: {h['what']}", h) for h in summary["hops"]]
    rows += [
        ("arrived -> queued: the way to the engine", summary["to_engine"]),
        ("published -> first_sent: the way back", summary["from_engine"]),
        ("both ways (the ingress's TTFT less the engine's)", summary["ingress_path"]),
    ]
    if "engine_queue" in summary:
        rows.append(("queued -> scheduled: the engine's queue", summary["engine_queue"]))
    for title, s in rows:
        print(f"{title[:57]:58}{s['mean']:9.3f}{s['p50']:9.3f}{s['p90']:9.3f}")
    if args.out:
        summary["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        summary["machine"] = platform.processor() or platform.machine()
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
