"""Overlapped scheduling (`EngineConfig.overlap`): each step is scheduled and queued before
the previous step's tokens are read. On CPU the device work is synchronous, but the
bookkeeping is the same as on CUDA, so these tests hold it to the plain engine's results:
same tokens, finish reasons, logprobs and pages, through stops, aborts, failures and
preemption."""

import pytest

from tests.factories.tiny_models import random_prompts
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest
from worker.outputs import RequestDelta
from worker.sampling import SamplingParams


@pytest.fixture(scope="module")
def make_engine(tiny_model):
    path, _ = tiny_model("llama")

    def make(overlap: bool, **overrides) -> Engine:
        cfg = dict(
            model=str(path),
            device="cpu",
            max_seq_len=96,
            max_running=8,
            page_size=4,
            num_pages=160,
            overlap=overlap,
        )
        return Engine(EngineConfig(**{**cfg, **overrides}))

    return make


def _run(
    engine: Engine, requests: list[EngineRequest], abort_at: dict[int, str] | None = None
) -> dict[str, list[RequestDelta]]:
    """Step to the end; abort the named request after the given step. Deltas per request."""
    stream = engine.submit(requests)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if abort_at and steps in abort_at:
            engine.abort(abort_at[steps])
    got: dict[str, list[RequestDelta]] = {}
    for frame in stream.poll():
        for d in frame:
            got.setdefault(d.request_id, []).append(d)
    return got


def _summary(got: dict[str, list[RequestDelta]]) -> dict[str, tuple]:
    out = {}
    for rid, deltas in got.items():
        tokens = [t for d in deltas for t in d.new_token_ids]
        logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1), rid
        out[rid] = (
            tokens,
            deltas[-1].finish_reason,
            [(lp.token_id, round(lp.logprob, 4), sorted(lp.top)) for lp in logprobs],
        )
    return out


