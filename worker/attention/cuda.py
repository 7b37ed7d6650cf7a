"""CudaBackend: kvray's csrc kernels — fused KV store, split-KV paged decode, ragged prefill —
and, for prompt chunks where it is faster, torch's FlashAttention-2 over gathered K/V (flash.py).

Decode writes into the workspace's `decode_out` / `decode_o_part` / `decode_ml_part` and its
launch grid depends on shapes only, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from worker.attention import cuda_ops, flash
from worker.attention.base import AttentionBackend
from worker.batch import ForwardBatch
from worker.cache_view import CacheView
from worker.workspace import InferenceWorkspace


class CudaBackend(AttentionBackend):
    supports_graph = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        workspace: InferenceWorkspace,
        prefill_kernel: str = "auto",
    ):
        cuda_ops.load()  # build (or load the cached build) now, not inside the first step
        self.scale = head_dim**-0.5
        self.ws = workspace
        # "kvray": always kvray's kernel; "flash": FlashAttention-2 wherever it runs; "auto":
        # per batch, by `flash.prefers_flash`.
        self.prefill_kernel = prefill_kernel
        if prefill_kernel == "flash" and not flash.available(workspace.decode_out.dtype, head_dim):
            raise RuntimeError("prefill_kernel=flash: torch's FlashAttention-2 does not run here")
        self._batch: ForwardBatch | None = None
        self._plan: flash.GatherPlan | None = None

    def prepare(self, batch: ForwardBatch, view: CacheView) -> None:
        self._batch = batch
        self._decode = batch.is_decode
        # A batch that mixes decodes with prompt chunks sends its leading one-token rows (the
        # scheduler puts decodes first) to the decode kernel, since the prefill kernel would
        # give each a 64-query tile per head that is almost all idle.
        self._num_leading_decodes = 0
        self._plan = None
        if not self._decode:
            d = 0
            for n in batch.q_lens:
                if n != 1:
                    break
                d += 1
            self._num_leading_decodes = d
            self._rest_qo_indptr = batch.qo_indptr[d:] - d if d else batch.qo_indptr
            self._plan = self._gather_plan(batch, view, d)

    def _gather_plan(self, batch: ForwardBatch, view: CacheView, d: int) -> flash.GatherPlan | None:
        """The packed K/V layout for FlashAttention when this step's prompt rows go to it."""
        q_lens = batch.q_lens[d:]
        mode, dtype, head_dim = self.prefill_kernel, view.k_cache.dtype, view.k_cache.shape[-1]
        if mode == "kvray" or (mode == "auto" and not flash.prefers_flash(q_lens)):
            return None
        if not flash.available(dtype, head_dim):
            return None
        return flash.GatherPlan.build(
            view.req_to_token,
            batch.req_pool_indices[d:],
            batch.seq_lens[d:],
            self._rest_qo_indptr,
            q_lens,
            batch.seq_lens_host[d:],
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: CacheView,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """As the protocol's; `out` `[T, Hq, D]` receives the result (the piecewise prompt
        graphs read it from a fixed address)."""
        assert self._batch is not None
        cuda_ops.store_kv(k, v, view.k_cache[layer], view.v_cache[layer], self._batch.out_cache_loc)
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
        )
        return out

    def fwd_prefill(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, ws, d = self._batch, self.ws, self._num_leading_decodes
        assert b is not None
        k_cache, v_cache = view.k_cache[layer], view.v_cache[layer]
        if self._plan is not None and d == 0 and out is None:
            return flash.prefill(q, k_cache, v_cache, self._plan, self.scale)
        if out is None:
            out = torch.empty_like(q)
        if d:
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
            )
        if self._plan is not None:
            out[d:].copy_(flash.prefill(q[d:], k_cache, v_cache, self._plan, self.scale))
            return out
        # fmt: skip
        cuda_ops.prefill_attention(
            q[d:],
            k_cache,
            v_cache,
            view.req_to_token,
            b.req_pool_indices[d:],
            b.seq_lens[d:],
            self._rest_qo_indptr,
            view.page_size,
            self.scale,
            out[d:],
        )
        return out
