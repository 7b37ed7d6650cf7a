"""DeepSeek-V2/V3 (MLA + MoE) against transformers: packed logits, and greedy tokens under the
cache modes of test_generate_parity (paged, contiguous, chunked prefill, preemption, prefix
hits). The MoE specs run every mode; the dense-only ones the two cache layouts."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import MLA_ARCHS
from tests.factories.logits import hf_greedy_tokens, packed_logits
from tests.factories.tiny_models import random_prompts
from tests.parity.test_generate_parity import GREEDY, LENGTHS, MODES, NEW_TOKENS, _llm
from tests.parity.test_model_parity import LENGTHS as LOGIT_LENGTHS
from tests.parity.test_model_parity import _executor
from worker.config import EngineConfig
from worker.executor import Executor
from worker.model.config import ModelConfig

MOE_ARCHS = [a for a in MLA_ARCHS if a.endswith("-moe")]
DENSE_ARCHS = [a for a in MLA_ARCHS if a.endswith("-dense")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny ops: one thread beats two contending for a shared 2-core box (tens of times here)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            _, hf = tiny_model(arch)
            cache[arch] = hf_greedy_tokens(hf, random_prompts(LENGTHS), NEW_TOKENS)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", MLA_ARCHS)
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_packed_logits_match_transformers(tiny_model, arch, cache):
    path, hf = tiny_model(arch)
    prompts = random_prompts(LOGIT_LENGTHS)
    ours = packed_logits(_executor(path, cache=cache, page_size=4), prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float()
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item(), arch


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bf16_packed_logits_equal_transformers_bit_for_bit(tiny_model, arch):
    """bf16 too: transformers keeps the routers in float32 and sums each token's experts in
    float32 (its default grouped_mm experts), and so does kvray; on this CPU every logit of
    a packed batch has transformers' bits."""
    path, _ = tiny_model(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = random_prompts(LOGIT_LENGTHS)
    mcfg = ModelConfig.from_dir(path)
    cfg = EngineConfig.from_flat(model=str(path), device="cpu", dtype="bfloat16", max_running=8,
                                 max_seq_len=128, num_pages=64, page_size=4)  # fmt: skip
    ex = Executor(cfg.resolve(model_max_len=mcfg.max_len), path, mcfg, frozenset({2}))
    ours = packed_logits(ex, prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float()
        assert torch.equal(got, want), (arch, (got - want).abs().max().item())


@pytest.mark.parametrize(
    "arch, mode",
    [(a, m) for a in MOE_ARCHS for m in sorted(MODES)]
    + [(a, m) for a in DENSE_ARCHS for m in ("contiguous", "paged-16")],
)
def test_greedy_equals_transformers(tiny_model, hf_greedy, arch, mode):
    path, _ = tiny_model(arch)
    llm = _llm(path, **MODES[mode])
    outs = llm.generate(random_prompts(LENGTHS), GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(arch)
    if mode == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    cache = llm.engine.executor.cache
    assert cache.num_free_pages == cache.num_total_pages
    assert cache.v_cache is cache.k_cache and cache.k_cache.shape[2] == 1  # one latent row


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefix_cache_hit_reuses_latent_pages(tiny_model, hf_greedy, arch):
    path, _ = tiny_model(arch)
    llm = _llm(path, cache="paged", page_size=4, num_pages=128)
    prompts = random_prompts(LENGTHS)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == hf_greedy(arch)
    assert [o.num_cached_tokens for o in second] == [((n - 1) // 4) * 4 for n in LENGTHS]
