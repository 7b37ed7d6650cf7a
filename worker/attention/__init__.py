"""Attention backends, by name: chosen once at engine start."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from worker.attention.base import AttentionBackend
from worker.attention.torch_native import TorchNativeBackend

if TYPE_CHECKING:
    from worker.workspace import InferenceWorkspace


def _torch_backend(
    num_heads: int, head_dim: int, workspace: InferenceWorkspace, prefill_kernel: str
) -> AttentionBackend:
    return TorchNativeBackend(num_heads, head_dim)


def _cuda_backend(
    num_heads: int, head_dim: int, workspace: InferenceWorkspace, prefill_kernel: str
) -> AttentionBackend:
    from worker.attention.cuda import CudaBackend  # only on CUDA machines: it builds csrc/

    return CudaBackend(num_heads, head_dim, workspace, prefill_kernel)


# (num_heads, head_dim, workspace, prefill_kernel) -> backend
BACKENDS: dict[str, Callable[[int, int, InferenceWorkspace, str], AttentionBackend]] = {
    "torch": _torch_backend,
    "cuda": _cuda_backend,
}

__all__ = ["AttentionBackend", "BACKENDS", "TorchNativeBackend"]
