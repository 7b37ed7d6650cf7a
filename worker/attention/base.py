"""The attention backend protocol: chosen once at engine start, owns its per-step metadata."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.batch import ForwardBatch
    from worker.cache_view import CacheView


class AttentionBackend(ABC):
    """`prepare` once per step (metadata shared by every layer), then `forward` per layer."""

    supports_graph: bool = False

    @abstractmethod
    def prepare(self, batch: ForwardBatch, view: CacheView) -> None: ...

    @abstractmethod
    def fwd_decode(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor: ...

    @abstractmethod
    def fwd_prefill(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor: ...

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: CacheView
    ) -> torch.Tensor:
        """Store this step's K/V, then attend: q `[T, Hq, D]` -> `[T, Hq, D]`."""
        view.write(layer, k, v)
        if self._decode:
            return self.fwd_decode(layer, q, view)
        return self.fwd_prefill(layer, q, view)

    _decode: bool = False
