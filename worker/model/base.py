"""CausalLM: what the loader, the executor and the graph runners use of any model, and the
pre-norm decoder stack every supported model shares (HF's `model.` backbone)."""

from __future__ import annotations

import torch
from torch import nn

from worker.attention.base import AttentionBackend
from worker.cache_view import CacheView
from worker.model.config import ModelConfig
from worker.model.layers import RMSNorm, RotaryEmbedding
from worker.model.ops import ModelOps, RopeInputs, TorchOps


class DecoderLayer(nn.Module):
    """Pre-norm residual block around any attention and MLP of this call shape (DeepSeek's too)."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
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
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before adding it); the next layer's
        norm (or the final one) adds them. The first layer gets residual None. `keep`: the
        rows that go on past attention (which needs every row's K/V), the others dropped."""
        norm, post = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            x, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn(x, rope, view, backend, ops)
        if keep is not None:
            x, residual = x.index_select(0, keep), residual.index_select(0, keep)
        x, residual = ops.add_rms_norm(x, residual, post.weight, post.eps)
        return self.mlp(x, ops), residual


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """HF's `model.` backbone (`embed_tokens`, pre-norm `layers`, `norm`), RoPE tables and
    an LM head, over one packed ragged batch with a CacheView and an attention backend."""

    model: Backbone

    def __init__(self, cfg: ModelConfig, max_len: int, ops: ModelOps | None, backbone: Backbone):
        super().__init__()
        self.config = cfg
        self.ops = ops or TorchOps()
        self.model = backbone
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
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm for a packed batch of T tokens; with
        `keep` (row indices), those rows' only, `[len(keep), hidden]`. Nothing reads the last
        layer's output at the other rows, so its MLP, most of a layer's FLOPs, skips them."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rope_inputs(positions, x.dtype)
        residual: torch.Tensor | None = None
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            rows = keep if i == last else None
            x, residual = layer(x, residual, rope, view, backend, self.ops, rows)
        norm = self.model.norm
        if residual is None:
            return self.ops.rms_norm(x, norm.weight, norm.eps)
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        return self.ops.rope_inputs(self.rotary, positions, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        embed = self.model.embed_tokens
        weight = embed.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight).float()

    def ignores(self, hf_name: str) -> bool:
        """A checkpoint tensor this model does not use (the loader skips it)."""
        return False

    def after_load(self) -> None:
        """Once the weights are in: rearrange them for the forward (the loader calls it)."""
