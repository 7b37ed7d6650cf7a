"""Timestamps of each request at the hops of its Serve path, for finding where the time
between a client and its engine goes (benchmarks/path_timeline.py reads them).

Off unless `KVRAY_TIMELINE_DIR` names a directory when the process imports this: then every
kvray process (ingress replicas, worker replicas) appends `request_id point seconds`
lines to a file of its own there. The seconds are `time.perf_counter()`, the machine's
monotonic clock on Linux, so the processes of one machine compare; across machines they do
not. A local Ray's replicas inherit the variable from the `kvray serve` or `kvray bench
serve` that starts it.

The points, in the order a first token passes them:

- `arrived`: the ingress's handler has the HTTP request;
- `dispatched`: parsed, tokenized and handed to the dispatcher;
- `routed`: its batch leaves the window for the router;
- `sent`: its submit is about to be written on the submit link to the chosen worker;
- `received`: the worker has read that submit;
- `queued`: the engine has it (the engine's own TTFT counts from here);
- `first_written`: the worker wrote the frame with its first token;
- `first_read`: the ingress read that frame;
- `first_sent`: the ingress handed the first token's SSE chunk to the HTTP server.

The ingress also records `engine_ttft`, the engine's own time to first token, and
`engine_queue`, its wait in the engine before its first step was scheduled (durations, not
times: `queued + engine_ttft` is when the engine published the token).

A request id is `{response id}-{prompt}-{choice}` (cluster/api.py), so a client that kept
its own times by response id (`kvray bench serve`) adds them as `client_sent` and
`client_first` (`summarize`): then each request's whole Serve path is its client's TTFT
less its engine's, both durations on one clock each.
"""

from __future__ import annotations

import atexit
import logging
import os
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV = "KVRAY_TIMELINE_DIR"
_dir: str | None = os.environ.get(ENV) or None
_rows: list[str] = []
_lock = threading.Lock()
_flusher: threading.Thread | None = None
FLUSH_S = 1.0  # replicas are killed, not exited: what is recorded reaches the file within this


def enabled() -> bool:
    return _dir is not None


def recording_dir() -> str | None:
    """Where this process records (None: off)."""
    return _dir


def mark(request_id: str, point: str, seconds: float | None = None) -> None:
    """Record that `request_id` passed `point` now (or at `seconds`); nothing when off."""
    if _dir is None:
        return
    global _flusher
    at = time.perf_counter() if seconds is None else seconds
    with _lock:
        _rows.append(f"{request_id} {point} {at:.6f}\n")
        if _flusher is None:
            _flusher = threading.Thread(target=_flush_forever, name="kvray-timeline", daemon=True)
            _flusher.start()


def flush() -> None:
    """Append what is recorded to this process's file (also at exit)."""
    directory = _dir
    with _lock:
        rows = list(_rows)
        _rows.clear()
    if rows and directory is not None:
        os.makedirs(directory, exist_ok=True)  # the variable may name one no one made yet
        with open(os.path.join(directory, f"{os.getpid()}.txt"), "a") as f:
            f.writelines(rows)


def _flush_forever() -> None:
    """Flush every FLUSH_S; a directory that cannot be written loses those rows, not the
    flusher (the rows would otherwise pile up in memory for the process's life)."""
    while True:
        time.sleep(FLUSH_S)
        try:
            flush()
        except OSError as exc:
            log.warning("timeline rows lost: %s", exc)


def configure(directory: str | None) -> None:
    """Turn recording on into `directory`, or off (tests; processes use the variable)."""
    global _dir
    flush()
    _dir = directory


def enable(directory: str) -> None:
    """Record into `directory` here and in every process started from here from now on (a
    local Ray's replicas: `kvray bench serve`)."""
    os.environ[ENV] = directory
    configure(directory)


def disable() -> None:
    """Stop recording here and in processes started from here from now on."""
    os.environ.pop(ENV, None)
    configure(None)


atexit.register(flush)


# -- reading a run's timeline ----------------------------------------------------------------

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
# the client's side, where the client wrote its times (`write_client`)
CLIENT_HOPS = (
    ("client_sent", "arrived", "HTTP front: client and proxy to the ingress"),
    ("first_sent", "client_first", "HTTP front: proxy and client, back"),
)


def read_timelines(directory: str | Path) -> dict[str, dict[str, float]]:
    """Every request's points, from the files of every process that recorded some."""
    timelines: dict[str, dict[str, float]] = defaultdict(dict)
    for path in sorted(Path(directory).glob("*.txt")):
        for line in path.read_text().splitlines():
            request_id, point, seconds = line.split(" ")
            timelines[request_id][point] = float(seconds)
    for points in timelines.values():
        if "queued" in points and "engine_ttft" in points:
            points["published"] = points["queued"] + points["engine_ttft"]
        if "queued" in points and "engine_queue" in points:
            points["scheduled"] = points["queued"] + points["engine_queue"]
    return dict(timelines)


def write_client(directory: str | Path, times: list[tuple[str, float, float]]) -> None:
    """A client's (request id, sent, first token) times, its `time.perf_counter()`, into the
    run's directory beside the processes' files."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / "client.txt", "a") as f:
        f.writelines(
            f"{rid} client_sent {sent:.6f}\n{rid} client_first {first:.6f}\n"
            for rid, sent, first in times
        )


def _stats(values: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * v for v in values)
    return {
        "mean": statistics.fmean(ms),
        "p50": statistics.median(ms),
        "p90": ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))],
    }


def summarize(timelines: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Mean, p50 and p90 (ms) of each hop over the requests that passed every point.

    Where a client added its times, only its requests count, and the summary also has
    `path`: per request, the client's TTFT less the engine's, what Serve added to it."""
    clients = any("client_sent" in t for t in timelines.values())
    hops = HOPS + CLIENT_HOPS if clients else HOPS
    names = {p for hop in hops for p in hop[:2]}
    complete = [t for t in timelines.values() if names <= t.keys()]
    out: dict[str, Any] = {"requests": len(timelines), "complete": len(complete), "hops": []}
    if not complete:
        return out
    for start, end, what in hops:
        out["hops"].append(
            {
                "from": start,
                "to": end,
                "what": what,
                **_stats([t[end] - t[start] for t in complete]),
            }
        )
    out["to_engine"] = _stats([t["queued"] - t["arrived"] for t in complete])
    out["from_engine"] = _stats([t["first_sent"] - t["published"] for t in complete])
    out["ingress_path"] = _stats(
        [t["queued"] - t["arrived"] + t["first_sent"] - t["published"] for t in complete]
    )
    if clients:
        out["http_front"] = _stats(
            [
                t["arrived"] - t["client_sent"] + t["client_first"] - t["first_sent"]
                for t in complete
            ]
        )
        out["path"] = _stats(
            [t["client_first"] - t["client_sent"] - t["engine_ttft"] for t in complete]
        )
    if all("scheduled" in t for t in complete):  # the engine's queue, from the worker's metrics
        out["engine_queue"] = _stats([t["scheduled"] - t["queued"] for t in complete])
    return out
