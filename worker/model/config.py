"""ModelConfig: the fields of an HF `config.json` the Llama family needs, checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """config.json names something kvray does not support; the message names the field."""


@dataclass(frozen=True)
class ArchTraits:
    """What an HF architecture fixes regardless of its config fields."""

    qkv_bias: bool | None = None  # None: follow config.attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head, before RoPE


ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits(),
    "MistralForCausalLM": ArchTraits(),
    "Qwen2ForCausalLM": ArchTraits(qkv_bias=True),
    "Qwen3ForCausalLM": ArchTraits(qk_norm=True),
}

_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    torch_dtype: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_len(self) -> int:
        """Longest sequence the model supports (Mistral's sliding window caps it: we attend fully)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"{path} is not a model directory: no config.json")
        return cls.from_dict(json.loads(file.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or raw.get('model_type')!r} (config field 'architectures'); "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        traits = ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(
                f"unsupported value {act!r} of config field 'hidden_act' (only 'silu')"
            )
        rope = _rope_parameters(raw)
        n_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        sliding = raw.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get(
            "use_sliding_window", False
        ):
            sliding = None
        attn_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(raw.get("head_dim") or hidden // n_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.pop("rope_theta")),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias if traits.qkv_bias is not None else attn_bias,
            o_bias=attn_bias if traits.qkv_bias is None else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            rope_scaling=rope,
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Both spellings: transformers 5 `rope_parameters`, older `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported value {kind!r} of config field 'rope_scaling.rope_type'; supported: {_ROPE_TYPES}"
        )
    params["rope_type"] = kind
    params.pop("type", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError("unsupported config field 'partial_rotary_factor' != 1.0")
    return params
