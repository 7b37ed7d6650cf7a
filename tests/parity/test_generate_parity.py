"""Greedy generation equals transformers `generate`, token for token, under every cache mode."""

import pytest

from tests.conftest import ARCHS
from tests.factories.logits import hf_greedy_tokens
from tests.factories.tiny_models import random_prompts
from worker import LLM, SamplingParams

NEW_TOKENS = 32
LENGTHS = [7, 29, 3, 18]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

MODES = {
    "contiguous": dict(cache="contiguous"),
    "paged-1": dict(cache="paged", page_size=1, num_pages=512),
    "paged-16": dict(cache="paged", page_size=16, num_pages=64),
    "chunked-16": dict(cache="paged", page_size=4, token_budget=16, max_running=4),
    "preempt": dict(cache="paged", page_size=4, num_pages=26, prefix_cache=False),
}


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    cache = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            _, hf = tiny_model(arch)
            cache[arch] = hf_greedy_tokens(hf, random_prompts(LENGTHS), NEW_TOKENS)
        return cache[arch]

    return get


def _llm(path, **mode) -> LLM:
    return LLM(
        str(path), device="cpu", dtype="float32", max_seq_len=128, **{"max_running": 8, **mode}
    )


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers(tiny_model, hf_greedy, arch, mode):
    path, _ = tiny_model(arch)
    llm = _llm(path, **MODES[mode])
    outs = llm.generate(random_prompts(LENGTHS), GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(arch)
    assert all(o.finish_reason == "length" for o in outs)
    if mode == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    cache = llm.engine.executor.cache
    # every page back (cached pages count as free)
    assert cache.num_free_pages == cache.num_total_pages


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hit_reuses_pages(tiny_model, hf_greedy, arch):
    path, _ = tiny_model(arch)
    llm = _llm(path, cache="paged", page_size=4, num_pages=128)
    prompts = random_prompts(LENGTHS)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    want = hf_greedy(arch)
    assert [o.token_ids for o in first] == want
    assert [o.token_ids for o in second] == want
    assert all(o.num_cached_tokens == 0 for o in first)
    assert [o.num_cached_tokens for o in second] == [((n - 1) // 4) * 4 for n in LENGTHS]
    hits, queries = llm.engine.executor.cache.prefix_stats
    assert hits > 0 and queries > hits
