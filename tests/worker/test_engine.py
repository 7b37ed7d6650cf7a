"""Engine lifecycle on a tiny random model: abort, error isolation, bad input, streams, pages;
and overlapped scheduling, held to the plain engine's results."""

import asyncio

import pytest

from tests.factories.tiny_models import random_prompts
from worker import LLM, SamplingParams
from worker.config import EngineConfig
from worker.engine import Engine, EngineFull, EngineRequest
from worker.outputs import RequestDelta


@pytest.fixture(scope="module")
def engine_factory(tiny_model):
    path, _ = tiny_model("llama")

    def make(**overrides) -> Engine:
        return Engine(EngineConfig.from_flat(**{**_config(path), **overrides}))

    return make


@pytest.fixture(scope="module")
def llm(tiny_model):
    path, _ = tiny_model("llama")
    cfg = _config(path)
    return LLM(cfg.pop("model"), **cfg)


def _config(path) -> dict:
    return dict(
        model=str(path), device="cpu", max_seq_len=128, max_running=8, page_size=4, num_pages=96
    )


def _reqs(prefix: str, n: int, max_tokens: int = 20, **params) -> list[EngineRequest]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return [
        EngineRequest(f"{prefix}{i}", p, sp)
        for i, p in enumerate(random_prompts([9, 14, 5, 21][:n]))
    ]


def _run(engine: Engine, streams) -> dict[str, list]:
    got: dict[str, list] = {}
    while engine.has_work:
        engine.step()
    for s in streams:
        for frame in s.poll():
            for d in frame:
                got.setdefault(d.request_id, []).append(d)
    return got


def test_abort_frees_pages_within_one_step(engine_factory):
    engine = engine_factory()
    cache = engine.executor.cache
    initial = cache.num_free_pages
    stream = engine.submit(_reqs("a", 3, max_tokens=40))
    for _ in range(4):
        engine.step()
    used = cache.num_free_pages
    engine.abort("a1")
    deltas = engine.step()
    aborted = [d for d in deltas if d.request_id == "a1"]
    assert aborted and aborted[0].finish_reason == "abort"
    assert cache.num_free_pages > used  # a1's pages came back in that very step
    got = _run(engine, [stream])
    assert got["a0"][-1].finish_reason == "length" and got["a2"][-1].finish_reason == "length"
    assert sum(len(d.new_token_ids) for d in got["a0"]) == 40
    assert cache.num_free_pages == initial
    m = got["a0"][-1].metrics
    assert (
        m is not None
        and 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
        and m.time_per_output_token > 0
    )


def test_the_prefix_summary_is_current_once_the_engine_is_idle(engine_factory):
    """The routers' view of the cache (`prefix_summary`) is refreshed at most every 50 ms
    during steps; an engine that then goes idle must not keep an older one, since no step
    would come to refresh it (and an idle replica's routing reports no longer change)."""

    engine = engine_factory()
    engine.step()  # nothing to do: the summary is fresh now, so the next steps' are throttled
    _run(engine, [engine.submit(_reqs("s", 2, max_tokens=6))])
    assert not engine.has_work
    current = engine.executor.cache.prefix_summary()
    assert current and engine.prefix_summary() == current


def test_a_steps_tokens_go_out_before_the_prefix_summary_is_refreshed(engine_factory):
    """The summary copies every cached key (milliseconds with a full H200 cache): no token waits
    for it. At the refresh of the last step, the request's final delta is already out."""
    engine = engine_factory()
    stream = engine.submit(_reqs("t", 1, max_tokens=3))
    summary, finished_at_refresh = engine.executor.cache.prefix_summary, []

    def refresh() -> list[int]:
        finished_at_refresh.append(stream.finished)
        return summary()

    engine.executor.cache.prefix_summary = refresh
    _run(engine, [stream])
    assert finished_at_refresh and finished_at_refresh[-1]


