"""What a request must be to enter an engine: one set of rules for the ingress and the worker.

The ingress checks a request before it sends it and the worker checks it again as it
arrives, with these same functions, so a caller that skips the ingress (a bug, or anyone who
can reach a worker replica) gets the same answer an HTTP client would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.guided import check_guided
from worker.sampling import SamplingParams

MAX_REQUEST_ID_CHARS = 256


class InvalidRequest(ValueError):
    """A request no engine takes; `param` names the field at fault, `code` the OpenAI code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(slots=True)
class EngineRequest:
    """One sequence to generate: what the ingress sends and the engine queues."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def check_prompt_ids(prompt: Sequence[object], vocab_size: int, field: str = "prompt") -> None:
    """A prompt is a non-empty list of integer token ids of the vocabulary."""
    if not prompt:
        raise InvalidRequest("the prompt is empty", param=field)
    for token in prompt:
        if type(token) is not int:  # bool and float are not token ids
            raise InvalidRequest(
                f"token ids must be integers, not {type(token).__name__}",
                param=field,
                code="invalid_token_id",
            )
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"token id {token} is outside the vocabulary [0, {vocab_size})",
                param=field,
                code="invalid_token_id",
            )


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """The tokens a request biases are tokens of the vocabulary."""
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise InvalidRequest(
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                param="logit_bias",
                code="invalid_token_id",
            )


def check_context(
    prompt_len: int, max_tokens: int | None, max_seq_len: int, field: str = "prompt"
) -> None:
    """The prompt, and the prompt plus the tokens asked for, fit the model's context."""
    if prompt_len >= max_seq_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_seq_len} tokens. "
            f"However, your prompt is {prompt_len} tokens.",
            param=field,
            code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_seq_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_seq_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )


def check_request(request: EngineRequest, vocab_size: int, max_seq_len: int) -> None:
    """Everything the engine relies on: an id, a prompt of the vocabulary that fits the
    context with its `max_tokens`, sampling parameters that passed their own checks, and a
    grammar (if any) that compiles."""
    rid = request.request_id
    if type(rid) is not str or not 0 < len(rid) <= MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"a request id is a string of 1 to {MAX_REQUEST_ID_CHARS} characters",
            param="request_id",
        )
    if not isinstance(request.params, SamplingParams):
        raise InvalidRequest("sampling parameters are missing", param="params")
    if not isinstance(request.prompt_token_ids, list):
        raise InvalidRequest("the prompt is a list of token ids", param="prompt")
    check_prompt_ids(request.prompt_token_ids, vocab_size)
    check_context(len(request.prompt_token_ids), request.params.max_tokens, max_seq_len)
    check_logit_bias(request.params, vocab_size)
    if request.params.guided is not None:
        try:
            check_guided(request.params.guided)
        except ValueError as exc:
            raise InvalidRequest(f"invalid guided decoding: {exc}", param="guided") from None
