"""What every benchmark's result file records: when, on which hardware, at which commit of
kvray; and writing it."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from worker.cores import usable_cores

# H200 floors every GPU figure is reported against: device-to-device copy bandwidth as
# measured on the lent H200, and the dense bf16 tensor-core peak.
COPY_TBPS = 4.19
BF16_TFLOPS = 790.0


def git_state(directory: Path = Path(__file__).resolve().parent) -> dict[str, Any]:
    """The commit of the git checkout that holds `directory` (default: this file's, so kvray's
    own checkout, wherever the benchmark runs from), whether its tracked files had changes,
    and the git tree of the files as they were (tracked and untracked, less the ignored):
    `git rev-parse C^{tree}` names the same tree exactly when the run's files were commit C's,
    which a copy of a working tree on another machine (its base commit, dirty) cannot say
    otherwise. "unknown" / None where it is not a git checkout (an installed wheel)."""

    def git(*cmd: str, env: dict[str, str] | None = None) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(directory), *cmd],
                capture_output=True,
                text=True,
                timeout=20,
                env=env,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    tree = None
    if commit:
        with (
            tempfile.TemporaryDirectory() as tmp
        ):  # a scratch index: the checkout's own is untouched
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
            top = git("rev-parse", "--show-toplevel")
            if top and git("-C", top, "add", "-A", env=env) is not None:
                tree = git("write-tree", env=env)
    return {
        "git_commit": commit or "unknown",
        "git_dirty": bool(status) if status is not None else None,
        "git_tree": tree,
    }


def cpu_model() -> str:
    """/proc/cpuinfo's model name, with family/model numbers (VMs often show a generic name)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine() or "unknown"
    name = fields.get("model name", "unknown")
    return f"{name} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def gpus() -> list[str]:
    """The CUDA devices torch sees, by name ([] without torch or CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def hardware_text(env: dict[str, Any]) -> str:
    """One line: "NVIDIA H200 x2, Intel Xeon ... (32 cores)"."""
    hw = env["hardware"]
    cores = f"{hw['cpu_count']} cores" + (
        f", {hw['usable_cores']} usable" if hw["usable_cores"] != hw["cpu_count"] else ""
    )
    names = sorted(set(hw["gpus"]))
    gpu = ", ".join(f"{n} x{hw['gpus'].count(n)}" for n in names)
    return f"{gpu + ', ' if gpu else ''}{hw['cpu']} ({cores})"


def environment() -> dict[str, Any]:
    """Date, hardware, versions and kvray's commit: the head of every result file."""
    torch = sys.modules.get("torch")
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "hardware": {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "usable_cores": usable_cores(),
            "gpus": gpus(),
        },
        "python": platform.python_version(),
        "torch": getattr(torch, "__version__", None),
        **git_state(),
    }


def write_result(path: str | Path | None, benchmark: str, data: dict[str, Any]) -> None:
    """`data` under the environment's head as JSON at `path` (nothing when None)."""
    if path is None:
        return
    result = {"benchmark": benchmark, **environment(), **data}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


# generation_config.json too: its EOS ids, not the random shape's config.json ones, are
# the borrowed tokenizer's
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def decode_layout(engine: Any) -> dict[str, Any] | None:
    """The decode layout an engine measured at start (worker/attention/decode_layout.py), for
    a result file: an A/B across trees or GPUs may differ by it."""
    choice = getattr(engine.executor, "decode_layout", None)
    return dataclasses.asdict(choice) if choice is not None else None


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Give a random-weights model directory (which has none) the tokenizer of `src`, for
    what needs one (grammars, an ingress); ids beyond the borrowed vocabulary are never
    allowed by a grammar, and decode to nothing."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())
