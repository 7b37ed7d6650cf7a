"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over one packed ragged batch.

The model sees flat token ids and positions for the whole step, a CacheView for KV and an
attention backend; it never knows which cache or kernel runs underneath.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.attention.base import AttentionBackend
from worker.cache_view import CacheView
from worker.model.base import Backbone, CausalLM, DecoderLayer
from worker.model.config import ModelConfig
from worker.model.layers import MergedLinear, RMSNorm
from worker.model.ops import ModelOps, RopeInputs


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = MergedLinear(
            cfg.hidden_size,
            {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size},
            bias=cfg.qkv_bias,
        )
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        view: CacheView,
        backend: AttentionBackend,
        ops: ModelOps,
    ) -> torch.Tensor:
        n = x.shape[0]
        out = self._attend_stored(x, rope, view, backend, ops)
        if out is None:
            qkv = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            v = v.view(n, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
                k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
            if backend.applies_rope:
                out = backend.forward(self.layer_id, q, k, v, view, rope)
            else:
                q, k = ops.rope(q, k, rope)
                out = backend.forward(self.layer_id, q, k, v, view)
        return ops.linear(out.reshape(n, self.q_size), self.o_proj.weight, self.o_proj.bias)

    def _attend_stored(
        self, x: torch.Tensor, rope: RopeInputs, view: CacheView, backend: AttentionBackend,
        ops: ModelOps,
    ) -> torch.Tensor | None:  # fmt: skip
        """Attention after a projection kernel that rotates q and k and writes K/V itself
        (CudaOps' skinny GEMM), where the backend and the ops offer one; else None. Not with q/k
        norms, which come between the projection and the rotation."""
        dest = backend.kv_destination(self.layer_id, view) if self.q_norm is None else None
        if dest is None:
            return None
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        qkv = ops.qkv_rope_store(x, w, b, rope, dest, self.num_heads)
        if qkv is None:
            return None
        n = x.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        new_kv = (
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
        )
        return backend.attend(self.layer_id, q.view(n, self.num_heads, self.head_dim), view, new_kv)


class MLP(nn.Module):
    """SiLU-gated MLP; `intermediate_size` / `bias` default to the config's (DeepSeek's experts differ)."""

    def __init__(
        self, cfg: ModelConfig, intermediate_size: int | None = None, bias: bool | None = None
    ):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        bias = cfg.mlp_bias if bias is None else bias
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, bias=bias
        )
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        act = ops.gated_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return ops.linear(act, self.down_proj.weight, self.down_proj.bias)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_len: int, ops: ModelOps | None = None):
        layers = [DecoderLayer(cfg, Attention(cfg, i), MLP(cfg)) for i in range(cfg.num_layers)]
        super().__init__(cfg, max_len, ops, Backbone(cfg, layers))
