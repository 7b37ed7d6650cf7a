"""Where a first token's time goes between the ingress and the engine, hop by hop: the
timeline that a Serve run records with `KVRAY_TIMELINE_DIR` set (cluster/timeline.py),
joined by request. `kvray bench serve` adds its client's times, so the HTTP front (the
client and the proxy, both ways) and the whole Serve path of each request are in it too.

    KVRAY_TIMELINE_DIR=/tmp/tl python -m cluster.cli bench serve ... --skip-engine
    python -m benchmarks.path_timeline /tmp/tl [--out FILE]

Only requests that passed every point count (streamed requests sent over submit links).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from pathlib import Path

from cluster.timeline import read_timelines, summarize


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
    if "path" in summary:
        rows += [
            ("the HTTP front (the client's TTFT less the ingress's)", summary["http_front"]),
            ("the Serve path (the client's TTFT less the engine's)", summary["path"]),
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
