"""The model's elementwise layer ops (RMSNorm, residual add, RoPE, SiLU·mul) as a strategy
chosen once at load, so the model never branches on the device per call.

TorchOps is HF transformers' torch op sequence: the CPU path and the numerical reference.
CudaOps runs the same computation as csrc's fused kernels, which round exactly where that
sequence rounds, so both give the same bits on a GPU; a layer then launches a handful of
kernels instead of about forty.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from worker.model.layers import RotaryEmbedding, apply_rope, rms_norm

if TYPE_CHECKING:
    from worker.attention.base import KVDestination


@dataclass(frozen=True, slots=True)
class RopeInputs:
    """One step's RoPE inputs, built once per forward by the ops that later read them:
    TorchOps keeps each token's cos/sin rows in the activation dtype, CudaOps the float32
    tables that `positions` index."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class ModelOps(ABC):
    """Results may reuse their inputs' storage (CudaOps works in place); callers use the
    returned tensors and never read the inputs again."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF RMSNorm over the last dim of `[T, N]` or `[T, H, N]` (Qwen3's per-head q/k norm)."""

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual add of the previous sublayer
        fused with the next norm."""

    @abstractmethod
    def rope_inputs(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs: ...

    @abstractmethod
    def rope(
        self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of q `[T, Hq, D]` and k `[T, Hk, D]`."""

    @abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for `gate_up = [gate | up]` of shape `[T, 2I]`."""

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x `[T, K]` @ weight `[N, K]`.T (+ bias)."""
        return F.linear(x, weight, bias)

    def qkv_rope_store(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        rope: RopeInputs, dest: KVDestination, num_q_heads: int,
    ) -> torch.Tensor | None:  # fmt: skip
        """The q/k/v projection `[T, (Hq + 2 Hkv) * D]` with q and k rotated and this
        step's K/V written to `dest` in the same kernel, where one does that; else None."""
        return None

    def gated_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """silu(gate) * up of the gate_up projection (weight `[2I, K]` = [gate; up]): `[T, I]`."""
        return self.silu_and_mul(self.linear(x, weight, bias))


class TorchOps(ModelOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def rope_inputs(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs:
        cos, sin = rotary(positions, dtype)
        return RopeInputs(positions, cos, sin)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up


class CudaOps(ModelOps):
    """csrc's fused kernels: norms and RoPE in place, outputs of the others allocated here
    (inside a captured graph they come from the graph's pool). A linear layer runs kvray's
    GEMV (one pass over the weights) where it measured faster than cuBLAS on one H200
    (`kvray bench kernels --only gemv`, docs/performance.md): one token (the 8B shape's down
    projection, K = 14,336, since its K is split over warps: measured on an H100), and up to
    four tokens on matrices of at most 4 Mi weights (the demo's). On those small matrices,
    batches up to `skinny_max_rows` tokens run the skinny GEMM (tensor cores, still one pass
    over the weights), which beat cuBLAS there on an H100 (`--only gemm`; on the 8B shape's
    matrices it lost). The larger matrices run the tiled GEMM (shared memory, K split over a
    cluster) from 2 to `tiled_max_rows` tokens, where it made the 8B shape's decode step 3-4 %
    faster on an H100 (and 5 % slower at 32); everything else stays on cuBLAS.
    KVRAY_SKINNY_MAX_ROWS and KVRAY_TILED_MAX_ROWS override those bounds (0: never), for
    measuring. Where the skinny GEMM runs a qkv projection, it also applies RoPE and writes
    K/V (`qkv_rope_store`); KVRAY_FUSED_ROPE=0 leaves that to attention's own kernel, for
    measuring."""

    gemv_max_rows = 4
    gemv_small_weights = 4 << 20
    skinny_max_rows = 32
    tiled_max_rows = 16

    def __init__(self, kernels: ModuleType | None = None) -> None:
        """`kernels`: worker.attention.cuda_ops, or a stand-in of it (tests on CPU)."""
        if kernels is None:
            from worker.attention import cuda_ops

            cuda_ops.load()  # build (or load the cached build) now, not inside the first step
            kernels = cuda_ops
        self._k = kernels
        self.skinny_max_rows = int(os.environ.get("KVRAY_SKINNY_MAX_ROWS", self.skinny_max_rows))
        self.fused_rope = os.environ.get("KVRAY_FUSED_ROPE") != "0"
        self.tiled_max_rows = int(os.environ.get("KVRAY_TILED_MAX_ROWS", self.tiled_max_rows))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._k.rms_norm(x, weight, eps, out)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._k.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rope_inputs(
        self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> RopeInputs:
        return RopeInputs(positions, rotary.cos, rotary.sin)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._k.rotary(q, k, rope.positions, rope.cos, rope.sin)
        return q, k

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        kernel = self._one_pass_kernel(x, weight)
        if kernel is None:
            return F.linear(x, weight, bias)
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        kernel(x, weight, bias, out)
        return out

    def gated_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        kernel = self._one_pass_kernel(x, weight)
        if kernel is None:
            return self.silu_and_mul(F.linear(x, weight, bias))
        out = torch.empty((x.shape[0], weight.shape[0] // 2), dtype=x.dtype, device=x.device)
        kernel(x, weight, bias, out, gated=True)  # no activation kernel
        return out

    def qkv_rope_store(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        rope: RopeInputs, dest: KVDestination, num_q_heads: int,
    ) -> torch.Tensor | None:  # fmt: skip
        """Where the skinny GEMM runs the projection: RoPE and the KV write in its epilogue,
        one kernel a layer fewer (its 8-row tiles need a head_dim that is a multiple of 16).
        Not on the GEMV: there it measured slower than the GEMV then the rotary kernel
        (docs/performance.md)."""
        m, small = x.shape[0], weight.numel() <= self.gemv_small_weights
        # the shape alone first: every layer of an eager prompt step asks, and then its
        # projection's `linear` runs the full check again
        if not (self.fused_rope and small and self.gemv_max_rows < m <= self.skinny_max_rows):
            return None
        if (
            self._one_pass_kernel(x, weight) is not self._k.skinny_gemm
            or dest.k_cache.shape[-1] % 16
        ):
            return None
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        self._k.skinny_rope_store_kv(
            x, weight, bias, out, rope.positions, rope.cos, rope.sin, num_q_heads, *dest
        )
        return out

    def _one_pass_kernel(self, x: torch.Tensor, weight: torch.Tensor) -> Callable[..., None] | None:
        """csrc's GEMV or skinny GEMM where it runs and beats cuBLAS, else None."""
        m, k = x.shape
        runs = (
            k % 8 == 0
            and x.stride(1) == 1
            and (x.stride(0) % 8 == 0 or m == 1)
            and x.data_ptr() % 16 == 0
            and x.dtype != torch.float32
        )
        if not runs:
            return None
        small = weight.numel() <= self.gemv_small_weights
        if m == 1 or (m <= self.gemv_max_rows and small):
            return self._k.gemv
        if small:
            return self._k.skinny_gemm if m <= self.skinny_max_rows else None
        return self._k.tiled_gemm if m <= self.tiled_max_rows else None

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = torch.empty(
            (gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device
        )
        self._k.silu_and_mul(gate_up, out)
        return out


OPS: dict[str, type[ModelOps]] = {"torch": TorchOps, "cuda": CudaOps}
"""Attention backend name -> the layer ops that go with it (the csrc kernels travel together)."""
