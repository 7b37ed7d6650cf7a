"""Full-sequence logits of a packed batch of prompts through kvray's executor, and
transformers' greedy continuations to compare kvray's tokens with."""

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin

from worker.executor import Executor
from worker.request import Request, ScheduledTask
from worker.sampling import SamplingParams


def packed_logits(
    ex: Executor, prompts: list[list[int]], all_logits: bool = True
) -> list[torch.Tensor]:
    """Each prompt's logits from one step that prefills them all: at every token, or (not
    `all_logits`) at its last one."""
    reqs = [Request(f"r{i}-{id(prompts)}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:
        assert ex.cache.admit(r) and ex.cache.reserve(r, len(r.prompt_ids))
    batch = ex.cache.bind_tasks([ScheduledTask(r, len(r.prompt_ids)) for r in reqs])
    logits = ex.forward(batch, all_logits=all_logits)
    for r in reqs:
        ex.cache.release(r)
    return list(logits.split([len(p) for p in prompts] if all_logits else 1))


# generate's name for a KV cache of the caller's: `cache` in newer transformers, where
# `past_key_values` is deprecated (to go in 6.0), `past_key_values` before
_CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


def hf_greedy_tokens(
    hf: Any, prompts: list[list[int]], new_tokens: int, make_cache: Callable[[], Any] | None = None
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly `new_tokens` long (EOS
    never ends it); `make_cache` gives each `generate` call a fresh KV cache of its own."""
    gc = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    outs = []
    for p in prompts:
        extra = {_CACHE_KWARG: make_cache()} if make_cache is not None else {}
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                generation_config=gc,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                **extra,
            )
        outs.append(out[0, len(p) :].tolist())
        assert len(outs[-1]) == new_tokens
    return outs
