"""ForwardBatch: one step's packed (ragged) batch, as views into the InferenceWorkspace."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DecodeSteadyState:
    """This step is the last one plus one token for the same ordered requests (decided once, by
    `_is_steady_increment` in cache.py): metadata was advanced in place on the device, the
    inputs are last step's sampled ids, and the sampling batch of last step still applies."""

    batch_size: int


@dataclass
class ForwardBatch:
    """Device tensors are slices of workspace buffers; host lists are what the scheduler knew."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] int32: each request's row of req_to_token
    seq_lens: torch.Tensor  # [B] int32: KV length after this step
    # [B+1] int32: where each request's new tokens start in the packed batch
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor  # [B+1] int32: prefix sums of seq_lens
    logits_indices: torch.Tensor  # [B] int64: last new token of each request
    q_lens: list[int]
    seq_lens_host: list[int]
    rows_host: list[int]  # req_pool_indices on the host
    steady: DecodeSteadyState | None = None
    # [S] int64: the requests that sample this step, in order; None when all of them do. A
    # device tensor staged with the metadata, because indexing the logits with a host list
    # would copy it from pageable memory, and that copy waits for the whole device stream.
    sample_rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.batch_size
