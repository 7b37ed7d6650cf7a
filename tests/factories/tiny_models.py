"""Tiny random HF models built in-process with transformers, for parity tests.

Per FACTS.md: initializer_range 0.3 keeps greedy outputs varied with clear top-1 margins,
and biases / norm weights (and V3's router score bias) are randomized so parity actually
exercises them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers


@dataclass(frozen=True)
class TinySpec:
    name: str
    config_cls: str
    model_cls: str
    overrides: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=lambda: BASE)


BASE = dict(
    vocab_size=211,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

SPECS = {
    s.name: s
    for s in [
        TinySpec("llama", "LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
        TinySpec(
            "llama-tied-rope3",
            "LlamaConfig",
            "LlamaForCausalLM",
            dict(
                tie_word_embeddings=True,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
        TinySpec(
            "mistral",
            "MistralConfig",
            "MistralForCausalLM",
            dict(tie_word_embeddings=False, sliding_window=None),
        ),
        TinySpec("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
        TinySpec(
            "qwen3",
            "Qwen3Config",
            "Qwen3ForCausalLM",
            dict(tie_word_embeddings=False, head_dim=24, num_key_value_heads=3),
        ),
    ]
}


# DeepSeek (MLA + MoE): rms_norm_eps differs from the latent norms' fixed 1e-6 on purpose.
MLA_BASE = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    max_position_embeddings=512,
    initializer_range=0.3,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1}

MLA_SPECS = {
    s.name: s
    for s in [
        # MoE after one dense layer, shared expert, V2's group-limited greedy routing, biases
        TinySpec(
            "deepseek-v2-moe",
            "DeepseekV2Config",
            "DeepseekV2ForCausalLM",
            dict(
                q_lora_rank=None,
                first_k_dense_replace=1,
                topk_method="group_limited_greedy",
                n_group=4,
                topk_group=2,
                routed_scaling_factor=1.5,
                attention_bias=True,
            ),
            MLA_BASE,
        ),
        # dense only, q through the low-rank path, YaRN with its softmax-scale correction
        TinySpec(
            "deepseek-v2-dense",
            "DeepseekV2Config",
            "DeepseekV2ForCausalLM",
            dict(
                q_lora_rank=24,
                first_k_dense_replace=3,
                max_position_embeddings=128,
                rope_parameters={
                    **_YARN,
                    "original_max_position_embeddings": 32,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.8,
                },
            ),
            MLA_BASE,
        ),
        # V3 routing: sigmoid + score-correction bias, group-limited top-k, normalised, scaled
        TinySpec(
            "deepseek-v3-moe",
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            dict(
                q_lora_rank=24,
                first_k_dense_replace=1,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
            ),
            MLA_BASE,
        ),
        # dense only, plain q_proj, rotate-half RoPE (rope_interleave off), YaRN's mscale only
        TinySpec(
            "deepseek-v3-dense",
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            dict(
                q_lora_rank=None,
                first_k_dense_replace=3,
                rope_interleave=False,
                max_position_embeddings=128,
                rope_parameters={**_YARN, "original_max_position_embeddings": 32, "mscale": 0.7},
            ),
            MLA_BASE,
        ),
    ]
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def build_tiny_model(spec_name: str, out_dir: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """Save a random fp32 model of `spec_name` to `out_dir`; return the dir and the HF model."""
    spec = SPECS[spec_name] if spec_name in SPECS else MLA_SPECS[spec_name]
    torch.manual_seed(seed)
    config = getattr(transformers, spec.config_cls)(**{**spec.base, **spec.overrides})
    model = getattr(transformers, spec.model_cls)(config).eval()
    _randomize(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    if hasattr(model, "generation_config"):
        model.generation_config.save_pretrained(out_dir)
    return out_dir, model


def random_prompts(lengths: list[int], vocab: int = 211, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
