"""EngineConfig: everything one engine on one device needs, validated once and frozen."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "fp8"]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_FROZEN = ConfigDict(frozen=True, extra="forbid")


class EngineAdvanced(BaseModel):
    """Engine settings most deployments leave alone (`EngineConfig.advanced`): the cache
    layout, step pacing, backends and graphs. `"auto"` fields are resolved with the rest."""

    model_config = _FROZEN

    load_format: Literal["safetensors", "random"] = Field(
        "safetensors",
        description="random: draw weights on the device (benchmarks; the directory needs only config.json)",
    )
    cache: Literal["auto", "contiguous", "paged"] = Field(
        "auto", description="KV cache layout; auto = paged"
    )
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page (paged cache)")
    max_kv_cpu_gib: float = Field(2.0, gt=0, description="cap on automatic KV size on CPU, GiB")
    prefill_budget: int | None = Field(
        None,
        ge=1,
        description="while requests decode, prompt tokens per step at most this (steadier inter-token latency, later first tokens); None = what token_budget leaves",
    )
    prefill_slowdown: float | None = Field(
        None,
        gt=1,
        le=100,
        description="while requests decode, cap a step's prompt tokens so that it takes at most this many times a decode-only step, from measured step times (e.g. 1.8 for inter-token p99 within 2x p50; later first tokens); None = off",
    )
    backend: Literal["auto", "torch", "cuda"] = Field(
        "auto", description="attention backend; auto = cuda on CUDA with paged cache, else torch"
    )
    prefill_kernel: Literal["auto", "kvray", "flash", "fa3"] = Field(
        "auto",
        description="CUDA prompt attention: kvray's kernel, torch's FlashAttention-2 over gathered K/V, fa3 = FlashInfer's FlashAttention-3 over the cache in place (needs flashinfer-python and an sm_90 GPU), or auto = fa3 where it runs, else per batch by shape, FlashAttention-2 where it runs (kvray's kernel where it does not)",
    )
    cuda_graphs: bool = Field(True, description="capture decode CUDA graphs (CUDA backend only)")
    prompt_graph_tokens: int = Field(
        2048,
        ge=0,
        description="with cuda_graphs, also capture piecewise graphs (attention runs eagerly between the pieces) for steps that carry prompt tokens, up to this many tokens a step (capped by token_budget); 0 = such steps run eagerly",
    )
    overlap: bool | None = Field(
        None,
        description="schedule and queue each step on the device before the previous step's tokens are read, so host bookkeeping overlaps the device; None = on for CUDA",
    )
    admission_watermark: float = Field(
        0.01, ge=0, lt=1, description="share of KV pages kept free when admitting new requests"
    )
    seed: int = Field(
        0, description="seed of the engine's sampler for requests without their own seed"
    )

    @model_validator(mode="after")
    def _check(self) -> EngineAdvanced:
        if self.backend == "cuda" and self.cache == "contiguous":
            raise ValueError("backend 'cuda' needs cache 'paged'")
        return self


class EngineConfig(BaseModel):
    """Settings of one engine. `"auto"` fields are resolved once by `resolve()` at start."""

    model_config = _FROZEN

    model: str = Field(
        "demo", description="HF model directory, or 'demo' for the embedded SmolLM2-135M"
    )
    dtype: DType = Field(
        "auto", description="weight/activation dtype; auto = bfloat16 on CUDA, float32 on CPU"
    )
    device: str = Field("auto", description="torch device; auto = cuda if available else cpu")
    max_seq_len: int | None = Field(
        None, ge=2, description="longest prompt + output; None = the model's limit, capped at 8192"
    )
    max_running: int = Field(64, ge=1, le=4096, description="most requests decoding at once")
    max_waiting: int = Field(
        1024, ge=1, description="most requests queued before submit refuses (backpressure)"
    )
    token_budget: int = Field(
        2048, ge=1, description="tokens per step; prefill chunks fill what decodes leave"
    )
    num_pages: int | None = Field(
        None, ge=2, description="KV capacity in pages; None = sized from free memory"
    )
    kv_memory_fraction: float = Field(
        0.85, gt=0, le=0.98, description="share of free device memory for KV when num_pages is None"
    )
    prefix_cache: bool = Field(
        True, description="reuse full KV pages across requests sharing a prefix (paged cache)"
    )
    kv_cache_dtype: KVCacheDType = Field(
        "auto",
        description="KV cache element type; auto = the activation dtype, fp8 = e4m3 with a float32 scale per token and KV head (about half the bytes, so about twice the pages)",
    )
    advanced: EngineAdvanced = Field(
        default_factory=EngineAdvanced, description="settings most deployments leave alone"
    )

    @classmethod
    def from_flat(cls, **settings: Any) -> EngineConfig:
        """A config from keyword arguments, the advanced ones among them (`page_size=4`),
        as Python callers (`LLM(...)`, tests, benchmarks) give them; YAML nests them."""
        advanced = {k: settings.pop(k) for k in list(settings) if k in EngineAdvanced.model_fields}
        return cls(**settings, advanced={**settings.pop("advanced", {}), **advanced})

    def resolve(self, *, model_max_len: int | None = None) -> EngineConfig:
        """Return a new config with every 'auto' replaced by a concrete choice."""
        adv = self.advanced
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        is_cuda = device.startswith("cuda")
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if is_cuda else "float32")
        cache = adv.cache if adv.cache != "auto" else "paged"
        backend = adv.backend
        if backend == "auto":
            backend = "cuda" if is_cuda and cache == "paged" else "torch"
        graphs = adv.cuda_graphs and backend == "cuda"
        if self.kv_cache_dtype == "fp8" and backend == "cuda" and dtype != "bfloat16":
            raise ValueError("kv_cache_dtype 'fp8' on the cuda backend needs dtype 'bfloat16'")
        advanced = adv.model_copy(
            update=dict(
                cache=cache,
                backend=backend,
                cuda_graphs=graphs,
                prompt_graph_tokens=min(adv.prompt_graph_tokens, self.token_budget)
                if graphs
                else 0,
                overlap=is_cuda if adv.overlap is None else adv.overlap,
            )
        )
        return self.model_copy(
            update=dict(
                device=device,
                dtype=dtype,
                max_seq_len=self.max_seq_len or min(model_max_len or 8192, 8192),
                prefix_cache=self.prefix_cache and cache == "paged",
                advanced=advanced,
            )
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("resolve() the config first")
        return _TORCH_DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """Element type of the KV cache tensors (FP8 comes with scale tensors beside them)."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.torch_dtype
