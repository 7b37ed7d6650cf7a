"""cuBLASLt with a chosen algorithm (csrc/lt_gemm.cpp) and the engine's GEMM tuner on a GPU:
every candidate computes x @ w.T (+ bias), gives the same bits call after call and in a
graph, and the tuner's choices are what CudaOps then runs, also after a restart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.test_kernels import check_close
from worker.attention import cuda_ops
from worker.model import gemm_tuning
from worker.model.gemm_tuning import DEFAULT, GemmTuner
from worker.model.ops import CudaOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"


def _workspace() -> torch.Tensor:
    return torch.empty(gemm_tuning.WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), [(17, 576, 3072), (200, 4096, 6144), (48, 1536, 576)])
def test_every_candidate_computes_the_product_the_same_way_each_time(dtype, m, k, n):
    x = torch.randn(m, k + 8, device=DEV).to(dtype)[:, :k]  # rows k + 8 apart, as a slice
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype)
    ws = _workspace()
    for b in (None, bias):
        out = torch.empty(m, n, device=DEV, dtype=dtype)
        count = cuda_ops.lt_gemm_algos(x, w, b, out, ws, gemm_tuning.MAX_CANDIDATES)
        assert count >= 1
        ref = x.float() @ w.float().T + (0 if b is None else b.float())
        for algo in range(count):
            out.fill_(float("nan"))
            cuda_ops.lt_gemm(x, w, b, out, ws, algo)
            check_close(out, ref, dtype)
            again = torch.full_like(out, float("nan"))
            cuda_ops.lt_gemm(x, w, b, again, ws, algo)
            assert torch.equal(out, again), f"algorithm {algo} changed its bits"


def test_a_captured_candidate_gives_the_eager_bits():
    x = torch.randn(64, 4096, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16) / 64
    ws = _workspace()
    eager = torch.empty(64, 4096, device=DEV, dtype=torch.bfloat16)
    count = cuda_ops.lt_gemm_algos(x, w, None, eager, ws, 4)
    for algo in range(count):
        cuda_ops.lt_gemm(x, w, None, eager, ws, algo)
        out = torch.full_like(eager, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cuda_ops.lt_gemm(x, w, None, out, ws, algo)
        graph.replay()
        assert torch.equal(out, eager)


def test_an_algorithm_past_the_offered_ones_is_refused():
    x = torch.randn(32, 256, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(512, 256, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(32, 512, device=DEV, dtype=torch.bfloat16)
    ws = _workspace()
    count = cuda_ops.lt_gemm_algos(x, w, None, out, ws, 64)
    with pytest.raises(RuntimeError, match="kvray: lt_gemm"):
        cuda_ops.lt_gemm(x, w, None, out, ws, count)


def _layers(
    n: int, k: int, count: int, bias: bool
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return [
        (
            torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5,
            torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None,
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("bias", [False, True])
def test_cuda_ops_run_what_the_tuner_chose_and_a_restart_chooses_the_same(tmp_path, bias):
    tuner = GemmTuner(cuda_ops, tmp_path / "choices.json")
    ops = CudaOps(cuda_ops, tuner=False)
    ops.tuner = tuner
    layers = _layers(6144, 4096, 4, bias)
    xs = {m: torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16) for m in (24, 200)}
    recorded = []
    for x in xs.values():
        with tuner.recording() as shapes:
            for w, b in layers:
                assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))  # the default meanwhile
        recorded.append(shapes)
    tuner.tune(recorded)
    assert {key[1] for key in tuner.choices} == set(xs)
    for x in xs.values():
        algo = tuner.algo(x, *layers[0])
        w, b = layers[0]
        if algo == DEFAULT:
            want = F.linear(x, w, b)
        else:
            want = torch.empty(x.shape[0], w.shape[0], device=DEV, dtype=x.dtype)
            cuda_ops.lt_gemm(x, w, b, want, tuner.workspace(x.device), algo)
        assert torch.equal(ops.linear(x, w, b), want)
    restarted = GemmTuner(cuda_ops, tmp_path / "choices.json")
    restarted.tune([])  # reads the file; nothing new to time
    assert restarted.choices == tuner.choices
