"""Which linear layers CudaOps hands to csrc's one-pass kernels (GEMV, skinny and tiled GEMMs)
and which stay on cuBLAS: the routing alone, with a stand-in for the kernels and meta tensors."""

from __future__ import annotations

import types

import pytest
import torch

from worker.attention.base import KVDestination
from worker.model.ops import CudaOps, RopeInputs

BF16 = torch.bfloat16
DEMO_QKV, DEMO_GATE_UP = (960, 576), (3072, 576)  # [N, K]: at most 4 Mi weights
LLAMA_QKV, LLAMA_DOWN = (6144, 4096), (4096, 14336)


def _kernels(calls: list[tuple[str, tuple[int, ...], bool]]) -> types.SimpleNamespace:
    def kernel(name: str):
        def run(x, w, bias, out, gated: bool = False) -> None:
            calls.append((name, tuple(out.shape), gated))

        return run

    return types.SimpleNamespace(
        gemv=kernel("gemv"), skinny_gemm=kernel("skinny_gemm"), tiled_gemm=kernel("tiled_gemm")
    )


def _route(ops: CudaOps, m: int, nk: tuple[int, int], dtype=BF16) -> str:
    x = torch.empty(m, nk[1], dtype=dtype, device="meta")
    kernel = ops._one_pass_kernel(x, torch.empty(nk, dtype=dtype, device="meta"))
    names = {
        id(ops._k.gemv): "gemv",
        id(ops._k.skinny_gemm): "skinny",
        id(ops._k.tiled_gemm): "tiled",
    }
    return "cublas" if kernel is None else names[id(kernel)]


@pytest.mark.parametrize(
    ("m", "nk", "want"),
    [
        (1, LLAMA_QKV, "gemv"),
        (1, LLAMA_DOWN, "gemv"),  # K = 14,336 too: its K is split over warps
        (1, DEMO_QKV, "gemv"),
        (4, DEMO_GATE_UP, "gemv"),
        (5, DEMO_QKV, "skinny"),
        (32, DEMO_GATE_UP, "skinny"),
        (33, DEMO_QKV, "cublas"),
        (2, LLAMA_QKV, "tiled"),  # the 8B matrices: the tiled GEMM up to 16 rows
        (16, LLAMA_DOWN, "tiled"),
        (17, LLAMA_QKV, "cublas"),  # then cuBLAS
        (32, LLAMA_DOWN, "cublas"),
    ],
)
def test_each_linear_goes_where_it_measured_fastest(m: int, nk: tuple[int, int], want: str):
    assert _route(CudaOps(_kernels([])), m, nk) == want


def test_what_the_kernels_cannot_read_stays_on_cublas():
    ops = CudaOps(_kernels([]))
    assert _route(ops, 8, DEMO_QKV, torch.float32) == "cublas"
    assert _route(ops, 1, (64, 60)) == "cublas"  # K not a multiple of 8
    w = torch.empty(DEMO_QKV, dtype=BF16, device="meta")
    strided = torch.empty(8, 580, dtype=BF16, device="meta")[:, :576]  # rows 580 apart
    assert ops._one_pass_kernel(strided, w) is None
    unaligned = torch.empty(1, 584, dtype=BF16)[:, 1:577]  # 2 bytes past a 16-byte boundary
    assert ops._one_pass_kernel(unaligned, w) is None


def test_the_skinny_bound_can_be_lowered_for_measuring(monkeypatch):
    monkeypatch.setenv("KVRAY_SKINNY_MAX_ROWS", "0")
    assert _route(CudaOps(_kernels([])), 8, DEMO_QKV) == "cublas"


def test_the_tiled_bound_can_be_moved_for_measuring(monkeypatch):
    monkeypatch.setenv("KVRAY_TILED_MAX_ROWS", "64")
    ops = CudaOps(_kernels([]))
    assert [_route(ops, m, LLAMA_QKV) for m in (1, 2, 64, 65)] == [
        "gemv",
        "tiled",
        "tiled",
        "cublas",
    ]
    assert _route(ops, 32, LLAMA_DOWN) == "tiled"
    assert _route(ops, 8, DEMO_QKV) == "skinny"  # the small ones keep the skinny GEMM


def test_linear_and_gated_linear_hand_the_kernel_its_output():
    calls: list[tuple[str, tuple[int, ...], bool]] = []
    ops = CudaOps(_kernels(calls))
    x = torch.empty(8, 576, dtype=BF16, device="meta")
    assert ops.linear(x, torch.empty(DEMO_QKV, dtype=BF16, device="meta")).shape == (8, 960)
    gated = ops.gated_linear(x, torch.empty(DEMO_GATE_UP, dtype=BF16, device="meta"))
    assert gated.shape == (8, 1536)
    assert calls == [("skinny_gemm", (8, 960), False), ("skinny_gemm", (8, 1536), True)]


def _fused_kernels(calls: list) -> types.SimpleNamespace:
    kernels = _kernels(calls)

    def run(x, w, b, out, positions, cos, sin, num_q_heads, *dest) -> None:
        calls.append(("skinny_rope_store_kv", tuple(out.shape), num_q_heads))

    kernels.skinny_rope_store_kv = run
    return kernels


def _qkv_rope_store(ops: CudaOps, m: int, nk: tuple[int, int], head_dim: int = 64):
    x = torch.empty(m, nk[1], dtype=BF16, device="meta")
    rope = RopeInputs(*[torch.empty(1, device="meta")] * 3)
    cache = torch.empty(8, 3, head_dim, dtype=BF16, device="meta")
    dest = KVDestination(cache, cache, torch.empty(m, dtype=torch.int64, device="meta"))
    return ops.qkv_rope_store(x, torch.empty(nk, dtype=BF16, device="meta"), None, rope, dest, 9)


@pytest.mark.parametrize(
    ("m", "nk", "head_dim", "kernel"),
    [
        (1, LLAMA_QKV, 128, None),  # the GEMV's: slower fused than beside the rotary kernel
        (4, DEMO_QKV, 64, None),
        (5, DEMO_QKV, 64, "skinny_rope_store_kv"),
        (32, DEMO_QKV, 64, "skinny_rope_store_kv"),
        (5, DEMO_QKV, 40, None),  # the skinny GEMM's 8-row tiles need head_dim % 16 == 0
        (33, DEMO_QKV, 64, None),
        (2, LLAMA_QKV, 128, None),
    ],
)
def test_the_qkv_projection_takes_rope_and_the_kv_write_where_kvrays_kernel_runs(
    m, nk, head_dim, kernel
):
    calls: list = []
    out = _qkv_rope_store(CudaOps(_fused_kernels(calls)), m, nk, head_dim)
    assert (out is not None) == (kernel is not None)
    assert calls == ([(kernel, (m, nk[0]), 9)] if kernel else [])


def test_the_fused_qkv_projection_can_be_turned_off_for_measuring(monkeypatch):
    monkeypatch.setenv("KVRAY_FUSED_ROPE", "0")
    calls: list = []
    assert _qkv_rope_store(CudaOps(_fused_kernels(calls)), 5, DEMO_QKV) is None
    assert calls == []