def test_queue_time_ends_when_the_first_step_is_queued_not_when_it_ends(engine_factory):
    """One running request at a time, each step held for 40 ms: the second request queues
    behind the first (its queue time covers the first's steps); neither counts its own first
    step as queueing."""
    import time

    engine = engine_factory(max_running=1)
    engine.fault_hook = lambda tasks: time.sleep(0.04)
    stream = engine.submit(_reqs("q", 2, max_tokens=3))
    got = _run(engine, [stream])
    first, second = got["q0"][-1].metrics, got["q1"][-1].metrics
    assert first is not None and second is not None
    assert first.queue_time < 0.02 <= 0.04 <= first.time_to_first_token
    assert second.queue_time >= 3 * 0.04 and second.time_to_first_token - second.queue_time >= 0.04


def test_failed_step_fails_only_its_requests_and_the_engine_keeps_serving(engine_factory):
    engine = engine_factory()
    boom = {"armed": True}

    def hook(tasks):
        if boom["armed"] and any(t.request.request_id == "bad0" for t in tasks):
            boom["armed"] = False
            raise RuntimeError("injected fault")

    engine.fault_hook = hook
    s1 = engine.submit(_reqs("bad", 1))
    engine.step()
    s2 = engine.submit(_reqs("ok", 2))
    got = _run(engine, [s1, s2])
    assert got["bad0"][-1].finish_reason == "error" and "injected fault" in got["bad0"][-1].error
    assert [got[f"ok{i}"][-1].finish_reason for i in range(2)] == ["length", "length"]
    cache = engine.executor.cache
    assert cache.num_free_pages == cache.num_total_pages


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        ([5] * 200, "context length"),
        ([5, 99999], r"\[0, 211\)"),
        ([-1, 4], r"\[0, 211\)"),
        ([5, 2.0], "integers"),
    ],
)
def test_bad_input_is_refused_at_submit(engine_factory, prompt, message):
    engine = engine_factory()
    with pytest.raises(ValueError, match=message):
        engine.submit([EngineRequest("x", prompt, SamplingParams())])
    assert not engine.has_work and engine.stats().num_waiting == 0


def test_stats_are_complete_before_the_first_step(engine_factory):
    engine = engine_factory()
    s = engine.stats()
    assert s.num_free_pages == s.num_total_pages == 95 and s.kv_usage == 0.0 and s.num_steps == 0


def test_backpressure_over_max_waiting(engine_factory):
    engine = engine_factory(max_waiting=2)
    engine.submit(_reqs("w", 2))
    with pytest.raises(EngineFull):
        engine.submit(_reqs("v", 1))


def test_backpressure_counts_what_the_step_in_flight_took_from_the_inbox(engine_factory):
    engine = engine_factory(max_waiting=2, max_running=1)
    engine.submit(_reqs("w", 2))
    refused = []

    def submit_mid_step(tasks):  # the step has queued the two: one runs, one waits
        engine.fault_hook = None
        try:
            engine.submit(_reqs("v", 2))
        except EngineFull:
            refused.append(True)

    engine.fault_hook = submit_mid_step
    engine.step()
    assert refused == [True]
    assert engine.stats().num_waiting == 1


def test_async_stream_one_frame_per_step_from_the_loop_thread(engine_factory):
    engine = engine_factory()
    engine.start()
    try:

        async def consume():
            frames = []
            async for frame in engine.submit(_reqs("s", 2, max_tokens=12)):
                frames.append(frame)
            return frames

        frames = asyncio.run(asyncio.wait_for(consume(), timeout=60))
    finally:
        engine.shutdown()
    # a request at most once per frame
    assert all(len({d.request_id for d in f}) == len(f) for f in frames)
    assert sum(len(d.new_token_ids) for f in frames for d in f) == 24
    assert sum(1 for f in frames for d in f if d.finish_reason == "length") == 2
    assert max(len(f) for f in frames) == 2  # both requests advance in the same steps
    stats = engine.stats()
    assert stats.generation_tokens_total == 24 and stats.num_running == 0 and not stats.loop_alive


