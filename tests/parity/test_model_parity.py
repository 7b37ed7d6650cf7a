"""kvray's forward vs transformers' on tiny random models of every supported architecture."""

import pytest
import torch

from tests.conftest import ARCHS
from tests.factories.logits import packed_logits
from tests.factories.tiny_models import random_prompts
from worker.config import EngineConfig
from worker.executor import Executor
from worker.model.config import ModelConfig

LENGTHS = [5, 17, 1, 33]


def _executor(path, **overrides) -> Executor:
    mcfg = ModelConfig.from_dir(path)
    cfg = EngineConfig.from_flat(
        model=str(path),
        device="cpu",
        dtype="float32",
        max_running=8,
        max_seq_len=128,
        token_budget=256,
        num_pages=64,
        **overrides,
    )
    return Executor(cfg.resolve(model_max_len=mcfg.max_len), path, mcfg, frozenset({2}))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_packed_logits_match_transformers(tiny_model, arch, cache):
    path, hf = tiny_model(arch)
    prompts = random_prompts(LENGTHS)
    ours = packed_logits(_executor(path, cache=cache, page_size=4), prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float()
        tol = 1e-4 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol, arch


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}'
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
def test_last_tokens_skip_the_last_layers_mlp_elsewhere_and_match_transformers(tiny_model, arch):
    """A step past max_running tokens carries only each request's last token past the last
    attention; their logits are transformers'. A later, shorter step finds no row of the
    longer one's left in the padding."""
    path, hf = tiny_model(arch)
    ex = _executor(path, cache="paged", page_size=4)
    for prompts in (random_prompts(LENGTHS), random_prompts([12], seed=5)):
        assert ex.workspace.last_rows(sum(map(len, prompts))) is not None
        ours = packed_logits(ex, prompts, all_logits=False)
        assert len(ours) == len(prompts)
        for prompt, got in zip(prompts, ours, strict=True):
            with torch.no_grad():
                want = hf(torch.tensor([prompt])).logits[0, -1].float()
            assert (got[0] - want).abs().max().item() <= 1e-4 * want.abs().max().item(), arch