def _mixed_workload(stop_token: int | None) -> list[EngineRequest]:
    prompts = random_prompts([9, 14, 5, 21, 11, 7, 30, 3], seed=4)
    greedy = dict(temperature=0, ignore_eos=True)
    stops = [stop_token] if stop_token is not None else []
    params = [
        SamplingParams(max_tokens=40, **greedy),
        SamplingParams(max_tokens=7, **greedy),
        SamplingParams(max_tokens=40, stop_token_ids=stops, **greedy),  # stops on a sampled token
        SamplingParams(max_tokens=40, stop_token_ids=stops, min_tokens=12, **greedy),
        SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(
            max_tokens=30,
            temperature=0.8,
            seed=5,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=80, **greedy),  # runs into max_seq_len (30 + 80 > 96)
        SamplingParams(max_tokens=25, logprobs=2, **greedy),
    ]
    return [
        EngineRequest(f"m{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]


def _a_stop_token(make_engine) -> int:
    """A token the greedy run of m2's prompt produces a few tokens in."""
    engine = make_engine(False)
    got = _run(engine, _mixed_workload(stop_token=None)[2:3])
    return _summary(got)["m2"][0][5]


def test_overlap_gives_the_plain_engines_tokens(make_engine):
    stop = _a_stop_token(make_engine)
    plain, overlapped = make_engine(False), make_engine(True)
    want = _summary(_run(plain, _mixed_workload(stop)))
    got = _summary(_run(overlapped, _mixed_workload(stop)))
    assert got == want
    reasons = {rid: v[1] for rid, v in want.items()}
    assert reasons["m2"] == "stop" and reasons["m6"] == "length" and len(want["m6"][0]) < 80
    assert overlapped.num_overlapped_steps > 20 and plain.num_overlapped_steps == 0
    for engine in (plain, overlapped):
        cache = engine.executor.cache
        assert cache.num_free_pages == cache.num_total_pages and not engine.has_work


def test_abort_while_a_step_is_in_flight(make_engine):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = random_prompts([9, 14, 5], seed=8)
    results = {}
    for overlap in (False, True):
        engine = make_engine(overlap)
        reqs = [EngineRequest(f"a{i}", p, greedy) for i, p in enumerate(prompts)]
        results[overlap] = _summary(_run(engine, reqs, abort_at={6: "a1"}))
        if overlap:
            assert engine.num_overlapped_steps > 10
        cache = engine.executor.cache
        assert cache.num_free_pages == cache.num_total_pages
    assert results[True]["a1"][1] == "abort" and len(results[True]["a1"][0]) < 30
    assert results[True] == results[False]


def test_a_failed_queued_step_fails_its_requests_and_the_engine_keeps_serving(make_engine):
    engine = make_engine(True)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    calls = {"n": 0}

    def hook(tasks):
        calls["n"] += 1
        if calls["n"] == 8:  # well into steady decode: a queued (overlapped) step
            raise RuntimeError("injected fault")

    engine.fault_hook = hook
    got = _run(
        engine,
        [EngineRequest(f"f{i}", p, greedy) for i, p in enumerate(random_prompts([9, 5], seed=2))],
    )
    assert engine.num_overlapped_steps > 0
    assert {rid: d[-1].finish_reason for rid, d in got.items()} == {"f0": "error", "f1": "error"}
    assert all("injected fault" in d[-1].error for d in got.values())
    engine.fault_hook = None
    again = _run(engine, [EngineRequest("g0", random_prompts([6])[0], greedy)])
    assert (
        again["g0"][-1].finish_reason == "length"
        and sum(len(d.new_token_ids) for d in again["g0"]) == 20
    )
    cache = engine.executor.cache
    assert cache.num_free_pages == cache.num_total_pages


def test_overlap_under_kv_pressure_preempts_like_the_plain_engine(make_engine):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts([20, 18, 25, 22, 16, 19], seed=6)
    results = {}
    for overlap in (False, True):
        engine = make_engine(overlap, num_pages=40, admission_watermark=0.0)
        results[overlap] = _summary(
            _run(engine, [EngineRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
        )
        assert engine.scheduler.num_preemptions > 0
        cache = engine.executor.cache
        assert cache.num_free_pages == cache.num_total_pages
    assert results[True] == results[False]
    assert all(
        reason == "length" and len(tokens) == 40 for tokens, reason, _ in results[True].values()
    )


def _run_with_arrivals(
    engine: Engine, arrivals: dict[int, list[EngineRequest]]
) -> dict[str, list[RequestDelta]]:
    """Step to the end, submitting each list of requests before the numbered step (0 first)."""
    streams, steps = [], 0
    while engine.has_work or any(k >= steps for k in arrivals):
        if steps in arrivals:
            streams.append(engine.submit(arrivals[steps]))
        engine.step()
        steps += 1
    got: dict[str, list[RequestDelta]] = {}
    for stream in streams:
        for frame in stream.poll():
            for d in frame:
                got.setdefault(d.request_id, []).append(d)
    return got


def test_overlap_carries_through_arrivals_prompt_chunks_and_finishes(make_engine):
    """Batches that change every few steps — requests arriving, prompts run in chunks of a
    small token budget, requests ending at different lengths — are still queued before their
    predecessor is read, with its tokens carried on the device, and give the plain engine's
    tokens."""
    greedy = dict(temperature=0, ignore_eos=True)
    prompts = random_prompts([9, 30, 5, 21, 17, 12, 26, 4, 15, 8], seed=12)
    lengths = [12, 20, 5, 33, 9, 27, 14, 40, 3, 18]
    params = [SamplingParams(max_tokens=n, **greedy) for n in lengths]
    params[3] = SamplingParams(max_tokens=33, temperature=0.7, top_k=20, seed=3, ignore_eos=True)
    params[6] = SamplingParams(max_tokens=14, min_tokens=10, stop_token_ids=[7, 11, 19], **greedy)
    requests = [
        EngineRequest(f"c{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    arrivals = {
        0: requests[:3],
        4: requests[3:5],
        9: requests[5:6],
        15: requests[6:9],
        30: requests[9:],
    }
    results = {}
    for overlap in (False, True):
        engine = make_engine(overlap, token_budget=16, max_running=8)
        engine.step_log = []
        results[overlap] = _summary(_run_with_arrivals(engine, arrivals))
        cache = engine.executor.cache
        assert cache.num_free_pages == cache.num_total_pages and not engine.has_work
        if overlap:
            log = engine.step_log
            queued = [(prev, s) for prev, s in zip(log, log[1:], strict=False) if s.overlapped]
            # prompt chunks queued early
            assert sum(s.num_prompt_tokens > 0 for _, s in queued) >= 5
            assert (
                sum(
                    s.num_decodes != prev.num_decodes + (prev.num_prompt_tokens > 0)
                    for prev, s in queued
                )
                >= 3
            )
            assert engine.num_overlapped_steps > 0.8 * len(log)
    assert results[True] == results[False]
    assert all(len(results[True][f"c{i}"][0]) == n for i, n in enumerate(lengths) if i != 6)


def test_step_log_accounts_for_every_step(make_engine):
    engine = make_engine(True, token_budget=16)
    engine.step_log = []
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    _run(
        engine,
        [EngineRequest(f"s{i}", p, greedy) for i, p in enumerate(random_prompts([20, 3], seed=1))],
    )
    log = engine.step_log
    assert len(log) == engine.stats().num_steps
    assert sum(s.num_prompt_tokens for s in log) == 23 and sum(s.num_decodes for s in log) == 2 * 5
    assert (
        all(s.seconds > 0 for s in log)
        and sum(s.overlapped for s in log) == engine.num_overlapped_steps
    )
