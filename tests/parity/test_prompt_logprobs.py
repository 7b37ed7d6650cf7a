"""Prompt logprobs (`SamplingParams.prompt_logprobs`, the completions API's `echo`) equal
transformers' log_softmax over the prompt, however the prompt is chunked, cached or
preempted; `max_tokens=0` scores the prompt and generates nothing."""

import pytest
import torch

from tests.factories.tiny_models import random_prompts
from worker import LLM, SamplingParams

LENGTHS = [7, 29, 3, 18]
TOP = 3

MODES = {
    "paged-4": dict(page_size=4, num_pages=128),
    "chunked-8": dict(page_size=4, num_pages=128, token_budget=8, max_running=4),
    "preempt": dict(page_size=4, num_pages=26, prefix_cache=False),
    "overlap-chunked-8": dict(page_size=4, num_pages=128, token_budget=8, overlap=True),
}


def _llm(path, **mode) -> LLM:
    return LLM(
        str(path), device="cpu", dtype="float32", max_seq_len=128, **{"max_running": 8, **mode}
    )


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row i scores token i + 1


def _check(scored, prompt: list[int], ref: torch.Tensor) -> None:
    assert len(scored) == len(prompt) and scored[0] is None
    for j in range(1, len(prompt)):
        lp = scored[j]
        assert lp.token_id == prompt[j]
        assert lp.logprob == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)
        # the rank among the whole vocabulary, within the top alternatives or past them
        assert lp.rank == 1 + int((ref[j - 1] > ref[j - 1, prompt[j]]).sum())
        want = ref[j - 1].topk(TOP)
        assert list(lp.top) == want.indices.tolist()
        assert list(lp.top.values()) == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prompt_logprobs_equal_transformers(tiny_model, mode):
    path, hf = tiny_model("llama")
    llm = _llm(path, **MODES[mode])
    prompts = random_prompts(LENGTHS)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP)
    outs = llm.generate(prompts, params)
    for out, prompt in zip(outs, prompts, strict=True):
        _check(out.prompt_logprobs, prompt, _hf_prompt_logprobs(hf, prompt))
        assert len(out.token_ids) == 24
    if mode == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_cached_prompt_is_scored_again_in_full(tiny_model):
    path, hf = tiny_model("llama")
    llm = _llm(path, page_size=4, num_pages=128)
    prompts = random_prompts(LENGTHS)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    first = llm.generate(prompts, plain)  # fills the prefix cache
    again = llm.generate(prompts, scored)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert all(o.num_cached_tokens == 0 for o in again)
    for out, prompt in zip(again, prompts, strict=True):
        _check(out.prompt_logprobs, prompt, _hf_prompt_logprobs(hf, prompt))
    after = llm.generate(prompts, plain)  # its pages stay cached for the next request
    assert [o.num_cached_tokens for o in after] == [((n - 1) // 4) * 4 for n in LENGTHS]


@pytest.mark.parametrize("overlap", [False, True])
def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_model, overlap):
    path, hf = tiny_model("llama")
    llm = _llm(path, page_size=4, num_pages=128, overlap=overlap)
    prompts = random_prompts(LENGTHS)
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=TOP))
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
        _check(out.prompt_logprobs, prompt, _hf_prompt_logprobs(hf, prompt))
    cache = llm.engine.executor.cache
    assert cache.num_free_pages == cache.num_total_pages


def test_requests_without_prompt_logprobs_carry_none(tiny_model):
    path, _ = tiny_model("llama")
    outs = _llm(path, page_size=4, num_pages=128).generate(
        random_prompts([5]), SamplingParams(temperature=0, max_tokens=2)
    )
    assert outs[0].prompt_logprobs is None
