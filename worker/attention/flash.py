"""Prefill attention through the FlashAttention-2 build that ships inside torch (its varlen
entry point), over K/V gathered from the paged cache into one packed buffer a step.

The CUDA backend uses it for prompt chunks where it measures faster than kvray's own
prefill kernel (`prefers_flash`; figures in docs/performance.md). Where torch lacks it (a
build without flash attention, float32, an unsupported head size) kvray's kernel runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

_DTYPES = (torch.bfloat16, torch.float16)


@cache
def available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's flash varlen forward runs here for this dtype and head size (one
    tiny call, once per process)."""
    if dtype not in _DTYPES or head_dim % 8 or head_dim > 256 or not torch.cuda.is_available():
        return False
    try:
        q = torch.randn(4, 2, head_dim, dtype=dtype, device="cuda")
        kv = torch.randn(4, 1, head_dim, dtype=dtype, device="cuda")
        cu = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
        _forward(q, kv, kv, cu, cu, 4, 4, head_dim**-0.5)
        torch.cuda.synchronize()
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def prefers_flash(q_lens: list[int]) -> bool:
    """FlashAttention-2 wins on prompt-sized chunks; kvray's kernel keeps batches of short
    chunks, whose 128-query tiles FlashAttention would leave mostly idle."""
    return sum(q_lens) >= 64 * len(q_lens)


def context_slots(
    table: np.ndarray,
    rows: Sequence[int],
    kv_lens: Sequence[int],
    device: torch.device,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """The cache slot of every token of each row's context (cached prefix and new tokens),
    rows in order, on `device`: read from the host's mirror of req_to_token (`table`) and
    copied once, since computing them on the device took a dozen small ops, ~0.5 ms of host
    time before a prompt step's first kernel (docs/performance.md)."""
    total = sum(kv_lens)
    host = torch.empty(total, dtype=dtype, pin_memory=device.type == "cuda")
    parts = [table[r, :n] for r, n in zip(rows, kv_lens, strict=True)]
    np.concatenate(parts, out=host.numpy(), casting="safe")
    return host.to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class GatherPlan:
    """One step's packed K/V layout for the prompt rows: each sequence's whole context
    (cached prefix and new tokens), in order."""

    slots: torch.Tensor  # [total_kv] int64: cache slot of each gathered token
    cu_q: torch.Tensor  # [B+1] int32
    cu_k: torch.Tensor  # [B+1] int32
    max_q: int
    max_k: int

    @staticmethod
    def build(
        table: np.ndarray,
        rows: Sequence[int],
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        q_lens: list[int],
        kv_lens: list[int],
    ) -> GatherPlan:
        """For rows of req_to_token (`table`, the host's mirror) with q_lens new tokens each
        and kv_lens in all, whose prefix sums on the device are cu_q and cu_k."""
        slots = context_slots(table, rows, kv_lens, cu_q.device, torch.int64)
        return GatherPlan(slots, cu_q, cu_k, max(q_lens), max(kv_lens))

    def gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's K/V rows of one layer's cache, packed."""
        return k_cache.index_select(0, self.slots), v_cache.index_select(0, self.slots)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: GatherPlan, scale: float
) -> torch.Tensor:
    """Causal attention of packed q `[T, Hq, D]` over the plan's gathered K/V `[total_kv,
    Hkv, D]` (`GatherPlan.gather`); query i of a sequence sees its keys up to
    kv_len - q_len + i (bottom-right)."""
    return _forward(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale)


def fresh(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """Causal attention of prompts with no cached context over their own new K/V rows `[T,
    Hkv, D]` (strided views of a fused projection are fine), `cu` their offsets (int32)."""
    return _forward(q, k, v, cu, cu, max_len, max_len, scale)


def prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: GatherPlan, scale: float
) -> torch.Tensor:
    """`attend` over K/V gathered from one layer's cache `[n_slots, Hkv, D]`."""
    return attend(q, *plan.gather(k_cache, v_cache), plan, scale)


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
    )
    return out[0]
