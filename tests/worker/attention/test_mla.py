"""MLA decode over the latent cache: the absorbed form (kv_b folded into the query and the
output) equals the naive one (latents expanded into per-head K/V), per layer and through
the whole model; the fixed-width decode CUDA graphs would replay equals the live-width one."""

import pytest
import torch

from tests.factories.tiny_models import random_prompts
from tests.parity.test_model_parity import _executor
from worker.attention.mla import MlaTorchBackend
from worker.request import Request, ScheduledTask
from worker.sampling import SamplingParams


@pytest.fixture(autouse=True)
def one_thread():
    # tiny ops: one thread beats two contending for a shared 2-core box
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _decode_step(ex, prompts):
    """Prefill all but each prompt's last token, then bind a decode step of that token."""
    reqs = [Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:
        assert ex.cache.admit(r) and ex.cache.reserve(r, len(r.prompt_ids))
    ex.forward(ex.cache.bind_tasks([ScheduledTask(r, len(r.prompt_ids) - 1) for r in reqs]))
    batch = ex.cache.bind_tasks([ScheduledTask(r, 1) for r in reqs])
    assert batch.is_decode
    return batch


@pytest.mark.parametrize("arch", ["deepseek-v2-moe", "deepseek-v3-moe"])
def test_absorbed_decode_equals_naive_decode(tiny_model, arch):
    path, _ = tiny_model(arch)
    ex = _executor(path, page_size=4)
    absorbed = ex.backend
    assert isinstance(absorbed, MlaTorchBackend) and absorbed.absorb
    cfg = ex.model_config
    naive = MlaTorchBackend(cfg.mla, cfg.num_heads, ex.model.kv_b_weights(), absorb=False)
    batch = _decode_step(ex, random_prompts([9, 30, 2, 17]))
    q = torch.randn(
        4, cfg.num_heads, cfg.mla.qk_head_dim, generator=torch.Generator().manual_seed(0)
    )
    for backend in (absorbed, naive):
        backend.prepare(batch, ex.cache)
    for layer in range(cfg.num_layers):
        want = naive.fwd_decode(layer, q, ex.cache)
        got = absorbed.fwd_decode(layer, q, ex.cache)
        assert got.shape == (4, cfg.num_heads, cfg.mla.v_head_dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got_logits = ex.forward(batch)
    ex.backend = naive
    torch.testing.assert_close(got_logits, ex.forward(batch), rtol=1e-5, atol=1e-4)


def test_fixed_width_decode_equals_live_width(tiny_model):
    path, _ = tiny_model("deepseek-v2-dense")
    ex = _executor(path, page_size=4)
    cfg = ex.model_config
    batch = _decode_step(ex, random_prompts([5, 21, 3]))
    live = ex.forward(batch)
    ex.backend = MlaTorchBackend(cfg.mla, cfg.num_heads, ex.model.kv_b_weights(), fixed_width=True)
    assert ex.backend.supports_graph
    torch.testing.assert_close(ex.forward(batch), live, rtol=1e-5, atol=1e-5)
