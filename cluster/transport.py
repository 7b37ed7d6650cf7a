"""The wire format between ingress and worker replicas: msgpack over Serve calls.

A `submit` call carries a batch of engine requests (one or more OpenAI requests bound for
the same replica) and is answered with an *accept* frame (the replica id) or a *refuse*
frame (queue full, invalid input). The deltas of every request one ingress replica has on
a worker come on that pair's `session` stream, a Serve streaming call: an accept frame,
then one frame per engine step that advanced any of them (when the reader fell behind, one
frame for several steps, still one delta per request: `worker.outputs.merge_steps`), and an
empty frame (heartbeat) now and then while they wait in a queue that keeps moving. Aborts
are a third call, `abort`. Every frame is plain msgpack, so neither side unpickles anything
the other sent, and the worker checks what it decodes as the ingress did
(`worker.validation`). Serve handles are the only way in: a worker replica listens on no
port of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, cast

import msgpack
from pydantic import ValidationError

from worker.outputs import RequestDelta, RequestMetrics, TokenLogprobs
from worker.sampling import SamplingParams
from worker.validation import EngineRequest, InvalidRequest

RefusalKind = Literal["full", "invalid", "internal", "gone"]


@dataclass(frozen=True, slots=True)
class Accepted:
    """The worker queued every request of the call."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The worker queued nothing: `kind` says why (full -> 429, invalid -> 400, internal -> 500;
    gone: a session call reached another replica than the one it was for)."""

    kind: RefusalKind
    message: str


def encode_requests(requests: list[EngineRequest]) -> bytes:
    rows = [
        [r.request_id, r.prompt_token_ids, r.params.model_dump(exclude_defaults=True)]
        for r in requests
    ]
    return msgpack.packb(rows)


def decode_requests(payload: bytes) -> list[EngineRequest]:
    """The requests of a submit; anything but well-formed rows raises InvalidRequest (the
    values themselves are checked by `worker.validation.check_request`)."""
    try:
        rows = msgpack.unpackb(payload, strict_map_key=False)
        requests = []
        for rid, ids, params in rows:
            if not isinstance(ids, list) or not isinstance(params, dict):
                raise InvalidRequest(
                    "a malformed submit: a request row is [id, token ids, parameters]"
                )
            requests.append(EngineRequest(rid, ids, SamplingParams(**params)))
    except InvalidRequest:
        raise
    except ValidationError as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc.errors()[0]['msg']}") from None
    except (TypeError, ValueError, msgpack.ExtraData) as exc:
        raise InvalidRequest(f"a malformed submit: {type(exc).__name__}") from None
    if not isinstance(requests, list) or not requests:
        raise InvalidRequest("a submit carries at least one request")
    return requests


def encode_accepted(replica_id: str) -> bytes:
    return msgpack.packb({"accepted": replica_id})


def encode_refused(kind: RefusalKind, message: str) -> bytes:
    return msgpack.packb({"refused": kind, "message": message})


def decode_first(frame: bytes) -> Accepted | Refused:
    data = msgpack.unpackb(frame)
    if "accepted" in data:
        return Accepted(data["accepted"])
    return Refused(data["refused"], data["message"])


def _pack_logprobs(logprobs: list[TokenLogprobs] | None) -> list[Any] | None:
    if logprobs is None:
        return None
    return [[lp.token_id, lp.logprob, list(lp.top.items()), lp.rank] for lp in logprobs]


def _unpack_logprobs(rows: list[Any] | None) -> list[TokenLogprobs] | None:
    if rows is None:
        return None
    return [
        TokenLogprobs(tid, lp, {int(k): v for k, v in top}, rank) for tid, lp, top, rank in rows
    ]


def _pack_prompt_logprobs(scored: list[TokenLogprobs | None] | None) -> list[Any] | None:
    """The first entry (the prompt's first token, never scored) is None: it is left out."""
    return None if scored is None else _pack_logprobs(cast(list[TokenLogprobs], scored[1:]))


def _unpack_prompt_logprobs(rows: list[Any] | None) -> list[TokenLogprobs | None] | None:
    scored = _unpack_logprobs(rows)
    return None if scored is None else [None, *scored]


def encode_deltas(deltas: list[RequestDelta]) -> bytes:
    rows = [
        [
            d.request_id,
            d.new_token_ids,
            _pack_logprobs(d.logprobs),
            d.finish_reason,
            d.error,
            d.num_prompt_tokens,
            d.num_cached_tokens,
            None if d.metrics is None else dataclasses.astuple(d.metrics),
            _pack_prompt_logprobs(d.prompt_logprobs),
        ]
        for d in deltas
    ]
    return msgpack.packb(rows)


def decode_deltas(frame: bytes) -> list[RequestDelta]:
    return [
        RequestDelta(
            rid,
            list(ids),
            _unpack_logprobs(lps),
            finish,
            error,
            n_prompt,
            n_cached,
            None if metrics is None else RequestMetrics(*metrics),
            _unpack_prompt_logprobs(prompt_lps),
        )
        for rid, ids, lps, finish, error, n_prompt, n_cached, metrics, prompt_lps in msgpack.unpackb(
            frame, strict_map_key=False
        )
    ]
