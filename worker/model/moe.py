"""DeepSeek's mixture of experts: a router picks top-k routed experts per token, and shared
experts see every token. Written op for op as transformers 5.24 computes it.

The routed experts run as transformers' default (`grouped_mm`) computes them: (token,
expert) rows sorted by expert, one grouped GEMM over all experts' rows (torch's
`grouped_mm`, CUTLASS on CUDA), the k weighted outputs of a token summed in float32 (so
bf16 results match too, not only float32). The expert counts stay on the device, so an MoE
layer needs no host sync and a CUDA graph can hold it.
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
    """HF's `DeepseekV{2,3}MoE`: routed experts (`experts.N.*`) plus `shared_experts`.

    The checkpoint fills each expert's own MLP; `stack_experts` then moves them into one
    `[E, 2I, H]` and one `[E, H, I]` tensor (each expert's weights become views into them),
    the operands of the grouped GEMMs."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig):
        super().__init__()
        self.gate = Router(cfg, moe)
        # transformers' experts have no bias; its shared experts follow mlp_bias (V2)
        self.experts = nn.ModuleList(
            MLP(cfg, moe.intermediate_size, bias=False) for _ in range(moe.num_experts)
        )
        self.shared_experts = MLP(cfg, moe.intermediate_size * moe.num_shared_experts)
        self.gate_up_stack: torch.Tensor | None = None
        self.down_stack: torch.Tensor | None = None

    def stack_experts(self) -> None:
        """After loading: the experts' weights into the grouped GEMMs' stacked operands."""
        for name in ("gate_up_proj", "down_proj"):
            linears = [getattr(e, name) for e in self.experts]
            stacked = torch.stack([lin.weight.data for lin in linears])
            for i, lin in enumerate(linears):
                lin.weight.data = stacked[i]  # a view: the per-expert copy is freed
            setattr(self, f"{name.removesuffix('_proj')}_stack", stacked)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        """transformers' default `grouped_mm` experts: (token, expert) pairs sorted by expert,
        all experts' rows in one grouped GEMM, then each token's k weighted outputs summed in
        float32 in router order, cast once."""
        assert self.gate_up_stack is not None and self.down_stack is not None, "stack_experts()"
        ids, weights = self.gate(x)
        num_tokens, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x[order // k]
        # rows per expert, counted on the device (bincount would read its size on the host)
        ones = torch.ones_like(flat, dtype=torch.int32)
        counts = torch.zeros(len(self.experts), dtype=torch.int32, device=x.device)
        ends = counts.scatter_add_(0, flat, ones).cumsum(0, dtype=torch.int32)
        gate_up = F.grouped_mm(rows, self.gate_up_stack.transpose(1, 2), offs=ends)
        out = F.grouped_mm(ops.silu_and_mul(gate_up), self.down_stack.transpose(1, 2), offs=ends)
        weighted = torch.empty((len(flat), x.shape[1]), dtype=torch.float32, device=x.device)
        weighted[order] = out * weights.reshape(-1)[order, None]
        routed = weighted.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)
        return routed + self.shared_experts(x, ops)
