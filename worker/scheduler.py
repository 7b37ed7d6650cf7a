"""Continuous batching under a per-step token budget.

Every running request advances every step: decodes take one token each, unfinished
prompts take chunks of what the budget leaves, and waiting requests are admitted into the
rest while KV pages last (above a watermark). With `prefill_budget` set, prompt chunks
(and recomputations) take at most that many tokens of a step in which requests decode: a
step that carries a long prompt chunk next to the decodes is what makes inter-token
latency spiky. With `prefill_slowdown` set, that cap is measured instead (PromptPacer):
as many prompt tokens as keep such a step within that many times a decode-only step.
When pages run out mid-decode, the newest running request is preempted: its pages go back
(full ones stay in the prefix cache) and it returns to the front of the queue to be
recomputed. Nothing is aborted for memory. A step's tasks list its one-token rows (decodes)
first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from worker.cache import KVCache
from worker.config import EngineConfig
from worker.request import Request, ScheduledTask, Status


class PromptPacer:
    """Prompt tokens a step may carry next to decodes so that it takes at most `slowdown`
    times a decode-only step: Sarathi-Serve's stall-free batching, with the budget learnt
    from the engine's own step times rather than configured per machine and model.

    Two least-squares lines, each observation weighing `decay` times less than the next:
    - a decode-only step's time in its number of decodes B: a + b x B;
    - a mixed step's extra time over that line in its prompt tokens P: E + c x P. E is what
      any mixed step costs whatever its chunk (such as the launches of an eager forward); c
      is a prompt token's cost.
    The budget of a step with B decodes is ((slowdown - 1) x (a + b x B) - E) / c, at least
    `min_tokens` (prompts must advance); None (no cap) until both lines are known, and None
    when E alone breaks the bound: then no chunk size keeps a mixed step within it, and a
    small one would only starve the queue. The decode line, not the average decode-only step,
    keeps a large batch's decodes from being charged to a prompt chunk, and E keeps a mixed
    step's fixed cost from being charged to its tokens (which would starve the queue).
    """

    def __init__(self, slowdown: float, min_tokens: int = 16, decay: float = 0.97):
        if slowdown <= 1:
            raise ValueError("slowdown must be > 1")
        self.slowdown, self.min_tokens, self.decay = slowdown, min_tokens, decay
        self._decode = _DecayingFit(decay)  # step time ~ decodes, over decode-only steps
        self._prompt = _DecayingFit(decay)  # extra time ~ prompt tokens, over mixed steps

    def observe(self, seconds: float, num_decodes: int, num_prompt_tokens: int) -> None:
        if num_decodes == 0:
            return  # a prompt-only step says nothing about what decodes wait for
        if num_prompt_tokens == 0:
            self._decode.add(num_decodes, seconds)
            return
        base = self.decode_step_s(num_decodes)
        if base is not None:
            self._prompt.add(num_prompt_tokens, max(seconds - base, 0.0))

    def decode_step_s(self, num_decodes: int) -> float | None:
        """The fitted time of a decode-only step of `num_decodes` decodes."""
        line = self._decode.line()
        if line is None:
            return None
        fixed, per_decode = line if line[1] >= 0 else (self._decode.mean_y, 0.0)
        return max(fixed + per_decode * num_decodes, 0.0)

    def prompt_cost(self) -> tuple[float, float] | None:
        """(E, c): a mixed step's fixed extra seconds and the seconds per prompt token."""
        line = self._prompt.line()
        if line is None:
            return None
        fixed, per_token = line
        if per_token <= 0:  # the chunks seen do not separate the two: all of it per token
            return 0.0, self._prompt.mean_y / self._prompt.mean_x if self._prompt.mean_x else 0.0
        return fixed, per_token

    def budget(self, num_decodes: int) -> int | None:
        base, cost = self.decode_step_s(num_decodes), self.prompt_cost()
        if base is None or cost is None or cost[1] <= 0:
            return None
        fixed, per_token = cost
        room = (self.slowdown - 1) * base - fixed
        if room <= 0:
            return None  # any mixed step breaks the bound: do not starve prompts for nothing
        return max(self.min_tokens, round(room / per_token))

    def describe(self, batches: tuple[int, ...] = (1, 16, 64, 256)) -> dict[str, object]:
        """What the pacer has learnt (for benchmarks and logs)."""
        cost = self.prompt_cost()
        return {
            "decode_step_ms": {b: _ms(self.decode_step_s(b)) for b in batches},
            "mixed_step_fixed_ms": None if cost is None else 1e3 * cost[0],
            "prompt_token_us": None if cost is None else 1e6 * cost[1],
            "budget": {b: self.budget(b) for b in batches},
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


class _DecayingFit:
    """Weighted least squares y ~ a + b x, each observation `decay` times less than the next.
    With too little spread in x the slope is 0 and the line is the mean."""

    def __init__(self, decay: float):
        self.decay = decay
        self._sums = [0.0] * 5  # weighted sums of 1, x, x^2, y, x*y

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._sums = [d * s + v for s, v in zip(self._sums, (1.0, x, x * x, y, x * y), strict=True)]

    @property
    def mean_x(self) -> float:
        return self._sums[1] / self._sums[0] if self._sums[0] else 0.0

    @property
    def mean_y(self) -> float:
        return self._sums[3] / self._sums[0] if self._sums[0] else 0.0

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None before any observation; b >= 0 is not enforced here."""
        n, sx, sxx, sy, sxy = self._sums
        if n == 0:
            return None
        mx, my = sx / n, sy / n
        var = sxx / n - mx * mx
        slope = (sxy / n - mx * my) / var if var > 1e-9 * max(1.0, mx * mx) else 0.0
        return my - slope * mx, slope


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVCache):
        self.cache = cache
        self.token_budget = config.token_budget
        self.prefill_budget = config.advanced.prefill_budget
        self.pacer = (
            PromptPacer(config.advanced.prefill_slowdown)
            if config.advanced.prefill_slowdown is not None
            else None
        )
        self.max_running = config.max_running
        self.watermark_pages = int(config.advanced.admission_watermark * cache.num_total_pages)
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
        decodes = (r.num_pending == 1 for r in self.running if r not in skip)
        # only the pacer needs the count
        decoding = sum(decodes) if self.pacer else int(any(decodes))
        prefill = self.prompt_share(decoding) if decoding else budget
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

    def prompt_share(self, num_decodes: int) -> int:
        """Prompt tokens a step may carry next to `num_decodes` decodes."""
        caps = [
            self.token_budget,
            self.prefill_budget,
            self.pacer.budget(num_decodes) if self.pacer else None,
        ]
        return min(c for c in caps if c is not None)

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
            task = self._admit_head(budget, prefill)
            if task is None:
                break
            tasks.append(task)
            budget -= task.num_new
            if task.request.num_pending > 1:
                prefill -= task.num_new

    def _admit_head(self, budget: int, prefill: int) -> ScheduledTask | None:
        """Move the head of the queue into `running` with its row and its first tokens' pages
        (after the prefix cache's hit): one token within `budget`, a prompt chunk within
        `prefill` too. None, and nothing changed, when no row, chunk or pages are left for it;
        while others run, the pages must also leave the watermark free."""
        request = self.waiting[0]
        if not self.cache.admit(request):
            return None
        pending = request.num_pending
        num_new = min(pending, budget if pending == 1 else min(budget, prefill))
        free_after = self.cache.num_free_pages - self.cache.pages_needed(request, num_new)
        if (
            num_new == 0
            or (self.running and free_after < self.watermark_pages)
            or not self.cache.reserve(request, num_new)
        ):
            self.cache.release(request)
            request.num_computed = 0
            return None
        self.waiting.popleft()
        self.cache.admitted(request)
        request.status = Status.RUNNING
        self.running.append(request)
        return ScheduledTask(request, num_new)


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
