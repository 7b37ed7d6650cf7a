"""Which linear layers CudaOps hands to csrc's one-pass kernels (GEMV, skinny GEMM) and which
stay on cuBLAS: the routing alone, with a stand-in for the kernels and meta tensors."""

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

    return types.SimpleNamespace(gemv=kernel("gemv"), skinny_gemm=kernel("skinny_gemm"))


def _route(ops: CudaOps, m: int, nk: tuple[int, int], dtype=BF16) -> str:
    x = torch.empty(m, nk[1], dtype=dtype, device="meta")
    kernel = ops._one_pass_kernel(x, torch.empty(nk, dtype=dtype, device="meta"))
    names = {id(ops._k.gemv): "gemv", id(ops._k.skinny_gemm): "skinny"}
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
        (2, LLAMA_QKV, "cublas"),  # the 8B matrices stay on cuBLAS past one row
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


def test_linear_and_gated_linear_hand_the_kernel_its_output():
    calls: list[tuple[str, tuple[int, ...], bool]] = []
    ops = CudaOps(_kernels(calls))
    x = torch.empty(8, 576, dtype=BF16, device="meta")
    assert ops.linear(x, torch.empty(DEMO_QKV, dtype=BF16, device="meta")).shape == (8, 960)
    gated = ops.gated_linear(x, torch.empty(DEMO_GATE_UP, dtype=BF16, device="meta"))
    assert gated.shape == (8, 1536)
    assert calls == [("skinny_gemm", (8, 960), False), ("skinny_gemm", (8, 1536), True)]


@pytest.mark.parametrize(
    ("m", "nk", "fused"),
    [(1, LLAMA_QKV, True), (4, DEMO_QKV, True), (2, LLAMA_QKV, False), (5, DEMO_QKV, False)],
)
def test_the_qkv_projection_takes_rope_and_the_kv_write_where_the_gemv_runs(m, nk, fused):
    calls: list = []
    kernels = _kernels(calls)
    kernels.gemv_rope_store_kv = lambda x, w, b, out, *rope_and_dest: calls.append(
        ("gemv_rope_store_kv", tuple(out.shape), rope_and_dest[3])
    )
    ops = CudaOps(kernels)
    x = torch.empty(m, nk[1], dtype=BF16, device="meta")
    rope = RopeInputs(*[torch.empty(1, device="meta")] * 3)
    dest = KVDestination(*[torch.empty(1, device="meta")] * 3)
    out = ops.qkv_rope_store(x, torch.empty(nk, dtype=BF16, device="meta"), None, rope, dest, 32)
    assert (out is not None) == fused
    assert calls == ([("gemv_rope_store_kv", (m, nk[0]), 32)] if fused else [])


def test_the_fused_qkv_projection_can_be_turned_off_for_measuring(monkeypatch):
    monkeypatch.setenv("KVRAY_GEMV_ROPE_MAX_ROWS", "0")
    ops = CudaOps(_kernels([]))
    x = torch.empty(1, LLAMA_QKV[1], dtype=BF16, device="meta")
    rope = RopeInputs(*[torch.empty(1, device="meta")] * 3)
    dest = KVDestination(*[torch.empty(1, device="meta")] * 3)
    w = torch.empty(LLAMA_QKV, dtype=BF16, device="meta")
    assert ops.qkv_rope_store(x, w, None, rope, dest, 32) is None
