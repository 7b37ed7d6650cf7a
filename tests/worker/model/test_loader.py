"""Loader errors name the tensor, field or file; a good directory loads."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.model.config import ModelConfigError
from worker.model.loader import ModelLoadError, load_model


@pytest.fixture
def model_dir(tiny_model, tmp_path):
    src, _ = tiny_model("qwen2")
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def _load(path):
    return load_model(path, torch.float32, "cpu", max_len=64)


def test_loads_and_counts_params(model_dir):
    model = _load(model_dir)
    assert model.config.architecture == "Qwen2ForCausalLM" and model.config.qkv_bias


def test_missing_tensor_is_named(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"missing tensor for 'model.layers.1.self_attn.qkv_proj.bias'"
    ):
        _load(model_dir)


def test_unexpected_tensor_is_named(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        _load(model_dir)


def test_shape_mismatch_is_named(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"shape mismatch for tensor 'model.norm.weight': checkpoint \(7,\)"
    ):
        _load(model_dir)


def test_corrupt_safetensors_is_named(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="cannot read safetensors file model.safetensors"):
        _load(model_dir)


def test_unknown_architecture_is_named(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelConfigError, match="FalconForCausalLM.*supported: LlamaForCausalLM, MistralForCausalLM"
    ):
        _load(model_dir)


def test_unsupported_field_value_is_named(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="'gelu' of config field 'hidden_act'"):
        _load(model_dir)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ModelConfigError, match="not a model directory: no config.json"):
        _load(tmp_path)
    with pytest.raises(ModelLoadError, match="not a directory"):
        _load(tmp_path / "nope")


def test_sharded_checkpoint_loads(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, model_dir / file)
    (model_dir / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    model = _load(model_dir)
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])
