"""Plain data leaving the engine: merging steps into one delta per request."""

from __future__ import annotations

from worker.outputs import RequestDelta, TokenLogprobs


def test_merge_steps_gives_one_delta_per_request_in_step_order() -> None:
    from worker.outputs import merge_steps

    lp = [TokenLogprobs(5, -0.5, {5: -0.5}), TokenLogprobs(6, -0.1, {6: -0.1})]
    steps = [
        [RequestDelta("a", [5], lp[:1], num_prompt_tokens=3), RequestDelta("b", [9])],
        [RequestDelta("a", [6], lp[1:], "length", num_prompt_tokens=3, num_cached_tokens=2)],
        [RequestDelta("b", [], None, "abort")],
    ]
    a, b = merge_steps(steps)
    assert (a.request_id, a.new_token_ids, a.logprobs, a.finish_reason) == (
        "a",
        [5, 6],
        lp,
        "length",
    )
    assert (a.num_prompt_tokens, a.num_cached_tokens) == (3, 2)
    assert (b.request_id, b.new_token_ids, b.finish_reason) == ("b", [9], "abort")
    assert merge_steps([steps[0]]) == steps[0]
