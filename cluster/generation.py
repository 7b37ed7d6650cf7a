"""One OpenAI request in the ingress: from worker deltas to choice deltas.

Each choice (an engine request) has its own incremental detokenizer (`TextStream`), which
also applies stop strings. When a stop string hits, the request is aborted on the worker at
once so its KV pages go back; the engine itself stops on EOS, stop token ids and lengths.
Timing of every choice feeds the latency histograms. `ClosingStreamingResponse` makes
sure a streaming request is aborted however its HTTP response ends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cluster.dispatch import CallError, GroupStream
from cluster.protocol import FinishReason
from worker.outputs import RequestDelta, RequestMetrics, TokenLogprobs
from worker.sampling import SamplingParams
from worker.tokenizer import TextStream, Tokenizer

# (ttft_s, tpot_s | None, e2e_s, num_generated) of one finished choice
LatencySink = Callable[[float, float | None, float, int], None]


@dataclass(slots=True)
class ChoiceDelta:
    """New text of one choice; `finish_reason` is set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on its first delta, if asked


@dataclass(slots=True)
class _Choice:
    index: int
    request_id: str
    detok: TextStream
    num_tokens: int = 0
    num_cached: int = 0
    first_token_at: float | None = None
    finished: bool = False


@dataclass
class Generation:
    """Drives one GroupStream; `deltas()` yields one list of ChoiceDelta per engine step."""

    stream: GroupStream
    tokenizer: Tokenizer
    params: SamplingParams
    arrival: float
    on_latency: LatencySink
    n: int = 1  # samples per prompt: choice i belongs to prompt i // n
    on_engine_metrics: Callable[[RequestMetrics], None] | None = None  # engine timings of a choice
    num_prompt_tokens: int = 0
    _choices: dict[str, _Choice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for index, request in enumerate(self.stream.group.requests):
            detok = TextStream(
                self.tokenizer,
                stop=list(self.params.stop),
                include_stop_str_in_output=self.params.include_stop_str_in_output,
                skip_special_tokens=self.params.skip_special_tokens,
            )
            self._choices[request.request_id] = _Choice(index, request.request_id, detok)
            if index % self.n == 0:
                self.num_prompt_tokens += len(request.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        return sum(c.num_cached for c in self._choices.values() if c.index % self.n == 0)

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self._choices.values())

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        try:
            async for frame in self.stream:
                out = [d for d in (self._advance(delta) for delta in frame) if d is not None]
                if out:
                    yield out
        finally:
            self.stream.close()

    def _advance(self, delta: RequestDelta) -> ChoiceDelta | None:
        choice = self._choices[delta.request_id]
        if choice.finished:
            return None
        if delta.finish_reason == "error" or delta.error:
            raise CallError("internal", delta.error or "the worker failed this request")
        if delta.finish_reason == "abort":
            raise CallError("unavailable", "the worker aborted this request")
        choice.num_cached = max(choice.num_cached, delta.num_cached_tokens)
        now = time.perf_counter()
        if delta.new_token_ids and choice.first_token_at is None:
            choice.first_token_at = now
        choice.num_tokens += len(delta.new_token_ids)
        text = choice.detok.push(delta.new_token_ids)
        finish: FinishReason | None = None
        if choice.detok.stopped:
            finish = "stop"
            self.stream.abort([choice.request_id])
        elif delta.finish_reason is not None:
            text += choice.detok.finish()
            finish = "length" if delta.finish_reason == "length" else "stop"
        if finish is not None:
            choice.finished = True
            self._record(choice, now)
        if delta.metrics is not None and self.on_engine_metrics is not None:
            self.on_engine_metrics(delta.metrics)
        return ChoiceDelta(
            choice.index, text, delta.new_token_ids, delta.logprobs, finish, delta.prompt_logprobs
        )

    def _record(self, choice: _Choice, now: float) -> None:
        first = choice.first_token_at if choice.first_token_at is not None else now
        ttft = first - self.arrival
        tpot = (now - first) / (choice.num_tokens - 1) if choice.num_tokens > 1 else None
        self.on_latency(ttft, tpot, now - self.arrival, choice.num_tokens)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` however the response ends.

    Starlette (ASGI spec < 2.4, which uvicorn and Serve's proxy speak) runs the body and a
    disconnect listener side by side and cancels the body once the client is gone. When the
    disconnect arrives before the body generator has started (the client left before the
    first byte), the generator never runs, so no `finally` inside it ever runs either and
    the request would keep generating to `max_tokens`. Closing here covers that case, a
    cancellation of the whole handler, and the normal end alike; `on_close` must be
    idempotent."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):  # a generator still running
                    await aclose()  # a started, suspended generator runs its own cleanup now
