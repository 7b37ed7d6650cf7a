"""Full-sequence logits of a packed batch of prompts through kvray's executor."""

import torch

from worker.executor import Executor
from worker.request import Request, ScheduledTask
from worker.sampling import SamplingParams


def packed_logits(ex: Executor, prompts: list[list[int]]) -> list[torch.Tensor]:
    reqs = [Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:
        assert ex.cache.admit(r) and ex.cache.reserve(r, len(r.prompt_ids))
    batch = ex.cache.bind_tasks([ScheduledTask(r, len(r.prompt_ids)) for r in reqs])
    logits = ex.forward(batch, all_logits=True)
    for r in reqs:
        ex.cache.release(r)
    return list(logits.split([len(p) for p in prompts]))
