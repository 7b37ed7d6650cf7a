"""InferenceWorkspace: every fixed-address buffer a step touches, allocated once.

The executor writes into slices of these; CUDA graphs capture their addresses. Host
staging twins (pinned on CUDA) let a non-steady step fill metadata with numpy and copy
each buffer once.
"""

from __future__ import annotations

import torch

from worker.attention.cuda_ops import recommended_max_splits


class InferenceWorkspace:
    def __init__(
        self,
        *,
        max_tokens: int,
        max_running: int,
        max_seq_len: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        split_kv: bool,
    ):
        self.max_tokens, self.max_running, self.device = max_tokens, max_running, device

        def i64(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self.input_ids = i64(max_tokens)
        self.positions = i64(max_tokens)
        self.out_cache_loc = i64(max_tokens)
        self.req_pool_indices = i32(max_running)
        self.seq_lens = i32(max_running)
        self.qo_indptr = i32(max_running + 1)
        self.kv_indptr = i32(max_running + 1)
        self.logits_indices = i64(max_running)
        self.sample_rows = i64(max_running)  # tasks that sample, when some do not (prompt chunks)
        self.next_token_ids = i64(max_running)
        self.arange = torch.arange(max_running + 1, dtype=torch.int32, device=device)
        self.row_base = i64(max_running)  # row * max_seq_len, for the steady slot lookup
        self.flat_loc = i64(max_running)
        self.loc_i32 = i32(max_running)
        # input index, sampled row
        self.carry = torch.zeros((2, max_running), dtype=torch.int64, device=device)
        self.carried_ids = i64(max_running)
        # Split-KV decode: the split count follows the longest possible sequence, never live lengths.
        self.num_kv_splits = recommended_max_splits(max_seq_len) if split_kv else 0
        s = self.num_kv_splits
        self.decode_out = torch.zeros(
            (max_running if s else 0, num_heads, head_dim), dtype=dtype, device=device
        )
        self.decode_o_part = torch.zeros(
            (max_running if s else 0, num_heads, s, head_dim), dtype=torch.float32, device=device
        )
        self.decode_ml_part = torch.zeros(
            (max_running if s else 0, num_heads, s, 2), dtype=torch.float32, device=device
        )
        # finished splits per (request, head): the last one merges the partials in the kernel
        self.decode_counters = i32(max_running * num_heads if s else 0)
        pin = device.type == "cuda"
        # ids, positions, slots
        self.host_i64 = torch.zeros((3, max_tokens), dtype=torch.int64, pin_memory=pin)
        # rows, lens, qo, kv
        self.host_i32 = torch.zeros((4, max_running + 1), dtype=torch.int32, pin_memory=pin)
        # logits rows, row bases, sample rows
        self.host_logits = torch.zeros(3 * max_running, dtype=torch.int64, pin_memory=pin)
        self.host_carry = torch.zeros((2, max_running), dtype=torch.int64, pin_memory=pin)
