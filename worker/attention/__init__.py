"""Attention backends, by name: chosen once at engine start."""

from __future__ import annotations

from collections.abc import Callable

from worker.attention.base import AttentionBackend
from worker.attention.torch_native import TorchNativeBackend


def _cuda_backend(num_heads: int, head_dim: int) -> AttentionBackend:
    from worker.attention.cuda import CudaBackend  # imported only on CUDA machines

    return CudaBackend(num_heads, head_dim)


BACKENDS: dict[str, Callable[[int, int], AttentionBackend]] = {
    "torch": TorchNativeBackend,
    "cuda": _cuda_backend,
}

__all__ = ["AttentionBackend", "BACKENDS", "TorchNativeBackend"]
