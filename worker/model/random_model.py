"""Random-weight models of real shapes (Llama, DeepSeek-V2), written as ordinary HF model directories.

Throughput does not depend on what the weights say, only on their shapes, so a benchmark
on the Llama-3-8B shape needs no 8B checkpoint (no machine here reaches a model hub).
The directory holds config.json, generation_config.json and safetensors weights (sharded
above `max_shard_bytes`), and no tokenizer: the engine then takes token-id prompts.

The safetensors files are written by hand, one tensor at a time (header first, then each
tensor's bytes as soon as it is drawn), so an 8B model never sits in memory twice; the
largest moment is one tensor. Weights are normal with std 0.02 (HF's `initializer_range`)
and norms are ones, which keeps bf16 activations small and finite through 32 layers.

This module imports only torch and json: it also runs on the GPU machine, where neither
pydantic nor ray is installed (`python -m worker.model.random_model OUT --shape NAME`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STD = 0.02
DEFAULT_MAX_SHARD_BYTES = 4 << 30
_DTYPES = {
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
    "float32": (torch.float32, "F32"),
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Shape:
    """The config.json numbers of one Llama-architecture model."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int = 1
    eos_token_id: int = 2

    @property
    def num_params(self) -> int:
        return sum(_numel(s) for _, s in tensor_specs(self))


@dataclass(frozen=True)
class DeepseekShape(Shape):
    """A DeepSeek-V2 shape: MLA (plain q_proj) and MoE after `first_k_dense_replace` layers.
    `num_kv_heads` equals `num_heads`, `head_dim` is the q/k head dim (nope + rope)."""

    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1408
    first_k_dense_replace: int = 1


SHAPES: dict[str, Shape] = {
    # Meta-Llama-3.1-8B: GQA 32/8, llama3 RoPE scaling, untied 128k vocabulary.
    "llama3-8b": Shape(
        num_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=_LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # SmolLM2-135M: the demo model's shape (tied embeddings, head_dim 64, GQA 9/3).
    "smollm2-135m": Shape(
        num_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
    ),
    # DeepSeek-V2-Lite (15.7B total, 2.4B active): MLA with a 512 + 64 latent, 64 routed
    # experts (top 6) and 2 shared after one dense layer, YaRN x40.
    "deepseek-v2-lite": DeepseekShape(
        num_layers=27,
        hidden_size=2048,
        intermediate_size=10944,
        num_heads=16,
        num_kv_heads=16,
        head_dim=192,
        vocab_size=102400,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        bos_token_id=100000,
        eos_token_id=100001,
    ),
    # For tests: every code path of the big shapes (GQA, untied head, llama3 RoPE) in ~0.2M params.
    "tiny": Shape(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 256},
    ),
}


def get_shape(shape: str | Shape) -> Shape:
    if isinstance(shape, Shape):
        return shape
    if shape not in SHAPES:
        raise ValueError(
            f"unknown random-model shape {shape!r}; known: {', '.join(sorted(SHAPES))}"
        )
    return SHAPES[shape]


