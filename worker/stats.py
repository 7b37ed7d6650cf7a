"""What the engine reports about itself: EngineStats, per-step records, the pacer's feed."""

from __future__ import annotations

import time
from dataclasses import dataclass

from worker.cache import KVCache
from worker.executor import PendingStep
from worker.outputs import RequestMetrics
from worker.request import Request
from worker.scheduler import PromptPacer, Scheduler


@dataclass(slots=True)
class StepRecord:
    """One resolved step, for profiling (`Engine.step_log`)."""

    seconds: float  # wall time of the `step()` call that read this step's results
    num_decodes: int  # requests advancing by one token of their output
    num_prompt_tokens: int  # prompt (or recomputed) tokens in the step
    overlapped: bool  # queued on the device before its predecessor's tokens were read
    launch_seconds: float = 0.0  # host time that queued it (bind, forward, sampling launched)
    schedule_seconds: float = 0.0  # host time that chose its tasks (and drained inputs)
    device_wait_seconds: float = 0.0  # host time blocked on the device for its tokens
    mask_wait_seconds: float = 0.0  # host time blocked on its grammars' masks
    decode_context_tokens: int = 0  # KV tokens its decodes' attention reads (whole contexts)


@dataclass(slots=True)
class EngineStats:
    num_waiting: int = 0
    num_running: int = 0
    waiting_tokens: int = 0
    num_free_pages: int = 0
    num_total_pages: int = 0
    kv_usage: float = 0.0
    prefix_hits: int = 0
    prefix_queries: int = 0
    prefix_hit_rate: float = 0.0
    num_steps: int = 0
    step_seconds_total: float = 0.0  # wall time of those steps' `Engine.step` calls, summed
    num_preemptions: int = 0
    last_step_time: float = 0.0
    loop_alive: bool = False
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class StepObserver:
    """Counts and times the engine's steps; feeds each resolved step's time to the prompt pacer
    and, when `step_log` is a list, appends a StepRecord for it."""

    def __init__(self, pacer: PromptPacer | None):
        self.pacer = pacer
        self.step_log: list[StepRecord] | None = None
        self.num_steps = 0
        self.num_overlapped_steps = 0  # steps queued before their predecessor's tokens were read
        self.step_seconds = 0.0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def launched(self, step: PendingStep) -> None:
        """Note a step's shape at launch, before its requests advance past it."""
        if step.overlapped:
            self.num_overlapped_steps += 1
        if self.pacer is not None or self.step_log is not None:
            decodes = prompt = context = 0
            for t in step.tasks:
                if t.num_new == 1 and t.request.output_ids:
                    decodes += 1
                    context += t.request.num_computed + 1
                else:
                    prompt += t.num_new
            step.num_decodes, step.num_prompt_tokens = decodes, prompt
            step.decode_context_tokens = context

    def resolved(self, step: PendingStep, started: float) -> None:
        """After `step`'s results are applied, in the `Engine.step` call begun at `started`."""
        self.num_steps += 1
        if self.pacer is None and self.step_log is None:
            return
        seconds = time.perf_counter() - started
        decodes, prompt = step.num_decodes, step.num_prompt_tokens
        if self.pacer is not None:
            # on CUDA the step's own span on the device: with overlap its wall time includes
            # the next step's launch
            self.pacer.observe(step.device_seconds() or seconds, decodes, prompt)
        log = self.step_log
        if log is not None:
            log.append(
                StepRecord(
                    seconds,
                    decodes,
                    prompt,
                    step.overlapped,
                    step.launch_seconds,
                    step.schedule_seconds,
                    step.device_wait_seconds,
                    step.mask_wait_seconds,
                    step.decode_context_tokens,
                )
            )

    def snapshot(self, cache: KVCache, sched: Scheduler) -> EngineStats:
        hits, queries = cache.prefix_stats
        free, total = cache.num_free_pages, cache.num_total_pages
        return EngineStats(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            waiting_tokens=sum(r.num_pending for r in sched.waiting),
            num_free_pages=free,
            num_total_pages=total,
            kv_usage=1.0 - free / total if total else 0.0,
            prefix_hits=hits,
            prefix_queries=queries,
            prefix_hit_rate=hits / queries if queries else 0.0,
            num_steps=self.num_steps,
            step_seconds_total=self.step_seconds,
            num_preemptions=sched.num_preemptions,
            last_step_time=time.monotonic(),
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.generation_tokens,
        )


def request_metrics(r: Request) -> RequestMetrics:
    """A request's latencies so far (final once it has finished)."""
    end = r.finish_time or time.monotonic()
    first = r.first_token_time
    n_out = len(r.output_ids)
    return RequestMetrics(
        queue_time=(r.first_scheduled_time or end) - r.arrival_time,
        time_to_first_token=(first or end) - r.arrival_time,
        time_per_output_token=(end - first) / (n_out - 1)
        if first is not None and n_out > 1
        else 0.0,
        e2e_latency=end - r.arrival_time,
        num_preemptions=r.num_preemptions,
    )
