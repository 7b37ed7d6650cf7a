"""Continuous batching under a per-step token budget.

Every running request advances every step: decodes take one token each, unfinished
prompts take chunks of what the budget leaves, and waiting requests are admitted into the
rest while KV pages last (above a watermark). With `prefill_budget` set, prompt chunks
(and recomputations) take at most that many tokens of a step in which requests decode: a
step that carries a long prompt chunk next to the decodes is what makes inter-token
latency spiky. When pages run out mid-decode, the newest
running request is preempted: its pages go back (full ones stay in the prefix cache) and
it returns to the front of the queue to be recomputed. Nothing is aborted for memory.
A step's tasks list its one-token rows (decodes) first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from worker.cache import KVCache
from worker.config import EngineConfig
from worker.request import Request, ScheduledTask, Status


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVCache):
        self.cache = cache
        self.token_budget = config.token_budget
        self.prefill_budget = config.prefill_budget
        self.max_running = config.max_running
        self.watermark_pages = int(config.admission_watermark * cache.num_total_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished or aborted) and give back its KV."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        self.cache.release(request)

    def schedule(self, skip: Collection[Request] = ()) -> tuple[list[ScheduledTask], list[Request]]:
        """This step's tasks, and requests that cannot ever fit (finish them with 'length').

        `skip`: running requests to leave out (they finish with a step still in flight)."""
        budget = self.token_budget
        decoding = any(r.num_pending == 1 for r in self.running)
        prefill = self.prefill_budget if decoding and self.prefill_budget is not None else budget
        tasks: list[ScheduledTask] = []
        too_long: list[Request] = []
        for request in list(self.running):
            if request.status is not Status.RUNNING or request in skip:
                continue  # preempted earlier in this loop, or finishing
            pending = request.num_pending
            num_new = min(pending, budget if pending == 1 else min(budget, prefill))
            if budget == 0:
                break
            if num_new == 0:
                continue  # a prompt chunk, and this step's prefill share is spent
            if not self._reserve_or_preempt(request, num_new):
                if request.status is Status.RUNNING:  # alone and still out of pages
                    too_long.append(request)
                continue
            tasks.append(ScheduledTask(request, num_new))
            budget -= num_new
            if pending > 1:
                prefill -= num_new
        self._admit(tasks, budget, prefill)
        return _one_token_rows_first(tasks), too_long

    def _reserve_or_preempt(self, request: Request, num_new: int) -> bool:
        while not self.cache.reserve(request, num_new):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                return False
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.release(request)
        request.status = Status.WAITING
        request.num_computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, tasks: list[ScheduledTask], budget: int, prefill: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            if not self.cache.admit(request):
                break
            pending = request.num_pending  # after the prefix cache's hit
            num_new = min(pending, budget if pending == 1 else min(budget, prefill))
            free_after = self.cache.num_free_pages - self.cache.pages_needed(request, num_new)
            if num_new == 0 or (self.running and free_after < self.watermark_pages) or not self.cache.reserve(request, num_new):
                self.cache.release(request)
                request.num_computed = 0
                break
            self.waiting.popleft()
            self.cache.admitted(request)
            request.status = Status.RUNNING
            self.running.append(request)
            tasks.append(ScheduledTask(request, num_new))
            budget -= num_new
            if pending > 1:
                prefill -= num_new


def _one_token_rows_first(tasks: list[ScheduledTask]) -> list[ScheduledTask]:
    """Decodes (and one-token chunks) ahead of longer chunks, each group in order: the CUDA
    backend runs a batch's leading one-token rows with its decode kernel."""
    seen_chunk = False
    for t in tasks:
        if t.num_new != 1:
            seen_chunk = True
        elif seen_chunk:
            return [t for t in tasks if t.num_new == 1] + [t for t in tasks if t.num_new != 1]
    return tasks
