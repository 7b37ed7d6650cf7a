"""What every result file records (benchmarks/common.py): kvray's own commit, wherever the
benchmark runs from."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import benchmarks
from benchmarks.common import environment, git_state, hardware_text, write_result

KVRAY_DIR = Path(benchmarks.__file__).resolve().parent


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_the_commit_is_kvrays_even_when_run_inside_another_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        kvray = _git(KVRAY_DIR, "rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("kvray is not a git checkout here")
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    _git(
        other,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "x",
    )
    monkeypatch.chdir(other)
    assert environment()["git_commit"] == kvray != _git(other, "rev-parse", "HEAD")


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path: Path) -> None:
    assert git_state(tmp_path) == {"git_commit": "unknown", "git_dirty": None}


def test_a_result_file_starts_with_date_hardware_and_commit(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.json"
    write_result(path, "step", {"rows": [1]})
    saved = json.loads(path.read_text())
    assert saved["benchmark"] == "step" and saved["rows"] == [1]
    assert saved["date"][:4].isdigit() and saved["git_commit"]
    assert saved["hardware"]["cpu_count"] >= 1
    write_result(None, "step", {})  # no path: nothing written, no error
    env = {"hardware": {"cpu": "Xeon", "cpu_count": 32, "usable_cores": 32, "gpus": ["H200"] * 2}}
    assert hardware_text(env) == "H200 x2, Xeon (32 cores)"
