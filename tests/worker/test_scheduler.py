"""Step composition of the scheduler on a real PageCache (CPU, no model): the token budget,
and the prefill budget that keeps long prompt chunks out of steps that carry decodes."""

from __future__ import annotations

import torch

from worker.cache import KVStorage, PageCache, ReqToTokenPool
from worker.config import EngineConfig
from worker.request import Request, ScheduledTask
from worker.sampling import SamplingParams
from worker.scheduler import PromptPacer, Scheduler, _one_token_rows_first
from worker.workspace import InferenceWorkspace

PAGE, PAGES = 4, 128


def scheduler(
    token_budget: int,
    prefill_budget: int | None,
    prefill_slowdown: float | None = None,
    max_running: int = 8,
) -> Scheduler:
    dev = torch.device("cpu")
    ws = InferenceWorkspace(max_tokens=256, max_running=8, max_seq_len=256, num_heads=2, head_dim=8,
                            dtype=torch.float32, device=dev, split_kv=False)  # fmt: skip
    storage = KVStorage(2, PAGES * PAGE, 1, 8, torch.float32, dev)
    cache = PageCache(storage, ReqToTokenPool(8, 256, dev, staging=512), PAGE, PAGES, ws, False)
    config = EngineConfig.from_flat(
        token_budget=token_budget,
        prefill_budget=prefill_budget,
        prefill_slowdown=prefill_slowdown,
        max_running=max_running,
        admission_watermark=0.0,
    )
    return Scheduler(config, cache)


def request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams())


def step(s: Scheduler) -> dict[str, int]:
    """Run one schedule as the engine would (every task computed, one token sampled each)."""
    tasks, too_long = s.schedule()
    assert not too_long
    for t in tasks:
        t.request.num_computed += t.num_new
        if t.request.num_pending == 0:
            t.request.output_ids.append(7)
    return {t.request.request_id: t.num_new for t in tasks}


def test_a_prompt_takes_the_whole_token_budget_when_nothing_decodes() -> None:
    s = scheduler(token_budget=64, prefill_budget=8)
    s.add(request("long", 100))
    assert step(s) == {"long": 64}  # nothing decodes: the prefill budget does not apply
    assert step(s) == {"long": 36}


def test_while_requests_decode_prompt_chunks_take_at_most_the_prefill_budget() -> None:
    s = scheduler(token_budget=64, prefill_budget=8)
    s.add(request("a", 5))
    s.add(request("b", 6))
    assert step(s) == {"a": 5, "b": 6}
    s.add(request("long", 30))
    seen = [step(s) for _ in range(4)]
    assert seen == [
        {"a": 1, "b": 1, "long": 8},
        {"a": 1, "b": 1, "long": 8},
        {"a": 1, "b": 1, "long": 8},
        {"a": 1, "b": 1, "long": 6},
    ]
    assert step(s) == {"a": 1, "b": 1, "long": 1}  # now decoding too


def test_two_prompts_share_one_prefill_budget() -> None:
    s = scheduler(token_budget=64, prefill_budget=10)
    s.add(request("a", 3))
    assert step(s) == {"a": 3}
    s.add(request("p", 7))
    s.add(request("q", 9))
    assert step(s) == {"a": 1, "p": 7, "q": 3}
    assert step(s) == {"a": 1, "p": 1, "q": 6}


def test_without_a_prefill_budget_prompts_fill_what_decodes_leave() -> None:
    s = scheduler(token_budget=32, prefill_budget=None)
    s.add(request("a", 4))
    assert step(s) == {"a": 4}
    s.add(request("long", 100))
    assert step(s) == {"a": 1, "long": 31}


def test_decodes_come_first_in_a_step() -> None:
    """The CUDA backend runs a step's leading one-token rows with its decode kernel. Admission
    order already puts decodes first (an earlier request's chunk always has priority, so a
    later one cannot finish its prompt first); the step's task list guarantees it anyway."""
    s = scheduler(token_budget=64, prefill_budget=6)
    s.add(request("long", 30))
    assert step(s) == {"long": 30}
    s.add(request("p", 20))
    s.add(request("short", 2))
    step(s)
    tasks, _ = s.schedule()
    assert [(t.request.request_id, t.num_new) for t in tasks][:2] == [("long", 1), ("p", 6)]
    mixed = [ScheduledTask(request(f"r{i}", 5), n) for i, n in enumerate([7, 1, 3, 1, 1, 9])]
    ordered = _one_token_rows_first(mixed)
    assert [t.request.request_id for t in ordered] == ["r1", "r3", "r4", "r0", "r2", "r5"]
    in_order = [ScheduledTask(request(f"s{i}", 5), n) for i, n in enumerate([1, 1, 4, 6])]
    assert _one_token_rows_first(in_order) is in_order