def test_launched_builds_and_steps_on_its_loop_thread(tiny_model, llm, monkeypatch):
    import threading

    import worker.engine as engine_module

    built_on = []

    class Recording(engine_module.Executor):
        def __init__(self, *args, **kwargs):
            built_on.append(threading.current_thread())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_module, "Executor", Recording)
    path, _ = tiny_model("llama")
    engine = Engine.launched(EngineConfig.from_flat(**_config(path)))
    try:
        assert built_on == [engine._thread] and built_on[0] is not threading.current_thread()
        assert engine.stats().loop_alive
        frames = list(engine.submit(_reqs("l", 2, max_tokens=12)))
    finally:
        engine.shutdown()
    got = {}
    for frame in frames:
        for d in frame:
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
    want = llm.generate(
        [r.prompt_token_ids for r in _reqs("l", 2)],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    assert [got["l0"], got["l1"]] == [w.token_ids for w in want]  # as the offline engine
    assert not engine.stats().loop_alive


def test_launched_raises_what_the_build_raised(tmp_path):
    with pytest.raises(FileNotFoundError):
        Engine.launched(EngineConfig(model=str(tmp_path / "missing"), device="cpu"))


def test_stop_token_ids_min_and_max_tokens(llm):
    prompt = random_prompts([9])[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
    later = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=16, stop_token_ids=(stop_at,), min_tokens=first + 1
        ),
    )[0]
    assert len(later.token_ids) > first + 1


def test_seeded_sampling_is_reproducible_across_batches(llm):
    prompts = random_prompts([9, 14, 5])
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], p)[0].token_ids
    in_batch = llm.generate(prompts, [p, SamplingParams(temperature=0.7, max_tokens=20), p])[
        0
    ].token_ids
    assert alone == in_batch
    two = llm.generate([prompts[0]], p.model_copy(update={"n": 2}))
    assert len(two) == 2 and two[0].token_ids == alone and two[1].token_ids != alone


def test_stats_count_the_requests_of_a_step_that_hangs(engine_factory):
    """The snapshot is taken after a step; the counts are read live, so a replica whose step
    hangs does not look idle to /metrics, routing or autoscaling."""
    import threading

    engine = engine_factory()
    entered, release = threading.Event(), threading.Event()

    def hang(tasks):
        entered.set()
        release.wait(30)

    engine.fault_hook = hang
    engine.start()
    try:
        engine.submit(_reqs("h", 3, max_tokens=4))
        assert entered.wait(30)
        stats = engine.stats()
        assert stats.num_running == 3 and stats.num_waiting == 0
        assert engine.stats_snapshot.num_running == 0  # the snapshot still shows the idle engine
    finally:
        release.set()
        engine.fault_hook = None
        engine.shutdown()


def test_prefill_slowdown_learns_step_times_and_paces_prompt_chunks(engine_factory):
    """With `prefill_slowdown` the engine feeds every step's time to the scheduler's pacer;
    once it knows a decode-only step and a prompt token's cost, prompt chunks next to decodes
    take its share (here forced to its 3-token minimum), and tokens stay the plain engine's."""
    prompts = random_prompts([9, 30, 30], seed=11)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [EngineRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)]

    def run(engine: Engine) -> tuple[dict[str, list[int]], list]:
        engine.step_log = []
        streams = [engine.submit(reqs[:1])]
        for _ in range(4):  # p0 decodes alone: decode-only steps
            engine.step()
        streams.append(engine.submit(reqs[1:2]))  # p1's prompt next to p0's decodes
        engine.step()
        marker = len(engine.step_log)
        streams.append(engine.submit(reqs[2:]))
        got = _run(engine, streams)
        tokens = {rid: [t for d in ds for t in d.new_token_ids] for rid, ds in got.items()}
        return tokens, engine.step_log[marker:]

    paced = engine_factory(prefill_slowdown=1.5)
    pacer = paced.scheduler.pacer
    assert pacer is not None
    asked: list[int] = []

    def pinned(num_decodes: int) -> int:
        """The share, pinned at 3 tokens so the chunking shows whatever this CPU's times are
        (the pacer's own arithmetic: tests/worker/test_scheduler.py)."""
        asked.append(num_decodes)
        return 3

    pacer.budget = pinned  # type: ignore[method-assign]
    paced_tokens, later_steps = run(paced)
    # the engine fed it
    assert pacer.decode_step_s(1) is not None and pacer.prompt_cost() is not None
    assert asked and all(b >= 1 for b in asked)
    mixed = [s for s in later_steps if s.num_decodes and s.num_prompt_tokens]
    # p2 in 3-token chunks
    assert len(mixed) >= 30 // 3 and all(s.num_prompt_tokens <= 3 for s in mixed)
    plain_tokens, _ = run(engine_factory())
    assert paced_tokens == plain_tokens


