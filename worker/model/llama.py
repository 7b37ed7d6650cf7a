"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over one packed ragged batch.

The model sees flat token ids and positions for the whole step, a CacheView for KV and an
attention backend; it never knows which cache or kernel runs underneath.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.attention.base import AttentionBackend
from worker.cache_view import CacheView
from worker.model.config import ModelConfig
from worker.model.layers import MergedLinear, RMSNorm, RotaryEmbedding
from worker.model.ops import ModelOps, RopeInputs, TorchOps


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
        qkv = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ops.rope(q, k, rope)
        out = backend.forward(self.layer_id, q, k, v, view)
        return ops.linear(out.reshape(n, self.q_size), self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size,
            {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size},
            bias=cfg.mlp_bias,
        )
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        gate_up = ops.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return ops.linear(ops.silu_and_mul(gate_up), self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        view: CacheView,
        backend: AttentionBackend,
        ops: ModelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before adding it); the next layer's
        norm (or the final one) adds them. The first layer gets residual None."""
        norm, post = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            x, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn(x, rope, view, backend, ops)
        x, residual = ops.add_rms_norm(x, residual, post.weight, post.eps)
        return self.mlp(x, ops), residual


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int, ops: ModelOps | None = None):
        super().__init__()
        self.config = cfg
        self.ops = ops or TorchOps()
        self.model = Backbone(cfg)
        self.rotary = RotaryEmbedding(cfg, max_len)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        view: CacheView,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm for a packed batch of T tokens."""
        x = self.model.embed_tokens(input_ids)
        rope = self.ops.rope_inputs(self.rotary, positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, view, backend, self.ops)
        norm = self.model.norm
        if residual is None:
            return self.ops.rms_norm(x, norm.weight, norm.eps)
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight).float()


MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
