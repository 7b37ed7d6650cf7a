"""The wire format between ingress and worker: msgpack round trips."""

from __future__ import annotations

from cluster.transport import (
    Accepted,
    Refused,
    decode_deltas,
    decode_first,
    decode_requests,
    encode_accepted,
    encode_deltas,
    encode_refused,
    encode_requests,
)
from worker.guided import GuidedDecoding
from worker.outputs import RequestDelta, RequestMetrics, TokenLogprobs
from worker.sampling import SamplingParams
from worker.validation import EngineRequest


def test_requests_round_trip_through_msgpack() -> None:
    params = SamplingParams(
        temperature=0.5, stop=("x", "yz"), seed=3, logprobs=2, max_tokens=7, prompt_logprobs=1
    )
    shaped = GuidedDecoding.from_schema({"type": "object"}).model_copy(update={"thinking": "open"})
    requests = [
        EngineRequest("r-0", [1, 2, 3], params),
        EngineRequest("r-1", [4], SamplingParams()),
        EngineRequest("r-2", [5], SamplingParams(guided=shaped)),  # a grammar after thinking
    ]
    assert decode_requests(encode_requests(requests)) == requests


def test_first_frame_is_accept_or_refusal() -> None:
    assert decode_first(encode_accepted("abc")) == Accepted("abc")
    assert decode_first(encode_refused("full", "queue full")) == Refused("full", "queue full")


def test_deltas_round_trip_with_logprobs() -> None:
    deltas = [
        RequestDelta("a", [5], [TokenLogprobs(5, -0.25, {5: -0.25, 9: -2.0})], None, None, 12, 4),
        RequestDelta("b", [], None, "abort", None, 3, 0, RequestMetrics(0.5, 1.0, 0.25, 3.0, 1)),
        RequestDelta("c", [7, 8], None, "error", "boom", 0, 0),
        RequestDelta(
            "d",
            [],
            None,
            "length",
            None,
            2,
            0,
            prompt_logprobs=[None, TokenLogprobs(11, -1.5, {11: -1.5}, rank=1)],
        ),
    ]
    assert decode_deltas(encode_deltas(deltas)) == deltas
