"""CacheView: all the model (and an attention backend) may see of the KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch


class CacheView(ABC):
    """K/V storage `[n_layers, n_slots, n_kv_heads, head_dim]` plus the (row, position) -> slot table.

    An FP8 cache also has float32 scales `[n_layers, n_slots, n_kv_heads]` (kv_quant.py).
    A latent cache (MLA) holds one row per token, `n_kv_heads` 1, and `v_cache is k_cache`."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # None unless the cache is FP8
    v_scale: torch.Tensor | None
    req_to_token: torch.Tensor  # int32 [max_running, max_seq_len]
    req_to_token_host: np.ndarray  # the host's mirror of req_to_token, the same values
    page_size: int

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V `[T, n_kv_heads, head_dim]` at this step's slots (a latent
        cache stores `k`, which is also the value)."""
