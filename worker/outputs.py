"""Plain data that leaves the engine: per-step deltas and finished request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None  # among the whole vocabulary, 1 = most likely (prompt tokens only)


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one finished request, in seconds."""

    queue_time: float  # arrival -> first scheduled
    time_to_first_token: float  # arrival -> first token
    time_per_output_token: float  # mean gap between tokens after the first (0 with one token)
    e2e_latency: float  # arrival -> finish
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestDelta:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # on the request's last delta
    # with prompt_logprobs asked for: prompt token j's at index j (None for the first), on
    # the request's first delta
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def merge_steps(frames: list[list[RequestDelta]]) -> list[RequestDelta]:
    """Several steps' frames as one: one delta per request (in order of first appearance),
    its tokens and logprobs in step order, and the last step's finish, error and metrics.
    A consumer that fell behind reads this instead of a request's steps one by one."""
    merged: dict[str, RequestDelta] = {}
    for frame in frames:
        for d in frame:
            prev = merged.get(d.request_id)
            if prev is None:
                merged[d.request_id] = d
                continue
            logprobs = None
            if prev.logprobs is not None or d.logprobs is not None:
                logprobs = (prev.logprobs or []) + (d.logprobs or [])
            merged[d.request_id] = RequestDelta(
                d.request_id,
                prev.new_token_ids + d.new_token_ids,
                logprobs,
                d.finish_reason,
                d.error or prev.error,
                d.num_prompt_tokens,
                max(prev.num_cached_tokens, d.num_cached_tokens),
                d.metrics or prev.metrics,
                prev.prompt_logprobs or d.prompt_logprobs,
            )
    return list(merged.values())


@dataclass(slots=True)
class RequestOutput:
    """A finished request, as `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # index j: prompt token j's
