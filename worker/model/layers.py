"""Building blocks of the Llama family, written to match HF transformers' numerics exactly."""

from __future__ import annotations

import math

import torch
from torch import nn

from worker.model.config import ModelConfig, yarn_mscale


class RMSNorm(nn.Module):
    """HF's RMSNorm parameters; the model applies them through its ModelOps (worker/model/ops.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim: normalise in float32, cast back, then scale."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for RoPE: default, linear, llama3 or yarn frequency scaling."""
    dim = cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    kind = scaling.get("rope_type", "default")
    if kind == "yarn":
        return _yarn_inv_freq(cfg.rope_theta, dim, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`, op for op."""
    factor, old_len = float(p["factor"]), p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1.0 for every other RoPE)."""
    p = cfg.rope_scaling
    if p.get("rope_type") != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = float(p["factor"])
    if p.get("mscale") and p.get("mscale_all_dim"):
        return yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"])
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin tables built once; `forward` gathers a step's rows."""

    cos: torch.Tensor  # float32 [max_len, rope_dim], a buffer
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = rope_attention_factor(cfg)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:  # YaRN scales the tables in float32, as transformers does
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[T, 1, head_dim]` in the activation dtype, as HF casts them."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(
            1
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, head_dim]`; rotate-half convention (HF), never interleaved pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MergedLinear(nn.Linear):
    """One matmul for several HF projections (q|k|v, gate|up); `shards` gives each one's rows."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards.items():
            self.shards[name] = (start, rows)
            start += rows
