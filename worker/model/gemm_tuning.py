"""Which algorithm each decode-batch GEMM that cuBLAS runs should use, picked by timing.

cuBLAS picks a GEMM's algorithm from a heuristic, and at some batch sizes its pick is slower
than at larger ones (`kvray bench kernels --only gemm`). Before the decode graphs are
captured, the engine runs one forward at every graph batch size while `GemmTuner` notes
the linear layers that went to cuBLAS, then times each of those shapes over the weights of
every layer that has it, once with torch's default and once with each of cuBLASLt's first
heuristic candidates (each timed as a replayed CUDA graph, so host overhead does not count),
and keeps the fastest when it beats the default by `MIN_GAIN`. Afterwards CudaOps runs a
shape through the kept candidate (`algo`). Choices are kept for the process and in a file per
GPU model and library version, so a restarted engine makes the same choice (and the same
bits) without timing again. KVRAY_GEMM_TUNING=0 turns it off, for measuring.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("kvray.gemm_tuning")

Key = tuple[str, int, int, int, int, bool]  # dtype, M, N, K, x's row stride, bias
DEFAULT = -1  # torch's F.linear: cuBLAS's own pick
MAX_CANDIDATES = 16
MIN_GAIN = 0.03  # a candidate replaces the default only this much faster (timing noise)
WORKSPACE_BYTES = 32 << 20  # what cuBLASLt's Hopper kernels ask for at most
ALIGN = 256  # pointers every tuned call has (plans depend on alignment)
_MAX_WEIGHTS = 32  # a shape is timed over at most this many layers' weights


def enabled() -> bool:
    return os.environ.get("KVRAY_GEMM_TUNING") != "0"


def key_of(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Key:
    return (str(x.dtype), x.shape[0], weight.shape[0], x.shape[1], x.stride(0), bias is not None)


def _default_path() -> Path:
    from worker.attention import cuda_ops

    name = torch.cuda.get_device_name().replace(" ", "-")
    tag = f"{name}-torch{torch.__version__}-cuda{torch.version.cuda}".replace("/", "_")
    return cuda_ops.DEFAULT_CACHE_DIR / f"gemm-tuning-{tag}.json"


_shared: GemmTuner | None = None


def shared(kernels: ModuleType) -> GemmTuner:
    """The process's tuner over csrc's kernels: every engine in a process makes the same
    choices, so two of them give the same bits."""
    global _shared
    if _shared is None:
        _shared = GemmTuner(kernels)
    return _shared


class GemmTuner:
    """The choice table of one process's GEMM shapes (see the module docstring)."""

    def __init__(self, kernels: ModuleType, path: Path | None = None) -> None:
        self._k = kernels
        self._path = path
        self._loaded = False
        self.choices: dict[Key, int] = {}
        self.max_rows = 0  # the largest M with a choice: larger calls skip the lookup
        self._recorded: dict[Key, dict[int, tuple[torch.Tensor, torch.Tensor | None]]] | None = None
        self._workspace: torch.Tensor | None = None

    # -- lookups, on every linear layer that cuBLAS would run -------------------------------

    def algo(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
        """The candidate this call runs (DEFAULT: torch's own path); notes the call while
        recording."""
        if self._recorded is not None:
            self._note(x, weight, bias)
            return DEFAULT
        if x.shape[0] > self.max_rows or self._workspace is None:
            return DEFAULT
        algo = self.choices.get(key_of(x, weight, bias), DEFAULT)
        if algo != DEFAULT and not self._aligned(x, weight, bias):
            return DEFAULT
        return algo

    def run(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, algo: int
    ) -> torch.Tensor:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        if out.data_ptr() % ALIGN:  # never from torch's allocator; plans depend on it
            return F.linear(x, weight, bias)
        self._k.lt_gemm(x, weight, bias, out, self.workspace(x.device), algo)
        return out

    def workspace(self, device: torch.device) -> torch.Tensor:
        """cuBLASLt's scratch, one for every call: a step's GEMMs run one after another on
        one stream."""
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    @staticmethod
    def _aligned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return all(
            t.data_ptr() % ALIGN == 0 for t in (x, weight) + ((bias,) if bias is not None else ())
        )

    # -- tuning -------------------------------------------------------------------------------

    @contextmanager
    def recording(self) -> Iterator[dict[Key, dict[int, Any]]]:
        """Inside, every linear layer that asks `algo` runs torch's default and is noted in
        the dict yielded (for `tune`)."""
        recorded: dict[Key, dict[int, Any]] = {}
        self._recorded = recorded
        try:
            yield recorded
        finally:
            self._recorded = None

    def _note(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert self._recorded is not None
        if x.dtype not in (torch.bfloat16, torch.float16) or not self._aligned(x, weight, bias):
            return
        weights = self._recorded.setdefault(key_of(x, weight, bias), {})
        if len(weights) < _MAX_WEIGHTS:
            weights[weight.data_ptr()] = (weight, bias)

    def tune(self, recorded: list[dict[Key, dict[int, Any]]]) -> None:
        """Time and choose every recorded shape that has no choice yet (in the table or the
        file), then save the file."""
        self._load()
        shapes: dict[Key, dict[int, Any]] = {}
        for rec in recorded:
            for key, weights in rec.items():
                shapes.setdefault(key, {}).update(weights)
        for weights in shapes.values():  # allocated here, never inside a graph's capture
            weight = next(iter(weights.values()))[0]
            self.workspace(weight.device)
            break
        new = {k: v for k, v in shapes.items() if k not in self.choices}
        start = time.perf_counter()
        for key, weights in new.items():
            self.choices[key] = self._choose(key, list(weights.values()))
        self.max_rows = max((k[1] for k, a in self.choices.items() if a != DEFAULT), default=0)
        if new:
            picked = sum(self.choices[k] != DEFAULT for k in new)
            log.info(
                "GEMM tuning: %d shapes timed in %.1fs, %d run a cuBLASLt candidate",
                len(new), time.perf_counter() - start, picked,
            )  # fmt: skip
            self._save()

    def _choose(self, key: Key, weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> int:
        _, m, n, k, stride, _ = key
        w0, b0 = weights[0]
        x = torch.randn(m, stride, dtype=w0.dtype, device=w0.device)[:, :k]
        out = torch.empty(m, n, dtype=w0.dtype, device=w0.device)
        ws = self.workspace(w0.device)
        count = self._k.lt_gemm_algos(x, w0, b0, out, ws, MAX_CANDIDATES)
        default_us = _graph_us(self._candidate(DEFAULT, x, out, ws), weights)
        best, best_us = DEFAULT, default_us
        for algo in range(count):
            try:
                us = _graph_us(self._candidate(algo, x, out, ws), weights)
            except RuntimeError:  # a candidate the library then refuses: not a choice
                continue
            if us < best_us:
                best, best_us = algo, us
        if best_us > default_us * (1 - MIN_GAIN):
            best = DEFAULT
        log.debug("GEMM %s: default %.1f us, choice %d %.1f us", key, default_us, best, best_us)
        return best

    def _candidate(
        self, algo: int, x: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor | None], Any]:
        """The call `algo` makes of one layer's (weight, bias)."""
        if algo == DEFAULT:
            return lambda w, b: F.linear(x, w, b)
        return lambda w, b: self._k.lt_gemm(x, w, b, out, workspace, algo)

    # -- the file -----------------------------------------------------------------------------

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        path = self._path or _default_path()
        self._path = path
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        for row in stored.get("choices", []):
            self.choices.setdefault(tuple(row["key"]), int(row["algo"]))  # type: ignore[arg-type]

    def _save(self) -> None:
        assert self._path is not None
        rows = [{"key": list(k), "algo": a} for k, a in sorted(self.choices.items())]
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self._path.parent, delete=False) as f:
                json.dump({"choices": rows}, f)
            os.replace(f.name, self._path)
        except OSError as exc:  # a read-only cache: the choices still hold for this process
            log.warning("GEMM tuning: could not save %s: %s", self._path, exc)


def _graph_us(
    call: Callable[[torch.Tensor, torch.Tensor | None], None],
    weights: list[tuple[torch.Tensor, torch.Tensor | None]],
    replays: int = 3,
) -> float:
    """µs a call, the call run once over every weight inside one captured graph (as a
    step's layers run it), the median of `replays` replays after one untimed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w, b in weights:  # warm: plans and lazy init outside the capture
            call(w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, b in weights:
            call(w, b)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return statistics.median(times)
