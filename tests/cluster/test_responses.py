"""Response bodies built from the engine's scores: prompt logprobs as vLLM returns them, and
echo's, each with the alternatives its own field asked for (no Ray, no model)."""

from __future__ import annotations

from cluster.protocol import PromptLogprob
from cluster.responses import echo_logprobs, prompt_logprobs
from worker.outputs import TokenLogprobs


def _text(token_id: int) -> str:
    return f"<{token_id}>"


# a three-token prompt [5, 6, 7]: the first is unscored; 6 is the most likely at its place,
# 7 is not among the three alternatives the engine kept at its own (it ranks 12th)
SCORED = [
    None,
    TokenLogprobs(6, -0.1, {6: -0.1, 9: -2.5, 8: -3.0}, rank=1),
    TokenLogprobs(7, -4.0, {1: -0.2, 2: -1.5, 3: -2.0}, rank=12),
]


def test_prompt_logprobs_rank_the_alternatives_and_the_token_in_the_vocabulary() -> None:
    got = prompt_logprobs(_text, [5, 6, 7], SCORED, k=2)
    assert got[0] is None
    assert got[1] == {
        "6": PromptLogprob(logprob=-0.1, rank=1, decoded_token="<6>"),
        "9": PromptLogprob(logprob=-2.5, rank=2, decoded_token="<9>"),
    }
    assert got[2] == {
        "7": PromptLogprob(logprob=-4.0, rank=12, decoded_token="<7>"),  # not in the top 2
        "1": PromptLogprob(logprob=-0.2, rank=1, decoded_token="<1>"),
        "2": PromptLogprob(logprob=-1.5, rank=2, decoded_token="<2>"),
    }
    assert [list(row) for row in prompt_logprobs(_text, [5, 6, 7], SCORED, k=0)[1:]] == [
        ["6"],
        ["7"],
    ]


def test_echo_shows_its_own_count_of_alternatives_when_the_engine_scored_more() -> None:
    echo = echo_logprobs(_text, [5, 6, 7], SCORED, k=1)
    assert echo.tokens == ["<5>", "<6>", "<7>"]
    assert echo.token_logprobs == [None, -0.1, -4.0]
    assert echo.top_logprobs == [None, {"<6>": -0.1}, {"<1>": -0.2}]
    assert echo.text_offset == [0, 3, 6]
