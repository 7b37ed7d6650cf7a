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
    assert git_state(tmp_path) == {"git_commit": "unknown", "git_dirty": None, "git_tree": None}


def test_the_tree_names_the_files_as_they_were(tmp_path: Path) -> None:
    """A dirty checkout's tree is the commit's that holds the same files, new ones included,
    ignored ones not; the checkout's own index stays as it was."""
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "a.py").write_text("1\n")
    commit = ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x"]
    _git(repo, "add", "-A")
    _git(repo, *commit)
    clean = git_state(repo / "sub")
    assert clean["git_tree"] == _git(repo, "rev-parse", "HEAD^{tree}") and not clean["git_dirty"]
    (repo / "a.py").write_text("2\n")
    (repo / "sub" / "new.py").write_text("3\n")
    (repo / "run.log").write_text("ignored\n")
    dirty = git_state(repo)
    assert dirty["git_dirty"] and dirty["git_tree"] != clean["git_tree"]
    assert _git(repo, "status", "--porcelain") == "M a.py\n?? sub/"  # index untouched
    _git(repo, "add", "-A")
    _git(repo, *commit)
    assert dirty["git_tree"] == _git(repo, "rev-parse", "HEAD^{tree}")


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