def test_stepping_leaves_the_torch_thread_count_to_the_caller(engine_factory):
    """The engine never changes torch's thread count: the process (cluster/ sizes it from the
    affinity mask and CPU limit) owns it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = engine_factory()
        seen: list[int] = []
        launch = engine.executor._launch

        def spy(tasks, carried):
            seen.append(torch.get_num_threads())
            return launch(tasks, carried)

        engine.executor._launch = spy  # type: ignore[method-assign]
        _run(engine, [engine.submit(_reqs("threads", 3, max_tokens=4))])
        assert seen and set(seen) == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# -- overlapped scheduling ------------------------------------------------------
# Overlapped scheduling (`EngineConfig.overlap`): each step is scheduled and queued before
# the previous step's tokens are read. On CPU the device work is synchronous, but the
# bookkeeping is the same as on CUDA, so these tests hold it to the plain engine's results:
# same tokens, finish reasons, logprobs and pages, through stops, aborts, failures and
# preemption.


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
        return Engine(EngineConfig.from_flat(**{**cfg, **overrides}))

    return make


def _run_to_end(
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
        SamplingParams(**greedy),  # no max_tokens: runs into max_seq_len (96)
        SamplingParams(max_tokens=25, logprobs=2, **greedy),
    ]
    return [
        EngineRequest(f"m{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]


def _a_stop_token(make_engine) -> int:
    """A token the greedy run of m2's prompt produces a few tokens in."""
    engine = make_engine(False)
    got = _run_to_end(engine, _mixed_workload(stop_token=None)[2:3])
    return _summary(got)["m2"][0][5]


def test_overlap_gives_the_plain_engines_tokens(make_engine):
    stop = _a_stop_token(make_engine)
    plain, overlapped = make_engine(False), make_engine(True)
    want = _summary(_run_to_end(plain, _mixed_workload(stop)))
    got = _summary(_run_to_end(overlapped, _mixed_workload(stop)))
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
        results[overlap] = _summary(_run_to_end(engine, reqs, abort_at={6: "a1"}))
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
    got = _run_to_end(
        engine,
        [EngineRequest(f"f{i}", p, greedy) for i, p in enumerate(random_prompts([9, 5], seed=2))],
    )
    assert engine.num_overlapped_steps > 0
    assert {rid: d[-1].finish_reason for rid, d in got.items()} == {"f0": "error", "f1": "error"}
    assert all("injected fault" in d[-1].error for d in got.values())
    engine.fault_hook = None
    again = _run_to_end(engine, [EngineRequest("g0", random_prompts([6])[0], greedy)])
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
            _run_to_end(engine, [EngineRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
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
    _run_to_end(
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


def test_max_tokens_past_the_context_is_refused_as_the_ingress_refuses_it(engine_factory):
    """worker.validation: the engine takes what the ingress would send, nothing more."""
    engine = engine_factory()
    with pytest.raises(ValueError, match="context length"):
        engine.submit([EngineRequest("x", [5] * 10, SamplingParams(max_tokens=2**62))])
    assert not engine.has_work
