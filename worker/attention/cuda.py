"""CudaBackend: kvray's csrc kernels — fused KV store, split-KV paged decode, ragged prefill —
and for prompts FlashInfer's FlashAttention-3 over the cache in place where it runs (fa3.py),
else, for prompt chunks where it is faster, torch's FlashAttention-2 over gathered K/V
(flash.py). A lone fresh prompt's first layer runs FlashAttention-2 on its new K/V, so that
FA3's plan is made while the device computes.

Decode writes into the workspace's `decode_out` / `decode_o_part` / `decode_ml_part` and its
launch grid depends on shapes only, so a decode step can be captured in a CUDA graph.
With an FP8 cache the KV store quantizes and decode reads e4m3 with its scales; the prefill
kernels read bf16 only, so a prompt step attends over a dequantized packed copy of its
sequences' K/V (the same GatherPlan FlashAttention uses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.attention import cuda_ops, fa3, flash
from worker.attention.base import AttentionBackend, KVDestination, NewKV
from worker.attention.kv_quant import dequantize_gather
from worker.batch import ForwardBatch
from worker.cache_view import CacheView
from worker.workspace import InferenceWorkspace

if TYPE_CHECKING:
    from worker.model.ops import RopeInputs


class CudaBackend(AttentionBackend):
    supports_graph = True
    applies_rope = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        workspace: InferenceWorkspace,
        prefill_kernel: str = "auto",
    ):
        cuda_ops.load()  # build (or load the cached build) now, not inside the first step
        self.scale = head_dim**-0.5
        self.num_heads = num_heads
        self.ws = workspace
        # "kvray": always kvray's kernel; "flash": FlashAttention-2 wherever it runs; "fa3":
        # FlashInfer's FA3 for every prompt batch (not with an FP8 cache, whose per-token
        # scales FA3 lacks); "auto": fa3 where FA3 runs (`fa3.resolve`), else by shape with FA2.
        dtype = workspace.decode_out.dtype
        self.prefill_kernel = prefill_kernel = fa3.resolve(prefill_kernel, dtype, head_dim)
        if prefill_kernel == "flash" and not flash.available(dtype, head_dim):
            raise RuntimeError("prefill_kernel=flash: torch's FlashAttention-2 does not run here")
        if prefill_kernel == "fa3" and not fa3.available(dtype, head_dim):
            raise RuntimeError(
                "prefill_kernel=fa3: FlashInfer's FA3 prefill does not run here "
                "(it needs flashinfer-python and an sm_90 GPU)"
            )
        self._fa3 = fa3.Fa3Prefill(workspace.decode_out.device) if prefill_kernel == "fa3" else None
        # A lone fresh prompt (an idle engine's: the device waits for the host's first layer)
        # takes its first layer on FlashAttention-2, which needs no plan, and plans FA3 at the
        # second, while the device runs the first layer's MLP (docs/performance.md).
        self._defer_fa3 = self._fa3 is not None and flash.available(dtype, head_dim)
        self._fa3_deferred = False  # this step's FA3 plan waits for its second layer
        self._batch: ForwardBatch | None = None
        self._plan: flash.GatherPlan | None = None  # the prompt rows' K/V, when gathered
        self._flash = False
        self._fa3_planned = False  # this step's prompt rows go to FA3
        self._packed: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # the decode kernel variant a launch of B rows passes, at index B (0, the kernels'
        # automatic pick, past its end): the layout decode_layout.choose measured faster on
        # this GPU at B's bucket, set before graph capture
        self.decode_variants: list[int] = []

    def prepare(self, batch: ForwardBatch, view: CacheView) -> None:
        self._batch = batch
        self._decode = batch.is_decode
        # A batch that mixes decodes with prompt chunks sends its leading one-token rows (the
        # scheduler puts decodes first) to the decode kernel, since the prefill kernel would
        # give each a 64-query tile per head that is almost all idle.
        self._num_leading_decodes = 0
        self._plan, self._flash, self._packed = None, False, None
        self._fa3_planned, self._fa3_deferred = False, False
        if self._decode:
            return
        d = 0
        for n in batch.q_lens:
            if n != 1:
                break
            d += 1
        self._num_leading_decodes = d
        self._rest_qo_indptr = batch.qo_indptr[d:] - d if d else batch.qo_indptr
        # FA3 beats kvray's kernel on short chunks too (97 against 54 TFLOP/s on 64 chunks of
        # 32), where FlashAttention-2 does not
        if self._fa3 is not None and view.k_scale is None:
            lone_fresh = len(batch.q_lens) == 1 and batch.q_lens == batch.seq_lens_host
            if self._defer_fa3 and lone_fresh:
                self._fa3_deferred = True
            else:
                self._plan_fa3(batch, view, d)
            return
        self._flash = self._wants_flash(batch.q_lens[d:], view)
        if self._flash or view.k_scale is not None:
            kv_indptr = batch.kv_indptr[d:] - batch.kv_indptr[d] if d else batch.kv_indptr
            self._plan = flash.GatherPlan.build(
                view.req_to_token_host,
                batch.rows_host[d:],
                self._rest_qo_indptr,
                kv_indptr,
                batch.q_lens[d:],
                batch.seq_lens_host[d:],
            )
        if self._plan is not None and not self._flash:
            # kvray's kernel over the packed copy: one page per sequence, longer than any of
            # them, whose first slot is where the sequence starts in the copy.
            table = self._plan.cu_k[:-1].view(-1, 1)
            rows = torch.arange(table.shape[0], dtype=torch.int32, device=table.device)
            self._packed = table, rows, self._plan.max_k + 1

    def _plan_fa3(self, batch: ForwardBatch, view: CacheView, d: int) -> None:
        assert self._fa3 is not None
        q_lens, kv_lens = batch.q_lens[d:], batch.seq_lens_host[d:]
        slots = None  # no cached context: FA3 reads the new K/V, not the cache
        if q_lens != kv_lens:
            device = view.k_cache.device
            slots = flash.context_slots(
                view.req_to_token_host, batch.rows_host[d:], kv_lens, device
            )
        k_cache = view.k_cache[0]
        self._fa3.plan(
            slots, q_lens, kv_lens, self.num_heads, k_cache.shape[1], k_cache.shape[2],
            k_cache.dtype, self.scale,
        )  # fmt: skip
        self._fa3_planned = True

    def _wants_flash(self, q_lens: list[int], view: CacheView) -> bool:
        mode = self.prefill_kernel
        if mode == "kvray" or (mode != "flash" and not flash.prefers_flash(q_lens)):
            return False
        dtype = self.ws.decode_out.dtype
        return flash.available(dtype, view.k_cache.shape[-1])

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: CacheView,
        rope: RopeInputs | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """As the protocol's; `out` `[T, Hq, D]` receives the result (the piecewise prompt
        graphs read it from a fixed address)."""
        assert self._batch is not None
        k_cache, v_cache, loc = view.k_cache[layer], view.v_cache[layer], self._batch.out_cache_loc
        k_scale, v_scale = _scales(view, layer)
        if rope is not None and k_scale is None:  # one kernel a layer fewer in every step
            cuda_ops.rotary_store_kv(
                q, k, v, rope.positions, rope.cos, rope.sin, k_cache, v_cache, loc
            )
        else:
            if rope is not None:
                cuda_ops.rotary(q, k, rope.positions, rope.cos, rope.sin)
            cuda_ops.store_kv(k, v, k_cache, v_cache, loc, k_scale, v_scale)
        if self._decode:
            return self.fwd_decode(layer, q, view, out)
        return self.fwd_prefill(layer, q, view, out, new_kv=(k, v))

    def attend(
        self, layer: int, q: torch.Tensor, view: CacheView, new_kv: NewKV | None = None
    ) -> torch.Tensor:
        """As the protocol's, `new_kv` handed on to the prompt kernels (FA3's ragged plan)."""
        if self._decode:
            return self.fwd_decode(layer, q, view)
        return self.fwd_prefill(layer, q, view, new_kv=new_kv)

    def kv_destination(self, layer: int, view: CacheView) -> KVDestination | None:
        """The layer's caches when they hold bf16 / fp16 (an FP8 cache quantizes whole rows
        in store_kv)."""
        assert self._batch is not None
        if _scales(view, layer)[0] is not None:
            return None
        return KVDestination(view.k_cache[layer], view.v_cache[layer], self._batch.out_cache_loc)

    def fwd_decode(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        b = self._batch
        assert b is not None
        if out is None:
            out = self.ws.decode_out[: q.shape[0]]
        self._decode_rows(layer, q, view, out, b.req_pool_indices, b.seq_lens)
        return out

    def _decode_rows(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor,
        rows: torch.Tensor, seq_lens: torch.Tensor,
    ) -> None:  # fmt: skip
        k_scale, v_scale = _scales(view, layer)
        n, variants = q.shape[0], self.decode_variants
        # fmt: skip
        cuda_ops.decode_attention(
            q,
            view.k_cache[layer],
            view.v_cache[layer],
            view.req_to_token,
            rows,
            seq_lens,
            view.page_size,
            self.scale,
            out,
            self.ws.decode_o_part,
            self.ws.decode_ml_part,
            variant=variants[n] if n < len(variants) else 0,
            k_scale=k_scale,
            v_scale=v_scale,
            counters=self.ws.decode_counters,
        )

    def fwd_prefill(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor | None = None,
        new_kv: NewKV | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """`new_kv`: the rows a ragged FA3 plan reads instead of the cache."""
        b, d, plan = self._batch, self._num_leading_decodes, self._plan
        assert b is not None
        if self._fa3_deferred:
            if layer == 0:
                assert new_kv is not None, "a lone fresh prompt attends over its new K/V"
                n = q.shape[0]
                result = flash.fresh(q, *new_kv, b.qo_indptr, n, self.scale)
                return result if out is None else out.copy_(result)
            self._plan_fa3(b, view, 0)
            self._fa3_deferred = False
        if self._fa3_planned:
            assert self._fa3 is not None
            if self._fa3.ragged:
                assert new_kv is not None, "a ragged FA3 plan reads the step's new K/V"
                k, v = new_kv[0][d:], new_kv[1][d:]
            else:
                k, v = view.k_cache[layer], view.v_cache[layer]
            if d == 0:
                return self._fa3.run(q, k, v, out)
            if out is None:
                out = torch.empty_like(q)
            self._decode_rows(layer, q[:d], view, out[:d], b.req_pool_indices[:d], b.seq_lens[:d])
            self._fa3.run(q[d:], k, v, out[d:])
            return out
        if self._flash and plan is not None and d == 0 and out is None:
            return flash.attend(q, *self._gathered(layer, view, q.dtype), plan, self.scale)
        if out is None:
            out = torch.empty_like(q)
        if d:
            self._decode_rows(layer, q[:d], view, out[:d], b.req_pool_indices[:d], b.seq_lens[:d])
        if self._flash and plan is not None:
            k, v = self._gathered(layer, view, q.dtype)
            out[d:].copy_(flash.attend(q[d:], k, v, plan, self.scale))
            return out
        if self._packed is not None:
            k, v = self._gathered(layer, view, q.dtype)
            table, rows, page = self._packed
        else:
            k, v, table = view.k_cache[layer], view.v_cache[layer], view.req_to_token
            rows, page = b.req_pool_indices[d:], view.page_size
        # fmt: skip
        cuda_ops.prefill_attention(
            q[d:],
            k,
            v,
            table,
            rows,
            b.seq_lens[d:],
            self._rest_qo_indptr,
            page,
            self.scale,
            out[d:],
        )
        return out

    def _gathered(
        self, layer: int, view: CacheView, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt rows' K/V packed by the step's plan; dequantized from an FP8 cache."""
        plan = self._plan
        assert plan is not None
        k_scale, v_scale = _scales(view, layer)
        if k_scale is None or v_scale is None:
            return plan.gather(view.k_cache[layer], view.v_cache[layer])
        k = dequantize_gather(view.k_cache[layer], k_scale, plan.slots, dtype)
        v = dequantize_gather(view.v_cache[layer], v_scale, plan.slots, dtype)
        return k, v


def _scales(view: CacheView, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This layer's K and V scales of an FP8 cache, else (None, None)."""
    if view.k_scale is None or view.v_scale is None:
        return None, None
    return view.k_scale[layer], view.v_scale[layer]
