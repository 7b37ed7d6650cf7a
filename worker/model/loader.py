"""Load an HF model directory: config.json + safetensors (single or sharded), tensor by tensor.

Tensors stream straight to the target device and dtype; the model is built on the meta
device first, so no full CPU copy of the weights ever exists.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from worker.model.base import CausalLM
from worker.model.config import ModelConfig
from worker.model.layers import MergedLinear, RotaryEmbedding
from worker.model.ops import ModelOps
from worker.model.registry import MODEL_CLASSES

log = logging.getLogger("kvray.loader")

# HF projection name -> the merged parameter that holds it.
_MERGED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# kept in float32 whatever the model dtype, as transformers keeps them (MoE routers)
_FLOAT32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


class ModelLoadError(ValueError):
    """A model directory or checkpoint kvray cannot load; the message names the file or tensor."""


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no safetensors weights (model.safetensors or an index)")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"weight file {f.name} named by the index is missing in {path}")
    return files


def _iter_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device=str(device))
        except Exception as e:  # safetensors raises its own error type for corrupt headers
            raise ModelLoadError(f"cannot read safetensors file {file.name}: {e}") from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                try:
                    yield name, f.get_tensor(name)
                except Exception as e:
                    raise ModelLoadError(
                        f"cannot read tensor {name!r} from {file.name}: {e}"
                    ) from e


def _count_tensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                total += len(list(f.keys()))
        except Exception as e:
            raise ModelLoadError(f"cannot read safetensors file {file.name}: {e}") from e
    return total


def _target(
    model: CausalLM, params: dict[str, torch.nn.Parameter], name: str
) -> tuple[str, torch.nn.Parameter, tuple[int, int] | None]:
    """The parameter (and its row range, for merged projections) an HF tensor name fills."""
    parts = name.split(".")
    shard = None
    for i, p in enumerate(parts):
        # MLA's q_proj is a projection of its own, not a shard of qkv_proj
        if p in _MERGED and not _has_module(model, ".".join(parts[: i + 1])):
            module_path = ".".join(parts[:i] + [_MERGED[p]])
            module = model.get_submodule(module_path)
            assert isinstance(module, MergedLinear)
            shard = module.shards[p]
            name = f"{module_path}.{parts[-1]}"
            break
    if name not in params:
        raise KeyError(name)
    return name, params[name], shard


def _has_module(model: CausalLM, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def load_weights(model: CausalLM, path: Path, dtype: torch.dtype, device: torch.device) -> None:
    files = weight_files(path)
    params = dict(model.named_parameters())
    expected = {n: p.shape for n, p in params.items()}
    filled: dict[str, int] = {}  # parameter name -> rows filled
    tied = model.config.tie_word_embeddings
    bar = tqdm(total=_count_tensors(files), desc="loading weights", unit="tensor", leave=False)
    with torch.no_grad():
        for hf_name, tensor in _iter_tensors(files, device):
            bar.update(1)
            if (
                hf_name.endswith(_IGNORED_SUFFIXES)
                or (tied and hf_name == "lm_head.weight")
                or model.ignores(hf_name)
            ):
                continue
            try:
                name, param, shard = _target(model, params, hf_name)
            except KeyError:
                raise ModelLoadError(f"unexpected tensor {hf_name!r} in the checkpoint") from None
            dest = param.data if shard is None else param.data.narrow(0, shard[0], shard[1])
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"shape mismatch for tensor {hf_name!r}: checkpoint {tuple(tensor.shape)}, model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))  # float32 routers stay float32
            filled[name] = filled.get(name, 0) + dest.shape[0]
    bar.close()
    for name, shape in expected.items():
        if filled.get(name, 0) != shape[0]:
            raise ModelLoadError(
                f"missing tensor for {name!r} in {path} (checkpoint names use the HF layout)"
            )


def random_weights(model: CausalLM, seed: int = 0) -> None:
    """Small normal weights, unit norms: finite activations in bf16, for benchmarks of shape."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    max_len: int,
    *,
    random: bool = False,
    ops: ModelOps | None = None,
) -> CausalLM:
    """Build the model for `path` on `device` in `dtype`, with RoPE tables for `max_len` positions.

    `ops` computes its norms, RoPE and SiLU·mul (default TorchOps, the torch op sequence).
    """
    path, device = Path(path), torch.device(device)
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    cfg = ModelConfig.from_dir(path)
    start = time.perf_counter()
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg, 1, ops)
    model = model.to(dtype=dtype)
    for name, p in model.named_parameters():
        if name.endswith(_FLOAT32_SUFFIXES):
            p.data = p.data.float()
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(cfg, max_len).to(device)
    if random:
        random_weights(model)
    else:
        load_weights(model, path, dtype, device)
    model.after_load()
    model.eval().requires_grad_(False)
    n_params = sum(p.numel() for p in model.parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info(
        "loaded %s (%s) from %s: %.1fM params, %.2f GiB %s on %s in %.1fs",
        cfg.architecture,
        path.name,
        path,
        n_params / 1e6,
        n_bytes / 2**30,
        str(dtype).removeprefix("torch."),
        device,
        time.perf_counter() - start,
    )
    return model
