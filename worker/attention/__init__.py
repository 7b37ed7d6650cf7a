"""Attention backends, by name: chosen once at engine start."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from worker.attention.base import AttentionBackend
from worker.attention.mla import MlaTorchBackend
from worker.attention.torch_native import TorchNativeBackend
from worker.model.config import ModelConfig

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


def mla_backend(
    name: str,
    model: ModelConfig,
    kv_b: Sequence[torch.Tensor],
    max_running: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionBackend:
    """The backend for MLA models: on "cuda", decode through csrc's absorbed MLA kernel where it
    fits the model's latent width and dtype, else the torch reference with fixed-width decode
    (so decode CUDA graphs can hold it); the torch reference elsewhere."""
    assert model.mla is not None
    if name == "cuda":
        from worker.attention import mla_cuda  # only on CUDA machines: it builds csrc/

        if mla_cuda.supported(model.mla, dtype):
            return mla_cuda.MlaCudaBackend(
                model.mla, model.num_heads, kv_b, max_running, device, dtype
            )
    return MlaTorchBackend(model.mla, model.num_heads, kv_b, fixed_width=name == "cuda")


__all__ = ["AttentionBackend", "BACKENDS", "MlaTorchBackend", "TorchNativeBackend", "mla_backend"]
