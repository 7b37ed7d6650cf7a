"""CacheView: all the model (and an attention backend) may see of the KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class CacheView(ABC):
    """K/V storage `[n_layers, n_slots, n_kv_heads, head_dim]` plus the (row, position) -> slot table."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # int32 [max_running, max_seq_len]
    page_size: int

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V `[T, n_kv_heads, head_dim]` at this step's slots."""
