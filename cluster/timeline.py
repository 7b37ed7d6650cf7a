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
"""

from __future__ import annotations

import atexit
import os
import threading
import time

ENV = "KVRAY_TIMELINE_DIR"
_dir: str | None = os.environ.get(ENV) or None
_rows: list[str] = []
_lock = threading.Lock()
_flusher: threading.Thread | None = None
_FLUSH_S = 1.0  # replicas are killed, not exited: what is recorded reaches the file within this


def enabled() -> bool:
    return _dir is not None


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
        with open(os.path.join(directory, f"{os.getpid()}.txt"), "a") as f:
            f.writelines(rows)


def _flush_forever() -> None:
    while True:
        time.sleep(_FLUSH_S)
        flush()


def configure(directory: str | None) -> None:
    """Turn recording on into `directory`, or off (tests; processes use the variable)."""
    global _dir
    flush()
    _dir = directory


atexit.register(flush)
