"""How many KV pages an engine gets, and the cache that holds them."""

from __future__ import annotations

import logging

import torch

from worker.cache import ContiguousCache, KVCache, KVStorage, PageCache, ReqToTokenPool
from worker.config import EngineConfig
from worker.model.config import ModelConfig
from worker.workspace import InferenceWorkspace

log = logging.getLogger("kvray.cache")


def auto_num_pages(cfg: EngineConfig, model: ModelConfig, bytes_per_token: int) -> int:
    """Pages that fit the KV memory budget, but never more than max_running full sequences need."""
    assert cfg.max_seq_len is not None
    device = torch.device(cfg.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * cfg.kv_memory_fraction
    else:
        budget = cfg.advanced.max_kv_cpu_gib * 2**30
    fit = int(budget // (bytes_per_token * cfg.advanced.page_size))
    useful = cfg.max_running * -(-cfg.max_seq_len // cfg.advanced.page_size) + 1
    return max(2, min(fit, useful))


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes over all layers, in the model's own layout."""
    shape = model.kv_shape
    return KVStorage.bytes_per_token(
        model.num_layers, shape.num_heads, shape.head_dim, dtype, latent=shape.latent
    )


def per_head_kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """What a per-head (Llama-style) K and V layout of the same model would take per token."""
    return model.num_layers * model.per_head_kv_elements() * dtype.itemsize


def build_cache(cfg: EngineConfig, model: ModelConfig, workspace: InferenceWorkspace) -> KVCache:
    assert cfg.max_seq_len is not None
    device, dtype = torch.device(cfg.device), cfg.kv_torch_dtype
    shape = model.kv_shape
    per_token = kv_bytes_per_token(model, dtype)
    staging = (
        cfg.token_budget + cfg.max_running * cfg.advanced.page_size
    )  # slots one step can newly map
    req_pool = ReqToTokenPool(cfg.max_running, cfg.max_seq_len, device, staging)

    def storage_of(n_slots: int) -> KVStorage:
        return KVStorage(
            model.num_layers,
            n_slots,
            shape.num_heads,
            shape.head_dim,
            dtype,
            device,
            latent=shape.latent,
        )

    if cfg.advanced.cache == "contiguous":
        storage = storage_of(cfg.max_running * cfg.max_seq_len)
        cache: KVCache = ContiguousCache(storage, req_pool, workspace)
    else:
        num_pages = cfg.num_pages or auto_num_pages(cfg, model, per_token)
        storage = storage_of(num_pages * cfg.advanced.page_size)
        cache = PageCache(
            storage, req_pool, cfg.advanced.page_size, num_pages, workspace, cfg.prefix_cache
        )
    latent = ""
    if shape.latent:
        latent = f"; MLA latent rows of {shape.head_dim}, per-head K/V would take {per_head_kv_bytes_per_token(model, dtype)} B/token"
    log.info(
        "KV cache: %s, %s, %d pages of %d tokens, %.2f GiB (%d B/token%s)",
        cfg.advanced.cache,
        "fp8 e4m3 + scales" if cfg.kv_cache_dtype == "fp8" else cfg.dtype,
        cache.num_total_pages,
        cache.page_size,
        storage.nbytes / 2**30,
        per_token,
        latent,
    )
    return cache
