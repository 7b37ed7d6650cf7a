"""What `pip install .` ships: every package, the kernels' sources, and a light worker/__init__."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from worker.attention.cuda_ops import KernelBuildError, find_csrc

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_names_every_package_of_the_tree_and_the_kernel_sources():
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("worker", "cluster", "benchmarks")
        for p in (ROOT / top).rglob("__init__.py")
    }
    config = _setuptools()
    assert set(config["packages"]) == found | {"worker._csrc"}
    assert config["package-dir"] == {"worker._csrc": "csrc"}
    patterns = config["package-data"]["worker._csrc"]
    shipped = {p.name for pattern in patterns for p in (ROOT / "csrc").glob(pattern)}
    assert shipped == {p.name for p in (ROOT / "csrc").iterdir() if p.is_file()}


def _fake_sources(at: Path) -> Path:
    at.mkdir(parents=True)
    for p in (ROOT / "csrc").iterdir():
        (at / p.name).write_text("")
    return at


def test_kernel_sources_are_found_in_a_checkout_and_in_an_installed_wheel(tmp_path):
    assert find_csrc() == ROOT / "csrc"
    installed = _fake_sources(tmp_path / "site-packages" / "worker" / "_csrc")
    assert find_csrc(installed.parent) == installed
    checkout = _fake_sources(tmp_path / "repo" / "csrc")
    (tmp_path / "repo" / "worker").mkdir()
    assert find_csrc(tmp_path / "repo" / "worker") == checkout
    with pytest.raises(KernelBuildError, match="kernel sources"):
        find_csrc(tmp_path / "nowhere" / "worker")


def test_importing_the_tokenizer_loads_neither_the_engine_nor_torch():
    code = (
        "import sys, worker.tokenizer\n"
        "heavy = [m for m in ('torch', 'worker.engine', 'worker.config') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == ""


def test_the_public_names_still_import_from_worker():
    import worker

    assert worker.LLM.__name__ == "LLM" and worker.SamplingParams.__name__ == "SamplingParams"
    assert {"LLM", "EngineConfig", "RequestOutput", "SamplingParams"} <= set(dir(worker))
    with pytest.raises(AttributeError):
        _ = worker.Engine


@pytest.mark.slow
def test_a_plain_wheel_ships_the_kernel_sources(tmp_path):
    """`pip install .` builds a wheel like this one (no editable install to fall back on)."""
    import shutil
    import zipfile

    src = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the tree
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".*", "tests", "results", "docs", "k8s", "*.pyc"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("kvray-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"worker/_csrc/{p.name}" for p in (ROOT / "csrc").iterdir()} <= names
    assert {"worker/__init__.py", "worker/attention/cuda_ops.py", "cluster/__init__.py"} <= names
