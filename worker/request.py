"""Request: one sequence's state inside the engine (computed tokens, not phases)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from worker.outputs import FinishReason, TokenLogprobs
from worker.sampling import SamplingParams

if TYPE_CHECKING:
    from worker.grammar import GrammarState

# an output token still on the device: sampled by a step whose results are not read yet
PENDING = -1


class Status(enum.Enum):
    COMPILING = "compiling"  # its grammar is compiling: not yet in the scheduler
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """`num_computed` tokens of `prompt_ids + output_ids` have KV in the cache; the scheduler closes the gap."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served by the prefix cache at first admission
    row: int = -1  # req_to_token row while it holds KV
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    page_keys: list[int] = field(default_factory=list)  # chained hashes of its full pages
    logprobs: list[TokenLogprobs] | None = None
    # with params.prompt_logprobs: prompt token j's logprobs at index j (None for the first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # on a delta already (the request's first)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    grammar: GrammarState | None = None  # set once its grammar (params.guided) is compiled

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, stop: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return self.prompt_ids[start:stop]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - n_prompt]

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(slots=True)
class ScheduledTask:
    """One request's share of a step: `num_new` tokens starting at position `request.num_computed`."""

    request: Request
    num_new: int

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the request's known tokens (so a token is sampled)?"""
        return self.request.num_computed + self.num_new == self.request.num_tokens
