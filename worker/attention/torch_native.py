"""TorchNativeBackend: SDPA over gathered K/V. The CPU path and the reference for the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionBackend
from worker.attention.kv_quant import dequantize_gather
from worker.batch import ForwardBatch
from worker.cache_view import CacheView


@dataclass
class _DecodeGroup:
    """Requests with one new token: one batched SDPA over K/V padded to the longest."""

    # where their tokens sit in the packed batch (None: all, in order)
    token_index: torch.Tensor | None
    slots: torch.Tensor  # [Bd, max_len] int64
    mask: torch.Tensor  # [Bd, 1, 1, max_len] bool
    sel: torch.Tensor | None = None  # their batch rows (None: all, in order)


@dataclass
class _PrefillSeq:
    """A request with several new tokens: its own causal SDPA (kv_len >= q_len)."""

    start: int
    q_len: int
    slots: torch.Tensor  # [kv_len] int64
    mask: torch.Tensor | None  # None: plain causal (kv_len == q_len)


class TorchNativeBackend(AttentionBackend):
    supports_graph = False

    def __init__(self, num_heads: int, head_dim: int):
        self.scale = head_dim**-0.5
        self.num_heads = num_heads
        self._group: _DecodeGroup | None = None
        self._seqs: list[_PrefillSeq] = []

    def prepare(self, batch: ForwardBatch, view: CacheView) -> None:
        self._decode = batch.is_decode
        device = batch.input_ids.device
        rows = batch.req_pool_indices.long()
        decode = [i for i, q in enumerate(batch.q_lens) if q == 1]
        self._group = None
        if decode:
            lens = [batch.seq_lens_host[i] for i in decode]
            max_len = self._decode_width(view, lens)
            sel = None if len(decode) == batch.batch_size else torch.tensor(decode, device=device)
            group_rows = rows if sel is None else rows[sel]
            seq_lens = batch.seq_lens if sel is None else batch.seq_lens[sel]
            slots = view.req_to_token[group_rows, :max_len].long()
            mask = torch.arange(max_len, device=device)[None, :] < seq_lens[:, None]
            token_index = None if sel is None else batch.logits_indices[sel]
            self._group = _DecodeGroup(token_index, slots, mask[:, None, None, :], sel)
        self._seqs = []
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.seq_lens_host, strict=True)):
            if q_len > 1:
                slots = view.req_to_token[rows[i], :kv_len].long()
                causal: torch.Tensor | None = None  # None: plain causal, kv_len == q_len
                if kv_len != q_len:
                    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
                    causal = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
                self._seqs.append(_PrefillSeq(start, q_len, slots, causal))
            start += q_len

    def _decode_width(self, view: CacheView, lens: list[int]) -> int:
        """Slots the decode group reads per request (its longest length)."""
        return max(lens)

    def fwd_decode(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor:
        out = torch.empty_like(q)
        self._attend_decode(layer, q, view, out)
        return out

    def fwd_prefill(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor:
        out = torch.empty_like(q)
        if self._group is not None:
            self._attend_decode(layer, q, view, out)
        for s in self._seqs:
            qs = q[s.start : s.start + s.q_len].transpose(0, 1)  # [Hq, q_len, D]
            k, v = _gather(view, layer, s.slots, q.dtype)
            ks, vs = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, kv_len, D]
            o = F.scaled_dot_product_attention(
                qs,
                ks,
                vs,
                attn_mask=s.mask,
                is_causal=s.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[s.start : s.start + s.q_len] = o.transpose(0, 1)
        return out

    def _attend_decode(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor
    ) -> None:
        g = self._group
        assert g is not None
        qd = q if g.token_index is None else q[g.token_index]
        b, n_kv = qd.shape[0], view.k_cache.shape[2]
        shape = (*g.slots.shape, n_kv, view.k_cache.shape[3])
        k, v = _gather(view, layer, g.slots.view(-1), q.dtype)
        k, v = k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)  # [Bd, Hkv, L, D]
        # One query token per request: the query heads sharing a KV head become that head's query
        # rows, so GQA needs no repeated K/V (cheaper than enable_gqa with a mask).
        grouped = qd.view(b, n_kv, -1, qd.shape[-1])
        o = F.scaled_dot_product_attention(grouped, k, v, attn_mask=g.mask, scale=self.scale).view(
            qd.shape
        )
        if g.token_index is None:
            out.copy_(o)
        else:
            out[g.token_index] = o


def _gather(
    view: CacheView, layer: int, slots: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows `[len(slots), Hkv, D]` of one layer, dequantized when the cache is FP8."""
    if view.k_scale is not None and view.v_scale is not None:
        k = dequantize_gather(view.k_cache[layer], view.k_scale[layer], slots, dtype)
        return k, dequantize_gather(view.v_cache[layer], view.v_scale[layer], slots, dtype)
    # index_select on the layer's view: `buf[layer, slots]` takes a slow path in torch.
    return view.k_cache[layer].index_select(0, slots), view.v_cache[layer].index_select(0, slots)
