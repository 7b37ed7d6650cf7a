"""Prefill attention through FlashInfer's FlashAttention-3 kernels (Hopper: wgmma, TMA,
warp-specialised pipelining).

FlashInfer is optional (`pip install flashinfer-python`); where it runs, `prefill_kernel: auto`
takes this path (`resolve`). Without it, or off sm_90, the CUDA backend keeps its own kernels
and torch's FlashAttention-2. A step whose prompt rows have no cached context runs the ragged
kernel on the new K/V where the projection left them (TMA loads; the same tokens are in the
cache too). Otherwise the kernel reads K/V in place in the paged cache, handed over as
pages of one token (`[n_slots, 1, Hkv, D]`) with each sequence's slots as its page list, so
nothing is gathered: FlashInfer's FA3 path reads a page-size-1 cache token by token
("vector-sparse") in any case. The first use JIT-compiles the kernels for this dtype and
head size (minutes; cached on disk by FlashInfer afterwards).
"""

from __future__ import annotations

import itertools
import logging
from functools import cache
from typing import Any

import torch

log = logging.getLogger("kvray.attention")

_DTYPES = (torch.bfloat16, torch.float16)
_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
# FA3 reads the page indices of a whole K/V tile (64-192 tokens) past a sequence's last one,
# unchecked ("the user's responsibility", FlashInfer's BlockSparseIndexedGather): after the
# last sequence's slots come this many more, all slot 0, so that read stays in the tensor.
INDEX_PAD = 256
HOST_INTS = 4096  # a wrapper set's pinned int32 plan inputs (grown for a larger batch)


@cache
def available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FlashInfer's FA3 prefill runs here for this dtype and head size: FlashInfer
    imports, the GPU is sm_90, and one tiny call (which builds the kernels) succeeds."""
    if dtype not in _DTYPES or head_dim not in _HEAD_DIMS or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    except Exception as exc:  # installed against another CUDA or torch
        log.warning("FlashInfer does not import here: %s", exc)
        return False
    try:
        device = torch.device("cuda")
        fa3 = Fa3Prefill(device)
        kv = torch.randn(8, 1, head_dim, dtype=dtype, device=device)
        slots = torch.arange(8, dtype=torch.int32, device=device)
        q = torch.randn(8, 2, head_dim, dtype=dtype, device=device)
        for s in (slots, None):  # the paged kernel, then the ragged one
            fa3.plan(s, [4, 4], [4, 4], 2, 1, head_dim, dtype, head_dim**-0.5)
            fa3.run(q, kv, kv)
        torch.cuda.synchronize()
    except Exception as exc:  # a failed JIT build or launch: the other kernels serve
        log.warning("FlashInfer's FA3 prefill does not run here: %s", exc)
        return False
    return True


def resolve(prefill_kernel: str, dtype: torch.dtype, head_dim: int) -> str:
    """The prompt kernel setting a CUDA backend runs: `auto` becomes `fa3` where FA3 runs,
    since it measured 1.7-2.1x FlashAttention-2 on every prompt shape (docs/performance.md)."""
    if prefill_kernel == "auto" and available(dtype, head_dim):
        return "fa3"
    return prefill_kernel


class Fa3Prefill:
    """One planned prefill a step, run for every layer, planned without waiting for the device.
    FlashInfer copies a plan to the device from host tensors with `non_blocking`, which from
    pageable memory waits for the device (the overlapped launch then stalls), so the lengths
    go in pinned memory: a buffer per wrapper set, allocated once (pinning a fresh tensor took
    54 µs of a lone prompt's first layer on an H100). Those buffers, and FlashInfer's own
    pinned plan buffer, are rewritten by the next plan of the same set: two sets are used in
    turn, and a set is planned again only once the copy of its last plan has run (an event;
    with at most two steps in flight it always has)."""

    def __init__(self, device: torch.device):
        import flashinfer

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._paged: list[Any] = [
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
            for _ in range(2)
        ]
        self._ragged: list[Any] = [
            flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
            for _ in range(2)
        ]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._host = [torch.zeros(HOST_INTS, dtype=torch.int32).pin_memory() for _ in range(2)]
        self._turn = 0
        self.ragged = False  # the last plan reads the new rows' K/V, not the cache

    def plan(
        self,
        slots: torch.Tensor | None,
        q_lens: list[int],
        kv_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float,
    ) -> None:
        """The step's layout: sequence i has q_lens[i] new tokens, the last of its kv_lens[i]
        tokens, whose cache slots are `slots` (int32 on the device, sequences in order).
        `slots` None: no sequence has cached context (q_lens == kv_lens), and `run` takes the
        new rows' K/V instead of the cache."""
        self._turn ^= 1
        self._copied[self._turn].synchronize()  # an event never recorded returns at once
        self.ragged = slots is None
        # causal is bottom-right aligned: query i sees keys up to kv_len - q_len + i
        options = dict(causal=True, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
        if slots is None:
            assert q_lens == kv_lens, "a ragged plan has no cached context"
            (offsets,) = self._host_ints(_offsets(q_lens))
            self._ragged[self._turn].plan(
                offsets, offsets, num_heads, num_kv_heads, head_dim, **options
            )
        else:
            # every page holds one token; seq_lens given, else FlashInfer derives them into
            # pageable memory
            qo, kv, last, seq = self._host_ints(
                _offsets(q_lens), _offsets(kv_lens), [1] * len(kv_lens), kv_lens
            )
            self._paged[self._turn].plan(
                qo,
                kv,
                torch.nn.functional.pad(slots, (0, INDEX_PAD)),
                last,
                num_heads,
                num_kv_heads,
                head_dim,
                1,  # page size
                seq_lens=seq,
                **options,
            )
        self._copied[self._turn].record()

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the planned rows' q `[T, Hq, D]`, into `out` when given, over one
        layer's cache `[n_slots, Hkv, D]`, or when `ragged` over the new rows' `[T, Hkv, D]`
        (rows may be strided, as views of a fused projection)."""
        if self.ragged:
            return self._ragged[self._turn].run(q, k, v, out=out)
        cache_kv = (k.unsqueeze(1), v.unsqueeze(1))
        return self._paged[self._turn].run(q, cache_kv, out=out)

    def _host_ints(self, *rows: list[int]) -> list[torch.Tensor]:
        """`rows` as int32 views of this turn's pinned buffer, one after another (called once
        the turn's event says the copies of its last plan have run)."""
        total = sum(len(r) for r in rows)
        if self._host[self._turn].numel() < total:
            self._host[self._turn] = torch.zeros(2 * total, dtype=torch.int32).pin_memory()
        buf = self._host[self._turn]
        flat = buf.numpy()
        views, at = [], 0
        for r in rows:
            flat[at : at + len(r)] = r
            views.append(buf[at : at + len(r)])
            at += len(r)
        return views


def _offsets(lengths: list[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]."""
    return [0, *itertools.accumulate(lengths)]
