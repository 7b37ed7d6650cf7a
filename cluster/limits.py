"""Per-request limits, checked by the ingress before a request is tokenized or queued.

Each check raises an ApiError (413, 415 or 400 naming the field), so an oversized or
hostile request costs the ingress a header read or a bounded body read, and never
reaches a worker. The body is read under its size limit: a declared Content-Length over
the limit is refused before reading, and a chunked body stops being read as soon as it
passes the limit, so a 10 MB body never sits in the ingress's memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from cluster.config import RequestLimits
from cluster.errors import ApiError
from cluster.protocol import ChatCompletionRequest, CompletionRequest
from worker import validation
from worker.sampling import SamplingParams
from worker.validation import InvalidRequest

_JSON_SUBTYPE = "json"


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")


def check_content_length(headers: Mapping[str, str], max_bytes: int) -> None:
    """Refuse by the declared length alone; a body without one is bounded while read."""
    declared = headers.get("content-length")
    if declared is None:
        return
    if not declared.strip().isdigit():
        raise ApiError(400, "Content-Length is not a number", code="invalid_header")
    if int(declared) > max_bytes:
        raise too_large(max_bytes)


async def read_limited(chunks: AsyncIterator[bytes], max_bytes: int) -> bytes:
    """The whole body, or a 413 as soon as more than `max_bytes` have arrived."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        parts.append(chunk)
    return b"".join(parts)


def check_content_type(headers: Mapping[str, str]) -> None:
    """JSON, or no Content-Type at all (read as JSON, like FastAPI); anything else is 415."""
    value = headers.get("content-type")
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if kind == "application" and (subtype == _JSON_SUBTYPE or subtype.endswith("+json")):
        return
    raise ApiError(
        415,
        f"Content-Type must be application/json, not {media or 'empty'!r}",
        code="unsupported_media_type",
    )


def check_request(req: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> None:
    """The operator's limits on one parsed request (those that need no tokenizer)."""
    if req.n > limits.max_n:
        raise ApiError(400, f"n must be at most {limits.max_n}", param="n")
    _check_max_tokens(req, limits.max_tokens)
    _check_stops(req.stop_list, limits)
    stop_ids = req.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_token_ids:
        raise ApiError(
            400,
            f"at most {limits.max_stop_token_ids} stop_token_ids are accepted",
            param="stop_token_ids",
        )
    if isinstance(req, CompletionRequest):
        count = len(req.prompts())
        if count > limits.max_prompts:
            raise ApiError(
                400,
                f"at most {limits.max_prompts} prompts per request ({count} sent)",
                param="prompt",
            )


def _check_max_tokens(req: ChatCompletionRequest | CompletionRequest, cap: int | None) -> None:
    """Only what the client set: a default (16 for completions) is lowered, not refused."""
    if cap is None:
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        if name in req.model_fields_set and value is not None and value > cap:
            raise ApiError(400, f"{name} must be at most {cap}", param=name)


def _check_stops(stops: Sequence[str], limits: RequestLimits) -> None:
    if len(stops) > limits.max_stop:
        raise ApiError(400, f"at most {limits.max_stop} stop sequences are accepted", param="stop")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise ApiError(
            400, f"stop sequences must be at most {limits.max_stop_chars} characters", param="stop"
        )


def with_default_max_tokens(
    req: ChatCompletionRequest | CompletionRequest, cap: int | None
) -> ChatCompletionRequest | CompletionRequest:
    """A request that sets no max_tokens gets the operator's cap (or the protocol's default,
    if lower), so the cap always holds."""
    if cap is None:
        return req
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req
    if req.max_tokens is not None and "max_tokens" in req.model_fields_set:
        return req
    default = req.max_tokens
    return req.model_copy(update={"max_tokens": cap if default is None else min(default, cap)})


def _api_error(exc: InvalidRequest, field: str) -> ApiError:
    param = field if exc.param == "prompt" else exc.param
    return ApiError(400, exc.message, param=param, code=exc.code)


def check_prompt_ids(prompt: Sequence[int], vocab_size: int, field: str) -> None:
    """Token ids a client sent must name tokens of the vocabulary (the worker's own rule)."""
    try:
        validation.check_prompt_ids(prompt, vocab_size)
    except InvalidRequest as exc:
        raise _api_error(exc, field) from None


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Biased token ids must name tokens of the vocabulary (the worker's own rule)."""
    try:
        validation.check_logit_bias(params, vocab_size)
    except InvalidRequest as exc:
        raise _api_error(exc, "logit_bias") from None


def check_prompt_tokens(prompt: Sequence[int], cap: int | None, field: str) -> None:
    if cap is not None and len(prompt) > cap:
        raise ApiError(
            400,
            f"the prompt has {len(prompt)} tokens; this server accepts at most {cap}",
            param=field,
            code="context_length_exceeded",
        )


# what one token's text may lose when decoded alone (a leading space, a split character)
_DECODE_MARGIN_CHARS = 4


def longest_token_chars(decode: Callable[..., str], vocab_size: int) -> int:
    """An upper bound of the characters one token stands for: the longest decoded token,
    special tokens included (a client can type them), plus a margin."""
    longest = max(len(decode([i], skip_special_tokens=False)) for i in range(vocab_size))
    return longest + _DECODE_MARGIN_CHARS


def check_text_size(num_chars: int, token_chars: int, max_tokens: int, field: str) -> None:
    """Refuse, untokenized, a text that needs more than `max_tokens` tokens whatever they are."""
    if num_chars > token_chars * max_tokens:
        raise ApiError(
            400,
            f"the input ({num_chars} characters) is longer than this model's context of "
            f"{max_tokens} prompt tokens can hold",
            param=field,
            code="context_length_exceeded",
        )


def check_fan_out(num_prompts: int, n: int, max_waiting: int) -> None:
    """Every prompt x n sequences of one request must fit a worker's waiting queue at once."""
    total = num_prompts * n
    if total > max_waiting:
        raise ApiError(
            400,
            f"this request asks for {total} sequences ({num_prompts} prompts x n={n}); "
            f"a worker queues at most {max_waiting}",
            param="n" if num_prompts == 1 else "prompt",
        )


def check_context(
    prompt_len: int, max_tokens: int | None, max_seq_len: int, cap: int | None, field: str
) -> None:
    """The prompt, and the prompt plus the tokens asked for, must fit the model's context
    (the worker's own rule).

    The operator's max_tokens cap is also the default of requests that set none; such a
    request stops where the context ends (`fit_context` lowers it), as one without any cap
    would.
    """
    if max_tokens is not None and max_tokens == cap:
        max_tokens = fit_context(prompt_len, max_tokens, max_seq_len)
    try:
        validation.check_context(prompt_len, max_tokens, max_seq_len)
    except InvalidRequest as exc:
        raise _api_error(exc, field) from None


def fit_context(prompt_len: int, max_tokens: int | None, max_seq_len: int) -> int | None:
    """`max_tokens` lowered to what the context leaves after the prompt (the engine stops
    there anyway), so every request a worker receives passes its context check."""
    if max_tokens is None:
        return None
    return min(max_tokens, max(1, max_seq_len - prompt_len))  # 0 (echo) stays 0
