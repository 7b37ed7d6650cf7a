"""DeepSeek configs and loading: what kvray refuses (named by field), the latent KV layout's
bytes per token and the page count it buys, float32 routers, the DeepSeek-V2-Lite shape."""

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.parity.test_model_parity import _executor
from worker.config import EngineConfig
from worker.kv_sizing import auto_num_pages, kv_bytes_per_token, per_head_kv_bytes_per_token
from worker.model.config import ModelConfig, ModelConfigError
from worker.model.loader import load_model
from worker.model.moe import MoE
from worker.model.random_model import SHAPES, hf_config, tensor_specs
from worker.model.registry import MODEL_CLASSES

V2_LITE = hf_config(SHAPES["deepseek-v2-lite"], "bfloat16")


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(norm_topk_prob=True), "norm_topk_prob"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(scoring_func="sigmoid"), "scoring_func"),
        (dict(topk_method="noaux_tc"), "topk_method"),
        (dict(n_group=5, topk_method="group_limited_greedy"), "n_group"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unsupported_deepseek_config_names_the_field(change, field):
    with pytest.raises(ModelConfigError, match=f"'{field}'"):
        ModelConfig.from_dict({**V2_LITE, **change})


def test_fp8_kv_cache_is_refused_for_mla_naming_the_field(tiny_model):
    path, _ = tiny_model("deepseek-v2-dense")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported for Deepseek"):
        _executor(path, kv_cache_dtype="fp8")


def test_v2_lite_latent_kv_bytes_per_token():
    cfg = ModelConfig.from_dict(V2_LITE)
    # 27 layers x (512 + 64) bf16 values, against 16 heads x (192 K + 128 V) per layer
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 27 * 576 * 2 == 31_104
    assert per_head_kv_bytes_per_token(cfg, torch.bfloat16) == 27 * 16 * 320 * 2 == 276_480


def test_auto_page_count_uses_the_latent_bytes():
    cfg = ModelConfig.from_dict(V2_LITE)
    engine = EngineConfig.from_flat(
        device="cpu", max_running=1024, max_seq_len=8192, max_kv_cpu_gib=1.0
    ).resolve()
    per_token = kv_bytes_per_token(cfg, torch.bfloat16)
    assert auto_num_pages(engine, cfg, per_token) == 2**30 // (per_token * 16)


def test_tiny_mla_engine_allocates_one_latent_row_per_token(tiny_model):
    path, _ = tiny_model("deepseek-v3-moe")
    ex = _executor(path)
    cfg = ex.model_config
    assert ex.cache.k_cache.shape[2:] == (1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    assert ex.cache.storage.nbytes == ex.cache.k_cache.numel() * 4
    moe = ex.model.model.layers[-1].mlp
    assert isinstance(moe, MoE) and moe.gate_up_stack is not None
    # each expert's weights are views into the grouped GEMM's stacked operand
    first = moe.experts[1].gate_up_proj.weight
    assert first.untyped_storage().data_ptr() == moe.gate_up_stack.untyped_storage().data_ptr()
    assert torch.equal(first, moe.gate_up_stack[1])


def test_v2_lite_random_shape_builds():
    shape = SHAPES["deepseek-v2-lite"]
    assert 15.6e9 < shape.num_params < 15.8e9
    cfg = ModelConfig.from_dict(json.loads(json.dumps(V2_LITE)))
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg, max_len=1)
    # every parameter has its checkpoint tensor (merged gate|up from two of them)
    ours = {n for n, _ in model.named_parameters()}
    merged = {re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", n) for n, _ in tensor_specs(shape)}
    assert ours == merged
    assert sum(p.numel() for p in model.parameters()) == shape.num_params


def test_bf16_load_keeps_routers_in_float32_and_skips_v3_mtp_layers(tiny_model, tmp_path):
    """As transformers: the router's weight and score bias stay float32 in a bf16 model, and
    V3's multi-token-prediction layers after the last one are not loaded."""
    src, _ = tiny_model("deepseek-v3-moe")
    shutil.copytree(src, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)  # layer 3 of 3: an MTP module
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    model = load_model(tmp_path / "m", torch.bfloat16, "cpu", max_len=64)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts[0].gate_up_proj.weight.dtype == torch.bfloat16


def test_engine_start_logs_latent_and_per_head_kv_bytes(tiny_model, caplog):
    path, _ = tiny_model("deepseek-v2-dense")
    with caplog.at_level(logging.INFO, logger="kvray.cache"):
        ex = _executor(path)
    cfg = ex.model_config
    latent = kv_bytes_per_token(cfg, torch.float32)
    per_head = per_head_kv_bytes_per_token(cfg, torch.float32)
    assert latent == 3 * (32 + 8) * 4 and per_head == 3 * 4 * (24 + 12) * 4
    assert (
        f"({latent} B/token; MLA latent rows of 40, per-head K/V would take {per_head} B/token)"
        in caplog.text
    )
