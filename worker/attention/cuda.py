"""CudaBackend: kvray's csrc kernels — fused KV store, split-KV paged decode, ragged prefill.

Decode writes into the workspace's `decode_out` / `decode_o_part` / `decode_ml_part` and its
launch grid depends on shapes only, so a decode step can be captured in a CUDA graph.
With an FP8 cache the KV store quantizes and decode reads e4m3 with its scales; the
prefill kernel reads bf16 only, so a prompt step attends over a dequantized copy of its
sequences' K/V (`_Fp8Gather`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention import cuda_ops
from worker.attention.base import AttentionBackend
from worker.attention.kv_quant import dequantize_gather
from worker.batch import ForwardBatch
from worker.cache_view import CacheView
from worker.workspace import InferenceWorkspace


@dataclass
class _Fp8Gather:
    """A prompt step's prefill sequences over an FP8 cache, laid out contiguously: their K/V
    slots in order, and a one-entry page table per sequence (its first row) whose page is
    longer than any of them, so the prefill kernel reads the gathered rows as they lie."""

    slots: torch.Tensor  # int64 [sum of the sequences' KV lengths]
    req_to_token: torch.Tensor  # int32 [B, 1]
    req_pool_indices: torch.Tensor  # int32 [B]: 0 .. B - 1
    page_size: int


class CudaBackend(AttentionBackend):
    supports_graph = True

    def __init__(self, num_heads: int, head_dim: int, workspace: InferenceWorkspace):
        cuda_ops.load()  # build (or load the cached build) now, not inside the first step
        self.scale = head_dim**-0.5
        self.ws = workspace
        self._batch: ForwardBatch | None = None

    def prepare(self, batch: ForwardBatch, view: CacheView) -> None:
        self._batch = batch
        self._decode = batch.is_decode
        # A batch that mixes decodes with prompt chunks sends its leading one-token rows (the
        # scheduler puts decodes first) to the decode kernel, since the prefill kernel would
        # give each a 64-query tile per head that is almost all idle.
        self._num_leading_decodes = 0
        if not self._decode:
            d = 0
            for n in batch.q_lens:
                if n != 1:
                    break
                d += 1
            self._num_leading_decodes = d
            if d:
                self._rest_qo_indptr = batch.qo_indptr[d:] - d  # each leading row holds one token
        self._gather = None
        if not self._decode and view.k_scale is not None:
            self._gather = self._fp8_gather(batch, view)

    def _fp8_gather(self, batch: ForwardBatch, view: CacheView) -> _Fp8Gather:
        """Slots of the prefill sequences' KV (those after the leading decodes), found on the
        device (no host sync), once per step for every layer."""
        d, n = self._num_leading_decodes, batch.batch_size
        lens = batch.seq_lens[d:].long()
        starts = batch.kv_indptr[d:n].long() - batch.kv_indptr[d].long()
        total = sum(batch.seq_lens_host[d:])
        seq = torch.repeat_interleave(
            torch.arange(n - d, device=lens.device), lens, output_size=total
        )
        pos = torch.arange(total, device=lens.device) - starts[seq]
        rows = batch.req_pool_indices[d:].long()
        slots = view.req_to_token[rows[seq], pos].long()
        table = starts.to(torch.int32).view(-1, 1)
        indices = torch.arange(n - d, dtype=torch.int32, device=lens.device)
        return _Fp8Gather(slots, table, indices, max(batch.seq_lens_host[d:]) + 1)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: CacheView,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """As the protocol's; `out` `[T, Hq, D]` receives the result (the piecewise prompt
        graphs read it from a fixed address)."""
        assert self._batch is not None
        k_scale, v_scale = _scales(view, layer)
        # fmt: skip
        cuda_ops.store_kv(
            k,
            v,
            view.k_cache[layer],
            view.v_cache[layer],
            self._batch.out_cache_loc,
            k_scale,
            v_scale,
        )
        if self._decode:
            return self.fwd_decode(layer, q, view, out)
        return self.fwd_prefill(layer, q, view, out)

    def fwd_decode(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, ws = self._batch, self.ws
        assert b is not None
        if out is None:
            out = ws.decode_out[: q.shape[0]]
        k_scale, v_scale = _scales(view, layer)
        # fmt: skip
        cuda_ops.decode_attention(
            q,
            view.k_cache[layer],
            view.v_cache[layer],
            view.req_to_token,
            b.req_pool_indices,
            b.seq_lens,
            view.page_size,
            self.scale,
            out,
            ws.decode_o_part,
            ws.decode_ml_part,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return out

    def fwd_prefill(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, ws, d = self._batch, self.ws, self._num_leading_decodes
        assert b is not None
        if out is None:
            out = torch.empty_like(q)
        k_cache, v_cache = view.k_cache[layer], view.v_cache[layer]
        k_scale, v_scale = _scales(view, layer)
        pk, pv, rt, rows, page = self._prefill_kv(layer, view, q.dtype)
        if d == 0:
            # fmt: skip
            cuda_ops.prefill_attention(
                q, pk, pv, rt, rows, b.seq_lens, b.qo_indptr, page, self.scale, out
            )
            return out
        # fmt: skip
        cuda_ops.decode_attention(
            q[:d],
            k_cache,
            v_cache,
            view.req_to_token,
            b.req_pool_indices[:d],
            b.seq_lens[:d],
            view.page_size,
            self.scale,
            out[:d],
            ws.decode_o_part,
            ws.decode_ml_part,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        # fmt: skip
        cuda_ops.prefill_attention(
            q[d:],
            pk,
            pv,
            rt,
            rows,
            b.seq_lens[d:],
            self._rest_qo_indptr,
            page,
            self.scale,
            out[d:],
        )
        return out

    def _prefill_kv(
        self, layer: int, view: CacheView, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """What the prefill kernel reads for the sequences after the leading decodes: K, V,
        the page table, those sequences' rows in it, the page size. The paged cache itself,
        or for an FP8 cache a dequantized contiguous copy of their K/V (`_Fp8Gather`)."""
        b, g = self._batch, self._gather
        assert b is not None
        k_scale, v_scale = _scales(view, layer)
        if g is None or k_scale is None or v_scale is None:
            rows = b.req_pool_indices[self._num_leading_decodes :]
            return view.k_cache[layer], view.v_cache[layer], view.req_to_token, rows, view.page_size
        k = dequantize_gather(view.k_cache[layer], k_scale, g.slots, dtype)
        v = dequantize_gather(view.v_cache[layer], v_scale, g.slots, dtype)
        return k, v, g.req_to_token, g.req_pool_indices, g.page_size


def _scales(view: CacheView, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This layer's K and V scales of an FP8 cache, else (None, None)."""
    if view.k_scale is None or view.v_scale is None:
        return None, None
    return view.k_scale[layer], view.v_scale[layer]
