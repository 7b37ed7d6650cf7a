"""The attention backend protocol: chosen once at engine start, owns its per-step metadata."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from worker.batch import ForwardBatch
    from worker.cache_view import CacheView
    from worker.model.ops import RopeInputs


# a step's own K and V rows `[T, Hkv, D]` (after RoPE), as the projection left them
NewKV = tuple[torch.Tensor, torch.Tensor]


class KVDestination(NamedTuple):
    """Where one layer's new K/V rows go: its caches `[n_slots, Hkv, D]` and a slot per token."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor


class AttentionBackend(ABC):
    """`prepare` once per step (metadata shared by every layer), then `forward` per layer."""

    supports_graph: bool = False
    # `forward` takes the step's RoPE inputs and rotates q and k itself (the CUDA backend,
    # in the kernel that writes K/V to the cache); otherwise the model rotates them first.
    applies_rope: bool = False

    @abstractmethod
    def prepare(self, batch: ForwardBatch, view: CacheView) -> None: ...

    @abstractmethod
    def fwd_decode(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor: ...

    @abstractmethod
    def fwd_prefill(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor: ...

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        view: CacheView,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend: q `[T, Hq, D]` -> `[T, Hq, D]`. `rope` is
        given only to a backend that `applies_rope`."""
        assert rope is None, f"{type(self).__name__} does not apply RoPE"
        view.write(layer, k, v)
        return self.attend(layer, q, view)

    def kv_destination(self, layer: int, view: CacheView) -> KVDestination | None:
        """Where the q/k/v projection's kernel may write this step's K/V of `layer` itself,
        rotated as `forward` would store them, before `attend`; None: `forward` stores them."""
        return None

    def attend(
        self, layer: int, q: torch.Tensor, view: CacheView, new_kv: NewKV | None = None
    ) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K/V. `new_kv`: those
        rows (rotated) where the caller has them, which a backend may read instead."""
        if self._decode:
            return self.fwd_decode(layer, q, view)
        return self.fwd_prefill(layer, q, view)

    _decode: bool = False
