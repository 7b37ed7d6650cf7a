"""Run pytest, a script or code with `worker` and `worker.attention` as bare packages.

Their __init__ files import the whole engine (pydantic, model code, ...); the kernel checks
need only worker/attention/cuda_ops.py, so on the GPU machine they can run even where the
rest of the engine's dependencies are absent.
    python scripts/device/isolated.py pytest [pytest args...]
    python scripts/device/isolated.py -c CODE
    python scripts/device/isolated.py SCRIPT [args...]
"""

from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bare_packages() -> None:
    sys.path.insert(0, str(ROOT))
    for name in ("worker", "worker.attention"):
        module = types.ModuleType(name)
        module.__path__ = [str(ROOT.joinpath(*name.split(".")))]
        sys.modules[name] = module


def main() -> None:
    _bare_packages()
    args = sys.argv[1:]
    if args and args[0] == "pytest":
        import pytest

        sys.exit(pytest.main(args[1:]))
    if args and args[0] == "-c":
        exec(compile(args[1], "<isolated -c>", "exec"), {"__name__": "__main__"})
        return
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
