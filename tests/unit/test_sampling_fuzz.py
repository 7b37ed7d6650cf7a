"""Property-based fuzzing of SamplingParams and the sampler.

Any params object that validates must sample without error on any batch it joins: ids in
the vocabulary, no NaN in the logprobs, greedy rows at the argmax of the penalized logits.
Any value outside a field's range must be refused by a ValidationError naming that field.
Edge values (0, the smallest subnormal, the bounds themselves, vocabularies of one token)
are drawn on purpose: that is where float32 divisions and masks go wrong. Bounded in
examples and time so the module stays under 20 s on a 2-core CI machine.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from worker.sampling import (
    MAX_LOGPROBS,
    SamplingBatchInfo,
    SamplingParams,
    penalized_logits,
    sample,
)

FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # CI runs the same examples every time; a failure reproduces
)
TINY = 5e-324  # the smallest positive double


def _floats(low: float, high: float, *, exclude_low: bool = False) -> st.SearchStrategy[float]:
    """Floats of a range, its bounds and near-zero values drawn more often than by chance."""
    edges = [v for v in (low, high, TINY, 1e-30, 1e-5, 0.5, 1.0) if low <= v <= high]
    edges = [v for v in edges if not (exclude_low and v == low)]
    inner = st.floats(low, high, allow_nan=False, exclude_min=exclude_low)
    return st.one_of(st.sampled_from(edges), inner)


@st.composite
def valid_params(draw: st.DrawFn, vocab: int) -> SamplingParams:
    max_tokens = draw(st.none() | st.integers(1, 64))
    token = st.integers(0, vocab * 2)  # stop ids past the vocabulary are legal and ignored
    return SamplingParams(
        temperature=draw(_floats(0.0, 100.0)),
        top_k=draw(st.sampled_from([0, 1, vocab, vocab + 1]) | st.integers(0, 2**31)),
        top_p=draw(_floats(0.0, 1.0, exclude_low=True)),
        min_p=draw(_floats(0.0, 1.0)),
        frequency_penalty=draw(_floats(-2.0, 2.0)),
        presence_penalty=draw(_floats(-2.0, 2.0)),
        repetition_penalty=draw(_floats(0.0, 10.0, exclude_low=True)),
        seed=draw(st.none() | st.integers(-(2**63), 2**64 - 1)),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens or 64)),
        stop=tuple(draw(st.lists(st.text(min_size=1, max_size=4), max_size=3))),
        stop_token_ids=tuple(draw(st.lists(token, max_size=3))),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, MAX_LOGPROBS)),
    )


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    vocab = draw(st.sampled_from([1, 2, 7, 50]))
    size = draw(st.integers(1, 4))
    ids = st.lists(st.integers(0, vocab - 1), max_size=6)
    scale = draw(st.sampled_from([0.0, 1.0, 30.0, 1e4]))  # 0: every logit ties
    return {
        "vocab": vocab,
        "params": [draw(valid_params(vocab)) for _ in range(size)],
        "prompts": [draw(ids) for _ in range(size)],
        "outputs": [draw(ids) for _ in range(size)],
        "eos": frozenset(draw(st.lists(st.integers(0, vocab - 1), max_size=2))),
        "logits_seed": draw(st.integers(0, 2**32 - 1)),
        "scale": scale,
    }


@FUZZ
@given(batches())
def test_any_valid_params_sample_tokens_in_range_without_nan(batch: dict[str, Any]) -> None:
    vocab, params = batch["vocab"], batch["params"]
    generators = [
        None if p.seed is None else torch.Generator("cpu").manual_seed(p.seed) for p in params
    ]
    info = SamplingBatchInfo.build(
        params,
        batch["prompts"],
        batch["outputs"],
        generators,
        vocab_size=vocab,
        device="cpu",
        eos_token_ids=batch["eos"],
    )
    g = torch.Generator().manual_seed(batch["logits_seed"])
    logits = torch.randn(len(params), vocab, generator=g) * batch["scale"]
    out = sample(logits, info)
    assert out.token_ids.shape == (len(params),)
    assert bool(((out.token_ids >= 0) & (out.token_ids < vocab)).all()), out.token_ids
    _check_logprobs(out, params, vocab)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        best = penalized_logits(logits, info).max(dim=-1).values
        chosen = penalized_logits(logits, info).gather(1, out.token_ids.view(-1, 1)).view(-1)
        assert bool((chosen[greedy] == best[greedy]).all()), "a greedy row left the argmax"
    info.record(out.token_ids)  # the next step's state stays consistent
    assert sample(logits, info).token_ids.shape == (len(params),)


def _check_logprobs(out: Any, params: list[SamplingParams], vocab: int) -> None:
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked:
        assert out.logprobs is None
        return
    assert out.logprobs is not None and not bool(out.logprobs.isnan().any())
    assert bool((out.logprobs <= 0).all())
    if max(asked) > 0:
        assert out.top_logprobs is not None
        assert out.top_logprobs.shape == (len(params), min(max(asked), vocab))
        assert not bool(out.top_logprobs.isnan().any())


# field -> values outside its range (or of no sensible type)
_INVALID: dict[str, list[Any]] = {
    "n": [0, 17, -1],
    "temperature": [-1e-9, 100.0001, math.nan, math.inf, -math.inf, "hot"],
    "top_k": [-1, 1.5],
    "top_p": [0.0, -TINY, 1.0000001, math.nan],
    "min_p": [-TINY, 1.5, math.inf],
    "frequency_penalty": [2.0001, -2.0001, math.nan],
    "presence_penalty": [math.inf, -3.0],
    "repetition_penalty": [0.0, -1.0, 10.5, math.nan],
    "seed": [2**64, -(2**63) - 1, 1.5],
    "max_tokens": [0, -5],
    "min_tokens": [-1],
    "stop": [("",), ("a", "")],
    "stop_token_ids": [(-1,), (1, -2)],
    "logprobs": [-1, MAX_LOGPROBS + 1],
    "ignore_eos": ["maybe"],
}
_CASES = [(name, value) for name, values in _INVALID.items() for value in values]


@settings(max_examples=len(_CASES) * 2, deadline=None, derandomize=True)
@given(st.sampled_from(_CASES), st.integers(1, 64))
def test_invalid_values_are_refused_naming_the_field(
    case: tuple[str, Any], max_tokens: int
) -> None:
    name, value = case
    fields: dict[str, Any] = {name: value}
    if name != "max_tokens":
        fields["max_tokens"] = max_tokens
    try:
        SamplingParams(**fields)
    except ValidationError as exc:
        assert exc.errors()[0]["loc"][0] == name, exc
    else:
        raise AssertionError(f"{name}={value!r} was accepted")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 64), st.integers(1, 200))
def test_min_tokens_above_max_tokens_is_refused(max_tokens: int, extra: int) -> None:
    try:
        SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens + extra)
    except ValidationError as exc:
        assert exc.errors()[0]["loc"][0] == "min_tokens"
    else:
        raise AssertionError("min_tokens > max_tokens was accepted")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(["typo", "best_of", "logit_bias"]), st.integers())
def test_unknown_fields_are_refused(name: str, value: int) -> None:
    try:
        SamplingParams(**{name: value})
    except ValidationError as exc:
        assert exc.errors()[0]["loc"][0] == name
    else:
        raise AssertionError(f"unknown field {name} was accepted")
