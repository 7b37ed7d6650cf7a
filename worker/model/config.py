"""ModelConfig: the fields of an HF `config.json` kvray needs, checked once.

The Llama family's fields, plus, for DeepSeek-V2/V3, multi-head latent attention (MLA) and
the MoE, read exactly as transformers 5.24 reads them (modeling_deepseek_v2.py / _v3.py); a
field whose meaning transformers and the original DeepSeek code disagree on is refused.
"""

from __future__ import annotations

import json
import math
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
    mla: bool = False  # DeepSeek: latent attention, MoE layers
    rope_types: tuple[str, ...] = ("default", "llama3", "linear")


V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
# transformers' defaults for DeepSeek fields a config.json may leave out
_DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    V2: dict(first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0,
             topk_method="greedy", norm_topk_prob=False, n_routed_experts=64, q_lora_rank=1536),
    V3: dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5,
             n_group=8, topk_group=4, norm_topk_prob=True, rope_interleave=True,
             n_routed_experts=256, q_lora_rank=1536),
}  # fmt: skip
# In this order in messages: the test suites match the Llama family's names first.
ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits(),
    "MistralForCausalLM": ArchTraits(),
    "Qwen2ForCausalLM": ArchTraits(qkv_bias=True),
    "Qwen3ForCausalLM": ArchTraits(qk_norm=True),
    V2: ArchTraits(mla=True, rope_types=("default", "yarn")),
    V3: ArchTraits(mla=True, rope_types=("default", "yarn")),
}


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention: K and V come from one compressed latent per token."""

    kv_lora_rank: int  # width of the compressed kv (the latent the cache holds)
    q_lora_rank: int | None  # None: a plain q_proj; else q_a_proj -> norm -> q_b_proj
    qk_nope_head_dim: int  # per-head q/k dims without RoPE
    qk_rope_head_dim: int  # per-head q dims with RoPE; k's RoPE part is shared by all heads
    v_head_dim: int
    rope_interleave: bool  # RoPE rotates adjacent pairs (DeepSeek's layout), not halves
    rope_in_float32: bool  # V2 rotates in float32 (complex numbers), V3 in the activation dtype
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One cache row per token and layer: the normalised compressed kv, then the roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts plus always-on shared experts, from layer `first_k_dense_replace` on."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    num_shared_experts: int  # their MLP is num_shared_experts * intermediate_size wide
    first_k_dense_replace: int  # layers before this one keep the dense MLP
    scoring: str  # "softmax" (V2) or "sigmoid" (V3, with e_score_correction_bias)
    topk_method: str  # V2: "greedy" or "group_limited_greedy"; V3: group-limited always
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class KVShape:
    """What one token stores per layer in the KV cache."""

    num_heads: int
    head_dim: int
    latent: bool  # one row that is both K and V (MLA's latent), not a K and a V row per head


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
    mla: MlaConfig | None = None  # DeepSeek: then head_dim is the q/k head dim (nope + rope)
    moe: MoeConfig | None = None  # DeepSeek with routed experts in some layer

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dims RoPE rotates per head: all of them, or MLA's rope part."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_shape(self) -> KVShape:
        if self.mla:
            return KVShape(1, self.mla.latent_dim, latent=True)
        return KVShape(self.num_kv_heads, self.head_dim, latent=False)

    def per_head_kv_elements(self) -> int:
        """K and V elements per token and layer if every head stored its own (Llama-style)."""
        if self.mla:
            return self.num_heads * (self.mla.qk_head_dim + self.mla.v_head_dim)
        return 2 * self.num_kv_heads * self.head_dim

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
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        traits = ARCHITECTURES[arch]
        if traits.mla:
            raw = {**_DEEPSEEK_DEFAULTS[arch], **raw}
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(
                f"unsupported value {act!r} of config field 'hidden_act' (only 'silu')"
            )
        if raw.get("quantization_config"):
            raise ModelConfigError(
                "unsupported config field 'quantization_config' (kvray loads unquantized weights)"
            )
        rope = _rope_parameters(raw, traits.rope_types)
        n_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        sliding = raw.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get(
            "use_sliding_window", False
        ):
            sliding = None
        attn_bias = bool(raw.get("attention_bias", False))
        mla = mla_config(arch, raw, rope) if traits.mla else None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=n_heads,
            # MLA expands the latent into K and V for every head
            num_kv_heads=n_heads if mla else int(raw.get("num_key_value_heads") or n_heads),
            head_dim=mla.qk_head_dim if mla else int(raw.get("head_dim") or hidden // n_heads),
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
            mla=mla,
            moe=moe_config(arch, raw) if traits.mla else None,
        )


def _rope_parameters(raw: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, Any]:
    """Both spellings: transformers 5 `rope_parameters`, older `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in kinds:
        raise ModelConfigError(
            f"unsupported value {kind!r} of config field 'rope_scaling.rope_type'; supported: {kinds}"
        )
    if kind == "yarn":  # transformers' standardize_rope_params
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        if params.get("factor") is None:
            params["factor"] = (
                raw["max_position_embeddings"] / params["original_max_position_embeddings"]
            )
    params["rope_type"] = kind
    params.pop("type", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError("unsupported config field 'partial_rotary_factor' != 1.0")
    return params


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_config(arch: str, raw: dict[str, Any], rope: dict[str, Any]) -> MlaConfig:
    nope, rope_dim = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    scale = (nope + rope_dim) ** -0.5
    # transformers' yarn_apply_mscale: any non-default RoPE with mscale_all_dim set
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * m * m
    q_rank = raw.get("q_lora_rank")
    return MlaConfig(
        kv_lora_rank=int(raw["kv_lora_rank"]),
        q_lora_rank=int(q_rank) if q_rank else None,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(raw["v_head_dim"]),
        rope_interleave=arch == V2 or bool(raw.get("rope_interleave", True)),
        rope_in_float32=arch == V2,
        softmax_scale=scale,
    )


def moe_config(arch: str, raw: dict[str, Any]) -> MoeConfig | None:
    """None when the model has no MoE layer (no routed experts, or all layers dense)."""
    num_layers = int(raw["num_hidden_layers"])
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    experts = int(raw.get("n_routed_experts") or 0)
    if experts == 0 or first_dense >= num_layers:
        return None
    if int(raw.get("moe_layer_freq", 1)) != 1:
        raise ModelConfigError(
            "unsupported config field 'moe_layer_freq' != 1 (transformers makes every layer "
            "from first_k_dense_replace on an MoE layer)"
        )
    shared = int(raw.get("n_shared_experts") or 0)
    if shared < 1:
        raise ModelConfigError("unsupported value of config field 'n_shared_experts' (need >= 1)")
    scoring = "softmax" if arch == V2 else "sigmoid"
    if raw.get("scoring_func", scoring) != scoring:
        raise ModelConfigError(
            f"unsupported value {raw['scoring_func']!r} of config field 'scoring_func' for {arch} "
            f"(transformers scores with {scoring!r})"
        )
    method = str(raw.get("topk_method") or "greedy") if arch == V2 else "group_limited"
    if method not in ("greedy", "group_limited_greedy", "group_limited"):
        raise ModelConfigError(
            f"unsupported value {method!r} of config field 'topk_method' for {arch}; "
            "supported: 'greedy', 'group_limited_greedy'"
        )
    norm = bool(raw.get("norm_topk_prob", arch == V3))
    if arch == V2 and norm:
        raise ModelConfigError(
            "unsupported config field 'norm_topk_prob' = true for DeepseekV2ForCausalLM "
            "(transformers ignores it, the original DeepSeek code normalises: kvray refuses to pick)"
        )
    grouped = method != "greedy"
    groups = int(raw.get("n_group") or 1) if grouped else 1
    topk_groups = int(raw.get("topk_group") or 1) if grouped else 1
    # V3 ranks a group by its two best experts
    if grouped and (experts % groups or not 1 <= topk_groups <= groups or experts // groups < 2):
        raise ModelConfigError(
            f"config fields 'n_group' ({groups}) and 'topk_group' ({topk_groups}) must split "
            f"n_routed_experts ({experts}) into groups and pick at most all of them"
        )
    return MoeConfig(
        num_experts=experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        num_shared_experts=shared,
        first_k_dense_replace=first_dense,
        scoring=scoring,
        topk_method=method,
        num_groups=groups,
        topk_groups=topk_groups,
        norm_topk_prob=norm,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )
