"""MlaCudaBackend: MLA decode through csrc's absorbed kernel (csrc/mla.cu).

Decode rows run the absorbed form as MlaTorchBackend's does (W_UK folded into the query,
W_UV applied to the result, both in torch), with the attention itself in one kernel that
reads each request's latent rows once for every head, straight from the paged cache: no
row is gathered, padded or expanded. Prompts keep the torch backend's naive form. Its
launches depend only on the batch size, so decode CUDA graphs hold it. The kernel is built
for DeepSeek-V2/V3's latent width (kv_lora_rank 512 + rope 64) in bf16 or fp16: `supported`
says whether a model has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.attention import cuda_ops
from worker.attention.mla import MlaTorchBackend
from worker.batch import ForwardBatch
from worker.cache_view import CacheView
from worker.model.config import MlaConfig


def supported(mla: MlaConfig, dtype: torch.dtype) -> bool:
    return (
        mla.kv_lora_rank == 512
        and mla.qk_rope_head_dim == 64
        and dtype in (torch.bfloat16, torch.float16)
    )


@dataclass
class _Rows:
    """The decode rows of a batch: where their tokens sit (None: all, in order), and their
    request rows and lengths as the kernel reads them (int32 on the device)."""

    token_index: torch.Tensor | None
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


class MlaCudaBackend(MlaTorchBackend):
    def __init__(
        self,
        mla: MlaConfig,
        num_heads: int,
        kv_b: Sequence[torch.Tensor],
        max_running: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        assert supported(mla, dtype), "csrc/mla.cu: kv_lora_rank 512 + rope 64, bf16 or fp16"
        super().__init__(mla, num_heads, kv_b)
        cuda_ops.load()  # build (or load the cached build) now, not inside the first step
        self.supports_graph = True
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._splits = [cuda_ops.mla_num_splits(b, num_heads, sms) for b in range(max_running + 1)]
        # partials only where a batch is split (one split writes the output directly)
        parts = max((b * num_heads * s for b, s in enumerate(self._splits) if s > 1), default=0)
        self._o_part = torch.empty(parts * mla.kv_lora_rank, dtype=torch.float32, device=device)
        self._ml_part = torch.empty(parts * 2, dtype=torch.float32, device=device)
        self._rows: _Rows | None = None

    def prepare(self, batch: ForwardBatch, view: CacheView) -> None:
        super().prepare(batch, view)  # prompts; its decode group's slots (zero width) go unread
        g = self._group
        self._rows = None
        if g is not None:
            rows, lens = batch.req_pool_indices, batch.seq_lens
            if g.sel is not None:
                rows, lens = rows[g.sel], lens[g.sel]
            self._rows = _Rows(g.token_index, rows, lens)

    def _decode_width(self, view: CacheView, lens: list[int]) -> int:
        return 0

    def _attend_decode(
        self, layer: int, q: torch.Tensor, view: CacheView, out: torch.Tensor
    ) -> None:
        rows = self._rows
        assert rows is not None
        qd = q if rows.token_index is None else q[rows.token_index]  # [B, H, qk]
        query = self._latent_query(layer, qd)
        o = query.new_empty((*query.shape[:2], self.mla.kv_lora_rank))
        cuda_ops.mla_decode(
            query,
            view.k_cache[layer],
            view.req_to_token,
            rows.req_pool_indices,
            rows.seq_lens,
            self.scale,
            o,
            self._o_part,
            self._ml_part,
            self._splits[qd.shape[0]],
        )
        values = self._head_values(layer, o)
        if rows.token_index is None:
            out.copy_(values)
        else:
            out[rows.token_index] = values
