"""MlaTorchBackend: multi-head latent attention over the latent KV cache, in torch.

Each cache row is one token's `[c | k_pe]`: the normalised compressed kv `c` (kv_lora_rank)
and the roped key part shared by all heads. kv_b_proj holds, per head h, W_UK[h]
`[nope, rank]` and W_UV[h] `[v, rank]`, so k_nope[h] = W_UK[h] c and v[h] = W_UV[h] c.

- Prompts (naive, as transformers computes it): expand every cached row into per-head K
  and V with kv_b_proj, then causal SDPA; a prompt's queries outnumber its heads' reuse.
- Decodes (absorbed): q_nope[h]·k_nope[h] = (q_nope[h] W_UK[h])·c, so W_UK folds into the
  query, all heads score against the shared latent rows directly (one SDPA, the heads as
  query rows of a single KV head), the weighted sum of latents comes out, and W_UV then
  maps it to each head's value space. Nothing per head is ever built from the cache.

The model hands `forward` q `[T, H, nope + rope]` and the new latent rows `[T, 1, D]` as
both k and v; the output is `[T, H, v_head_dim]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from worker.attention.torch_native import TorchNativeBackend
from worker.cache_view import CacheView
from worker.model.config import MlaConfig


class MlaTorchBackend(TorchNativeBackend):
    """Prompt/decode grouping as the torch backend's; `absorb=False` decodes the naive way
    (the reference the absorbed form is tested against). `fixed_width`: decode reads every
    slot of a request's row under a length mask, so its shapes never change and a CUDA
    graph can hold it (costs a full-row read per step: a reference, not a kernel)."""

    def __init__(
        self,
        mla: MlaConfig,
        num_heads: int,
        kv_b: Sequence[torch.Tensor],
        *,
        absorb: bool = True,
        fixed_width: bool = False,
    ):
        super().__init__(num_heads, mla.qk_head_dim)
        self.mla, self.scale, self.absorb = mla, mla.softmax_scale, absorb
        self.supports_graph = self.fixed_width = fixed_width
        self.kv_b = list(kv_b)
        per_head = [w.view(num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1) for w in kv_b]
        self.w_uk = [w[:, : mla.qk_nope_head_dim] for w in per_head]  # [H, nope, rank]
        self.w_uv_t = [
            w[:, mla.qk_nope_head_dim :].transpose(1, 2) for w in per_head
        ]  # [H, rank, v]

    def _decode_width(self, view: CacheView, lens: list[int]) -> int:
        return view.req_to_token.shape[1] if self.fixed_width else max(lens)

    def fwd_decode(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor:
        out = q.new_empty((*q.shape[:2], self.mla.v_head_dim))
        self._attend_decode(layer, q, view, out)
        return out

    def fwd_prefill(self, layer: int, q: torch.Tensor, view: CacheView) -> torch.Tensor:
        out = q.new_empty((*q.shape[:2], self.mla.v_head_dim))
        if self._group is not None:
            self._attend_decode(layer, q, view, out)
        for s in self._seqs:
            k, v = self._expand(layer, view.k_cache[layer].index_select(0, s.slots)[:, 0])
            o = F.scaled_dot_product_attention(
                q[s.start : s.start + s.q_len].transpose(0, 1),  # [H, q_len, qk]
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=s.mask,
                is_causal=s.mask is None,
                scale=self.scale,
            )
            out[s.start : s.start + s.q_len] = o.transpose(0, 1)
        return out

    def _expand(self, layer: int, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head K `[L, H, nope + rope]` and V `[L, H, v]` from latent rows `[L, D]`."""
        m, n = self.mla, latent.shape[0]
        c, k_pe = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = F.linear(c, self.kv_b[layer]).view(n, self.num_heads, -1)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(n, self.num_heads, -1)), dim=-1)
        return k, v

    def _attend_decode(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor
    ) -> None:
        g = self._group
        assert g is not None
        qd = q if g.token_index is None else q[g.token_index]  # [B, H, qk]
        b, width = g.slots.shape
        latent = view.k_cache[layer].index_select(0, g.slots.view(-1))  # [B * W, 1, D]
        if self.absorb:
            o = self._absorbed(layer, qd, latent.view(b, 1, width, -1), g.mask)
        else:
            o = self._naive(layer, qd, latent.view(b * width, -1), g.mask)
        if g.token_index is None:
            out.copy_(o)
        else:
            out[g.token_index] = o

    def _absorbed(
        self, layer: int, q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q `[B, H, qk]`, latent `[B, 1, W, D]`, mask `[B, 1, 1, W]` -> `[B, H, v]`."""
        query = self._latent_query(layer, q).unsqueeze(1)  # [B, 1, H, D]
        values = latent[..., : self.mla.kv_lora_rank]
        o = F.scaled_dot_product_attention(query, latent, values, attn_mask=mask, scale=self.scale)
        return self._head_values(layer, o[:, 0])

    def _latent_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q `[B, H, nope + rope]` -> `[B, H, rank + rope]`: W_UK folded into q_nope."""
        m = self.mla
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk[layer]).transpose(0, 1)
        return torch.cat((q_latent, q_pe), dim=-1)

    def _head_values(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """Attention over latents `[B, H, rank]` -> each head's values `[B, H, v]` (W_UV)."""
        return torch.bmm(o.transpose(0, 1), self.w_uv_t[layer]).transpose(0, 1)

    def _naive(
        self, layer: int, q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """As `_absorbed`, by expanding every latent row into per-head K and V first."""
        b, width = mask.shape[0], mask.shape[-1]
        k, v = self._expand(layer, latent)
        k = k.view(b, width, self.num_heads, -1).transpose(1, 2)  # [B, H, W, qk]
        v = v.view(b, width, self.num_heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=self.scale)
        return o[:, :, 0]
