"""Benchmarks that print figures (with date and hardware); raw JSON goes to results/."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from typing import Any

from cluster.config import cores_text


def write_result(path: str | None, args: argparse.Namespace, **fields: Any) -> None:
    """A benchmark's result as JSON at `path` (nothing when None): when, on what, with which
    arguments, and `fields`."""
    if path is None:
        return
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {cores_text()}",
        "args": vars(args),
        **fields,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