def tensor_specs(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes, in file order (embeddings, layer by layer, norm, head)."""
    if isinstance(shape, DeepseekShape):
        return _deepseek_specs(shape)
    h, q, kv, i = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.intermediate_size,
    )
    specs: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (shape.vocab_size, h))
    ]
    for n in range(shape.num_layers):
        p = f"model.layers.{n}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    specs.append(("model.norm.weight", (h,)))
    if not shape.tie_word_embeddings:
        specs.append(("lm_head.weight", (shape.vocab_size, h)))
    return specs


def _deepseek_specs(s: DeepseekShape) -> list[tuple[str, tuple[int, ...]]]:
    h, heads, rank = s.hidden_size, s.num_heads, s.kv_lora_rank
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (s.vocab_size, h))]

    def mlp(prefix: str, inter: int) -> None:
        specs.extend(
            [
                (prefix + "gate_proj.weight", (inter, h)),
                (prefix + "up_proj.weight", (inter, h)),
                (prefix + "down_proj.weight", (h, inter)),
            ]
        )

    for n in range(s.num_layers):
        p = f"model.layers.{n}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (heads * s.head_dim, h)),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (rank + s.qk_rope_head_dim, h)),
            (p + "self_attn.kv_a_layernorm.weight", (rank,)),
            (p + "self_attn.kv_b_proj.weight", (heads * (s.qk_nope_head_dim + s.v_head_dim), rank)),
            (p + "self_attn.o_proj.weight", (h, heads * s.v_head_dim)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if n < s.first_k_dense_replace:
            mlp(p + "mlp.", s.intermediate_size)
            continue
        specs.append((p + "mlp.gate.weight", (s.n_routed_experts, h)))
        for e in range(s.n_routed_experts):
            mlp(f"{p}mlp.experts.{e}.", s.moe_intermediate_size)
        mlp(p + "mlp.shared_experts.", s.moe_intermediate_size * s.n_shared_experts)
    specs.append(("model.norm.weight", (h,)))
    specs.append(("lm_head.weight", (s.vocab_size, h)))
    return specs


def _deepseek_fields(s: DeepseekShape) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": s.qk_rope_head_dim,
        "v_head_dim": s.v_head_dim,
        "n_routed_experts": s.n_routed_experts,
        "n_shared_experts": s.n_shared_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "moe_intermediate_size": s.moe_intermediate_size,
        "first_k_dense_replace": s.first_k_dense_replace,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
    }


def hf_config(shape: Shape, dtype: str, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json, with RoPE in the spelling every transformers version reads (rope_theta + rope_scaling)."""
    config = _llama_config(shape, dtype, provenance)
    if isinstance(shape, DeepseekShape):
        del config["head_dim"]  # DeepSeek's head dims are the qk_* / v_head_dim fields
        config.update(_deepseek_fields(shape))
    return config


def _llama_config(shape: Shape, dtype: str, provenance: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": dict(shape.rope_scaling) if shape.rope_scaling else None,
        "max_position_embeddings": shape.max_position_embeddings,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "initializer_range": STD,
        "bos_token_id": shape.bos_token_id,
        "eos_token_id": shape.eos_token_id,
        "torch_dtype": dtype,
        "kvray_random": provenance or {},
    }


def write_random_model(
    out_dir: str | Path,
    shape: str | Shape,
    dtype: str = "bfloat16",
    seed: int = 0,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    device: str = "cpu",
    weights: bool = True,
) -> Path:
    """Write a random model of `shape` into `out_dir` (created) and return it.

    config.json is written last, so an interrupted run leaves a directory the loader
    refuses ("no config.json") rather than one that looks complete. `device="cuda"` draws
    the numbers on the GPU (much faster for 8B; a different stream than on CPU).
    `weights=False` writes only the JSON files, for an engine that draws its own weights
    (`load_format="random"`).
    """
    spec = get_shape(shape)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    torch_dtype, _ = _DTYPES[dtype]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)

    def draw(name: str, size: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(size, dtype=torch_dtype)
        return (
            torch.empty(size, dtype=torch_dtype, device=device)
            .normal_(0.0, STD, generator=gen)
            .cpu()
        )

    shards = (
        _plan_shards(tensor_specs(spec), torch_dtype.itemsize, max_shard_bytes) if weights else []
    )
    names = _shard_names(len(shards))
    for file, group in zip(names, shards, strict=True):
        _write_safetensors(out / file, group, dtype, draw)
    if len(shards) > 1:
        weight_map = {
            name: file for file, group in zip(names, shards, strict=True) for name, _ in group
        }
        total = sum(_numel(s) for group in shards for _, s in group) * torch_dtype.itemsize
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id},
    )
    name = shape if isinstance(shape, str) else "custom"
    _write_json(
        out / "config.json", hf_config(spec, dtype, {"shape": name, "seed": seed, "std": STD})
    )
    return out


def ensure_random_model(
    root: str | Path,
    shape: str,
    dtype: str = "bfloat16",
    seed: int = 0,
    *,
    device: str = "cpu",
    weights: bool = True,
) -> Path:
    """`root/random-<shape>-<dtype>-s<seed>` (`-config` without weights), written once (into a temp dir, renamed when complete)."""
    final = Path(root) / (f"random-{shape}-{dtype}-s{seed}" + ("" if weights else "-config"))
    if (final / "config.json").is_file():
        return final
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_random_model(tmp, shape, dtype, seed, device=device, weights=weights)
    try:
        tmp.rename(final)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").is_file():
            raise
    return final


# -- safetensors, by hand ----------------------------------------------------------------


def _write_safetensors(
    path: Path,
    specs: list[tuple[str, tuple[int, ...]]],
    dtype: str,
    draw: Callable[[str, tuple[int, ...]], torch.Tensor],
) -> None:
    """The safetensors layout: u64 header length, JSON header (offsets into the data), raw data."""
    torch_dtype, st_dtype = _DTYPES[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, size in specs:
        nbytes = _numel(size) * torch_dtype.itemsize
        header[name] = {
            "dtype": st_dtype,
            "shape": list(size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, size in specs:
            tensor = draw(name, size).contiguous()
            f.write(tensor.view(torch.uint8).numpy().data)  # the bytes, no copy
            del tensor


def _plan_shards(
    specs: list[tuple[str, tuple[int, ...]]], itemsize: int, max_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of tensors, each under `max_bytes` unless one tensor alone is larger."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = _numel(shape) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _iter_shape_lines() -> Iterator[str]:
    for name, s in SHAPES.items():
        yield f"  {name}: {s.num_params / 1e6:.1f}M params, {s.num_layers} layers, hidden {s.hidden_size}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker.model.random_model",
        description="Write a random-weight HF Llama model directory.",
        epilog="shapes:\n" + "\n".join(_iter_shape_lines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir")
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="cpu", help="where to draw the numbers (cuda is much faster for 8B)"
    )
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="no weights (for an engine with load_format=random)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = write_random_model(
        args.out_dir,
        args.shape,
        args.dtype,
        args.seed,
        device=args.device,
        weights=not args.config_only,
    )
    print(
        f"{path}: {args.shape} ({SHAPES[args.shape].num_params / 1e9:.2f}B params, {args.dtype}) in {time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
