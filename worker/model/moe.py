"""DeepSeek's mixture of experts: a router picks top-k routed experts per token, and shared
experts see every token. Written op for op as transformers 5.24 computes it.

The routed experts run as a loop over the experts that received tokens, in expert order,
each on its own tokens (transformers' order of additions, so float32 results match). That
loop reads the routing on the host, so an MoE layer cannot sit inside a CUDA graph; a
grouped GEMM over tokens sorted by expert is the GPU form still to write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig, MoeConfig
from worker.model.llama import MLP
from worker.model.ops import ModelOps


class Router(nn.Module):
    """HF's `mlp.gate`: float32 scores -> (expert ids, weights) `[T, top_k]` each."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size))
        # V3's bias on the scores used for choosing (not for weighting), a buffer in HF
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts)) if moe.scoring == "sigmoid" else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        if self.moe.scoring == "softmax":
            ids, weights = self._v2(logits.softmax(dim=-1, dtype=torch.float32))
        else:
            ids, weights = self._v3(logits.sigmoid())
        return ids, weights * self.moe.routed_scaling_factor

    def _v2(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.moe
        if m.topk_method == "group_limited_greedy":
            group_best = scores.view(-1, m.num_groups, m.num_experts // m.num_groups).amax(-1)
            scores = scores.masked_fill(~self._group_mask(group_best), 0.0)
        weights, ids = torch.topk(scores, k=m.top_k, dim=-1, sorted=False)
        return ids, weights

    def _v3(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.moe
        assert self.e_score_correction_bias is not None
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(-1, m.num_groups, m.num_experts // m.num_groups)
        group_score = per_group.topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._group_mask(group_score), float("-inf"))
        ids = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights

    def _group_mask(self, group_score: torch.Tensor) -> torch.Tensor:
        """Bool `[T, num_experts]`: the experts of each token's `topk_groups` best groups."""
        m = self.moe
        best = torch.topk(group_score, k=m.topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_score).scatter_(1, best, 1).bool()
        return mask.repeat_interleave(m.num_experts // m.num_groups, dim=1)


class MoE(nn.Module):
    """HF's `DeepseekV{2,3}MoE`: routed experts (`experts.N.*`) plus `shared_experts`."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig):
        super().__init__()
        self.gate = Router(cfg, moe)
        # transformers' experts have no bias; its shared experts follow mlp_bias (V2)
        self.experts = nn.ModuleList(
            MLP(cfg, moe.intermediate_size, bias=False) for _ in range(moe.num_experts)
        )
        self.shared_experts = MLP(cfg, moe.intermediate_size * moe.num_shared_experts)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        ids, weights = self.gate(x)
        routed = torch.zeros_like(x)
        counts = torch.bincount(ids.view(-1), minlength=len(self.experts)).tolist()
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slot, token = torch.where(e == ids.T)  # transformers' row order
            out = self.experts[e](x[token], ops) * weights[token, slot, None]
            routed.index_add_(0, token, out.to(x.dtype))
        return routed + self.shared_experts(x, ops)
