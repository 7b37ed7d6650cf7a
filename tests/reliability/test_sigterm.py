"""SIGTERM to a running `kvray serve`: the running stream finishes, new requests get 503
(draining) while it does, and the process then exits cleanly.

This starts `kvray serve` as its own process (its own local Ray), as a user or a pod would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from cluster.local_ray import OWN_RAY_ENV, _argv, _descendants
from tests.cluster.conftest import ENGINE, free_port

READY_TIMEOUT_S = 240.0


def _start(tmp_path: Path, port: int) -> subprocess.Popen[str]:
    config = {
        "engine": ENGINE,
        "port": port,
        "advanced": {"drain_timeout_s": 120, "drain_poll_s": 0.5},
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "-c", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_ready(proc: subprocess.Popen[str], log: list[str]) -> None:
    """Read the server's output (kept in `log`) until it says it is ready."""
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if line.startswith("kvray: ready"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(READY_TIMEOUT_S):
        raise AssertionError("kvray serve did not become ready:\n" + "".join(log[-30:]))


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {key.decode(): value.decode(errors="replace") for key, value in pairs}


def _stream(base: str, result: dict[str, Any], first: threading.Event) -> None:
    body = {
        "model": "demo",
        "prompt": "Once upon a time",
        "max_tokens": 48,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    lines: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=180) as response:
        result["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
                first.set()
    result["lines"] = lines


def test_sigterm_drains_running_streams_refuses_new_ones_and_exits(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log: list[str] = []
    proc = _start(tmp_path, port)
    try:
        _wait_ready(proc, log)
        # the Ray it started runs Serve's controller with kvray's settings for its own Ray
        argvs = {pid: _argv(pid) for pid in _descendants(proc.pid)}
        controllers = [
            pid
            for pid, argv in argvs.items()
            if argv and argv[0].startswith("ray::ServeController")
        ]
        assert controllers, "no Serve controller below kvray serve"
        assert OWN_RAY_ENV.items() <= _environ(controllers[0]).items()

        result: dict[str, Any] = {}
        first = threading.Event()
        streamer = threading.Thread(target=_stream, args=(base, result, first))
        streamer.start()
        assert first.wait(120), "the stream never started"

        proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 60
        while refused is None and time.monotonic() < deadline and streamer.is_alive():
            response = httpx.post(
                f"{base}/v1/completions",
                json={"model": "demo", "prompt": "Hi", "max_tokens": 2},
                timeout=30,
            )
            if response.status_code == 503:
                refused = response
            time.sleep(0.2)

        streamer.join(180)
        assert not streamer.is_alive(), "the running stream did not finish"
        assert result["status"] == 200
        assert result["lines"][-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in result["lines"][:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        assert refused is not None, "no request was refused while the stream drained"
        assert refused.json()["error"]["code"] == "draining"
        assert "retry-after" in refused.headers

        assert proc.wait(120) == 0, "".join(log[-30:])
        assert any("draining" in line for line in log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