def test_the_pacer_learns_a_decode_step_and_a_prompt_token_and_sizes_the_share() -> None:
    pacer = PromptPacer(slowdown=1.8, min_tokens=4)
    assert pacer.budget(4) is None
    pacer.observe(0.5, num_decodes=0, num_prompt_tokens=64)  # prompt alone: no decodes wait on it
    pacer.observe(0.3, num_decodes=4, num_prompt_tokens=40)  # no decode-only time to compare yet
    assert pacer.budget(4) is None
    pacer.observe(0.100, num_decodes=4, num_prompt_tokens=0)
    assert pacer.budget(4) is None  # no prompt token measured yet
    pacer.observe(0.100 + 64 * 0.0025, num_decodes=4, num_prompt_tokens=64)
    assert pacer.budget(4) == 32  # 0.8 x 100 ms / 2.5 ms
    for _ in range(40):  # the machine gets slower per prompt token: the share shrinks
        pacer.observe(0.100, num_decodes=4, num_prompt_tokens=0)
        pacer.observe(0.100 + 32 * 0.010, num_decodes=4, num_prompt_tokens=32)
    assert 8 <= pacer.budget(4) <= 9  # -> 0.8 x 100 / 10
    for _ in range(40):
        pacer.observe(0.100 + 32 * 0.100, num_decodes=4, num_prompt_tokens=32)
    assert pacer.budget(4) == 4  # never below min_tokens: prompts must advance


def test_the_pacer_charges_a_big_batchs_decodes_to_the_decodes_not_to_its_prompt_chunk() -> None:
    """GPU-like: a decode-only step costs 4 ms + 30 us a decode, a prompt token 30 us. The
    decode-only steps seen are small (4-64 decodes), the mixed ones carry 256 decodes. The
    line through the small steps prices the 256 decodes (11.7 ms), so the prompt token is
    priced right and a 256-decode step may take 0.8 x 11.7 ms / 30 us = 311 prompt tokens.
    (Against the small steps' average, the 256 decodes' extra time was charged to the chunk:
    the share fell to its minimum and stayed there.)"""
    pacer = PromptPacer(slowdown=1.8)
    for b in (4, 8, 16, 32, 64, 8, 4):
        pacer.observe(0.004 + 30e-6 * b, num_decodes=b, num_prompt_tokens=0)
    for _ in range(30):
        share = pacer.budget(256) or 2048
        pacer.observe(0.004 + 30e-6 * 256 + 30e-6 * share, num_decodes=256, num_prompt_tokens=share)
    assert abs(pacer.decode_step_s(256) - (0.004 + 30e-6 * 256)) < 1e-6
    assert 305 <= pacer.budget(256) <= 317
    # ~110 at 4 decodes
    assert 0.8 * 0.00412 / 30e-6 - 2 <= pacer.budget(4) <= 0.8 * 0.00412 / 30e-6 + 2


def _gpu_like(pacer: PromptPacer, fixed_s: float, steps: int = 60) -> None:
    """Decode-only steps of 4 ms + 30 us a decode; mixed steps of 64 decodes add `fixed_s`
    (eager forward, prefill metadata) + 25 us a prompt token. Chunks are the pacer's share,
    or a prompt's remainder now and then."""
    for b in (8, 16, 32, 64, 48, 24):
        pacer.observe(0.004 + 30e-6 * b, num_decodes=b, num_prompt_tokens=0)
    for i in range(steps):
        share = pacer.budget(64) or 512
        chunk = share if i % 3 else max(1, share // 3)
        pacer.observe(
            0.004 + 30e-6 * 64 + fixed_s + 25e-6 * chunk, num_decodes=64, num_prompt_tokens=chunk
        )
        pacer.observe(0.004 + 30e-6 * 64, num_decodes=64, num_prompt_tokens=0)


def test_the_pacer_separates_a_mixed_steps_fixed_cost_from_its_prompt_tokens() -> None:
    """0.8 x 5.92 ms = 4.74 ms of room, 2 ms of it fixed: (4.74 - 2) ms / 25 us = 109 tokens.
    (Charging the fixed 2 ms to the chunk's tokens drove the share down to its minimum on an
    H200, and the engine no longer kept up with 8 requests a second.)"""
    pacer = PromptPacer(slowdown=1.8)
    _gpu_like(pacer, fixed_s=0.002)
    fixed, per_token = pacer.prompt_cost()
    assert abs(fixed - 0.002) < 1e-5 and abs(per_token - 25e-6) < 1e-7
    assert 107 <= pacer.budget(64) <= 111


def test_the_pacer_does_not_cap_prompts_when_no_chunk_can_meet_the_bound() -> None:
    """A mixed step's fixed cost alone (6 ms) is more than 0.8 x a 5.92 ms decode step: no
    chunk keeps it within 1.8x, so the pacer lets prompts through rather than starve them."""
    pacer = PromptPacer(slowdown=1.8)
    _gpu_like(pacer, fixed_s=0.006)
    assert abs(pacer.prompt_cost()[0] - 0.006) < 1e-5
    assert pacer.budget(64) is None


def test_with_a_slowdown_prompt_chunks_next_to_decodes_take_the_pacers_share() -> None:
    s = scheduler(token_budget=64, prefill_budget=None, prefill_slowdown=1.5)
    assert s.pacer is not None
    s.add(request("a", 5))
    assert step(s) == {"a": 5}
    s.add(request("long", 63))
    assert step(s) == {"a": 1, "long": 63}  # nothing learnt yet: what the token budget leaves
    s.pacer.observe(0.2, num_decodes=2, num_prompt_tokens=0)
    s.pacer.observe(0.2 + 20 * 0.005, num_decodes=2, num_prompt_tokens=20)
    assert s.pacer.budget(2) == 20  # 0.5 x 200 ms / 5 ms
    s.add(request("next", 30))
    assert step(s) == {"a": 1, "long": 1, "next": 20}
    s.prefill_budget = 6  # a configured cap still holds when it is the smaller one
    assert step(s) == {"a": 1, "long": 1, "next": 6}
