"""InferenceWorkspace: every fixed-address buffer a step touches, allocated once.

The executor writes into slices of these; CUDA graphs capture their addresses. The step
metadata lives in one buffer with a host twin of the same layout (pinned on CUDA): a
non-steady step fills the twin with numpy and moves it all in one copy.
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

        # The metadata a bind fills from the host, in one block with a host twin of the same
        # layout, so that a bind issues one copy rather than one per field. int64: ids,
        # positions and slots a token; logits rows, row bases (row * max_seq_len, for the
        # steady slot lookup) and sample rows a request; the carry (input index, sampled row);
        # then int32: rows, lens, qo and kv. Each field starts on 64 bytes, as allocations do.
        sizes = _meta_sizes(max_tokens, max_running)
        self.meta = i64(sum(sizes))
        self.host_meta = torch.zeros(
            sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        tokens, requests, carry, ints = _meta_fields(self.meta, sizes)
        self.input_ids, self.positions, self.out_cache_loc = tokens[:, :max_tokens]
        self.logits_indices, self.row_base, self.sample_rows = requests[:, :max_running]
        self.carry = carry[:, :max_running]
        self.req_pool_indices, self.seq_lens = ints[:2, :max_running]
        self.qo_indptr, self.kv_indptr = ints[2:, : max_running + 1]
        # the same fields on the host, whole rows (binds slice them)
        self.host_i64, self.host_logits, self.host_carry, self.host_i32 = _meta_fields(
            self.host_meta, sizes
        )
        self.next_token_ids = i64(max_running)
        self.arange = torch.arange(max_running + 1, dtype=torch.int32, device=device)
        self.flat_loc = i64(max_running)
        self.loc_i32 = i32(max_running)
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

    def last_rows(self, num_tokens: int) -> torch.Tensor | None:
        """The rows a step of `num_tokens` tokens carries past its last layer's attention when
        only each request's last token is read (CausalLM's `keep`): `logits_indices`, whole,
        which the bind pads with row 0, so that a prompt graph holds a fixed count. None, every
        row, where that count is no smaller than the step."""
        return self.logits_indices if num_tokens > self.max_running else None


def _meta_sizes(max_tokens: int, max_running: int) -> list[int]:
    """int64 units of the metadata block's four parts, each a whole number of 64 bytes."""
    t, r = _round_up(max_tokens, 8), _round_up(max_running, 8)
    return [3 * t, 3 * r, 2 * r, 2 * _round_up(max_running + 1, 16)]


def _meta_fields(block: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The block's parts as rows: [ids, positions, slots], [logits rows, row bases, sample
    rows], [carry input index, carry sampled row] (int64), [rows, lens, qo, kv] (int32)."""
    tokens, requests, carry, ints = block.split(sizes)
    return [
        tokens.view(3, -1),
        requests.view(3, -1),
        carry.view(2, -1),
        ints.view(torch.int32).view(4, -1),
    ]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
