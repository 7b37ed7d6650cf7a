"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and, after the first dense layers, MoE.

Per token and layer the KV cache holds one latent row, `[normalised compressed kv |
roped k_pe]` (kv_lora_rank + qk_rope_head_dim wide); the MLA attention backend
(worker/attention/mla.py) turns it into per-head keys and values, or folds kv_b_proj into
the query instead. Everything here matches transformers 5.24's modeling_deepseek_v2.py /
modeling_deepseek_v3.py op for op.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from worker.attention.base import AttentionBackend
from worker.cache_view import CacheView
from worker.model.base import Backbone, CausalLM, DecoderLayer
from worker.model.config import V3, MlaConfig, ModelConfig
from worker.model.layers import RMSNorm, apply_rope
from worker.model.llama import MLP
from worker.model.moe import MoE
from worker.model.ops import ModelOps, RopeInputs

# transformers builds these two norms with its default eps, not config.rms_norm_eps
_LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.mla, self.layer_id, self.num_heads = mla, layer_id, cfg.num_heads
        h, q_out = cfg.hidden_size, cfg.num_heads * mla.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.latent_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        per_head = mla.qk_nope_head_dim + mla.v_head_dim
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, cfg.num_heads * per_head, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * mla.v_head_dim, h, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        view: CacheView,
        backend: AttentionBackend,
        ops: ModelOps,
    ) -> torch.Tensor:
        mla, n = self.mla, x.shape[0]
        q = self._query(x, ops).view(n, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed = ops.linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
        kv, k_pe = compressed.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        norm = self.kv_a_layernorm
        kv = ops.rms_norm(kv, norm.weight, norm.eps)
        q_pe, k_pe = mla_rope(q_pe, k_pe.unsqueeze(1), rope, mla)
        latent = torch.cat((kv.unsqueeze(1), k_pe), dim=-1)  # [T, 1, latent_dim]
        # The latent is both K and V: the backend stores one row and reads V as its kv part.
        out = backend.forward(
            self.layer_id, torch.cat((q_nope, q_pe), dim=-1), latent, latent, view
        )
        return ops.linear(out.reshape(n, -1), self.o_proj.weight, self.o_proj.bias)

    def _query(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        if self.q_proj is not None:
            return ops.linear(x, self.q_proj.weight)
        assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
        norm = self.q_a_layernorm
        q = ops.rms_norm(
            ops.linear(x, self.q_a_proj.weight, self.q_a_proj.bias), norm.weight, norm.eps
        )
        return ops.linear(q, self.q_b_proj.weight)


def mla_rope(
    q_pe: torch.Tensor, k_pe: torch.Tensor, rope: RopeInputs, mla: MlaConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the rope parts, q `[T, H, R]` and k `[T, 1, R]`.

    DeepSeek rotates adjacent pairs (x0, x1), (x2, x3)...; moving the even dims before the
    odd ones turns that into rotate-half RoPE with the same products, term for term (what
    transformers' `apply_rotary_pos_emb_interleave` does). q and k move alike, so their dot
    products, and the cache rows that only ever meet a rotated q, stay the same."""
    dtype = q_pe.dtype
    if mla.rope_in_float32:
        q_pe, k_pe = q_pe.float(), k_pe.float()
    if mla.rope_interleave:
        q_pe, k_pe = _evens_then_odds(q_pe), _evens_then_odds(k_pe)
    q_pe, k_pe = apply_rope(q_pe, rope.cos, rope.sin), apply_rope(k_pe, rope.cos, rope.sin)
    return q_pe.to(dtype), k_pe.to(dtype)


def _evens_then_odds(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (the config says which)."""

    def __init__(self, cfg: ModelConfig, max_len: int, ops: ModelOps | None = None):
        moe = cfg.moe
        layers = [
            DecoderLayer(
                cfg,
                MlaAttention(cfg, i),
                MoE(cfg, moe) if moe and i >= moe.first_k_dense_replace else MLP(cfg),
            )
            for i in range(cfg.num_layers)
        ]
        super().__init__(cfg, max_len, ops, Backbone(cfg, layers))
        # V3 checkpoints carry multi-token-prediction layers after the last one; unused here
        self._extra_layer = re.compile(r"model\.layers\.(\d+)\.")

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        mla = self.config.mla
        assert mla is not None
        cos, sin = self.rotary(positions, torch.float32 if mla.rope_in_float32 else dtype)
        return RopeInputs(positions, cos, sin)

    def ignores(self, hf_name: str) -> bool:
        m = self._extra_layer.match(hf_name)
        return (
            self.config.architecture == V3
            and m is not None
            and int(m.group(1)) >= self.config.num_layers
        )

    def after_load(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.stack_experts()

    def kv_b_weights(self) -> list[torch.Tensor]:
        """Each layer's kv_b_proj weight `[H * (nope + v), kv_lora_rank]`, for the backend."""
        weights = []
        for layer in self.model.layers:
            attn = layer.self_attn
            assert isinstance(attn, MlaAttention)
            weights.append(attn.kv_b_proj.weight)
        return weights
