"""The CPU prompt lane (`EngineConfig.cpu_prompt_lane`): while requests decode, new prompts run
in steps of their own, on a thread of their own, beside the engine's decode steps.

Most tests drive the lane by hand (`Engine.lane_step` on the test's thread, between
`Engine.step` calls), so each interleaving is exact; the last one runs both threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.factories.tiny_models import random_prompts
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest, StepRecord
from worker.sampling import SamplingParams


@pytest.fixture(scope="module")
def make_engine(tiny_model):
    path, _ = tiny_model("llama")

    def make(threads: int = 2, **overrides) -> Engine:
        before = torch.get_num_threads()
        # the lane needs two torch threads: one for it, one for the decodes
        torch.set_num_threads(threads)
        try:
            config = dict(
                model=str(path),
                device="cpu",
                max_seq_len=128,
                max_running=8,
                page_size=4,
                num_pages=96,
            )
            return Engine(EngineConfig(**{**config, **overrides}))
        finally:
            torch.set_num_threads(before)

    return make


def _reqs(prefix: str, lens: list[int], max_tokens: int = 12, **params) -> list[EngineRequest]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return [
        EngineRequest(f"{prefix}{i}", p, sp)
        for i, p in enumerate(random_prompts(lens, seed=len(prefix) + sum(lens)))
    ]


def _tokens(streams) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for s in streams:
        for frame in s.poll():
            for d in frame:
                got.setdefault(d.request_id, []).extend(d.new_token_ids)
    return got


def _reference(
    make_engine, batches: list[list[EngineRequest]], **overrides
) -> dict[str, list[int]]:
    plain = make_engine(cpu_prompt_lane=False, **overrides)
    streams = [plain.submit(b) for b in batches]
    while plain.has_work:
        plain.step()
    return _tokens(streams)


def test_prompts_that_arrive_while_others_decode_run_in_the_lane_and_decode_steps_carry_none(
    make_engine,
):
    engine = make_engine()
    assert engine.executor.lane is not None and engine.executor.lane.threads == 1
    engine.scheduler.lane_on = True  # what start() sets; the test is both threads
    cache = engine.executor.cache
    initial = cache.num_free_pages
    engine.step_log = []
    first, later = _reqs("a", [9, 14]), _reqs("bb", [21, 5])
    streams = [engine.submit(first)]
    engine.step()  # nothing runs: the engine's own step takes the prompts
    engine.step()
    streams.append(engine.submit(later))
    engine.step()  # a0, a1 decode; bb0, bb1 wait for the lane
    assert [r.request_id for r in engine.scheduler.waiting] == ["bb0", "bb1"]
    assert engine.lane_step()
    got = _tokens(streams)
    # first tokens out with the lane's step
    assert [len(got[r.request_id]) for r in later] == [
        1,
        1,
    ]
    assert engine.stats().num_running == 4 and not engine.scheduler.lane
    while engine.has_work:
        engine.step()
    for rid, tokens in _tokens(streams).items():
        got.setdefault(rid, []).extend(tokens)
    assert got == _reference(make_engine, [first, later])
    log: list[StepRecord] = engine.step_log
    assert log[0].num_prompt_tokens == 9 + 14 and all(r.num_prompt_tokens == 0 for r in log[1:])
    assert engine.stats_snapshot.num_lane_steps == 1
    assert cache.num_free_pages == initial


def test_a_request_aborted_while_its_prompt_is_in_the_lane_ends_after_that_step(make_engine):
    """Its pages are in the lane's forward: the engine's step defers the abort, the lane's end
    finishes it, and every page comes back."""
    engine = make_engine()
    engine.scheduler.lane_on = True
    cache = engine.executor.cache
    initial = cache.num_free_pages
    streams = [engine.submit(_reqs("a", [9, 11], max_tokens=30))]
    engine.step()
    streams.append(engine.submit(_reqs("bb", [14, 9])))  # as many as decode: for the lane
    engine.step()
    run_prompts = engine.executor.run_prompts

    def abort_meanwhile(tasks):
        engine.abort("bb0")
        engine.step()  # the engine's step meanwhile: it must not free bb0's pages yet
        assert engine._requests["bb0"].status.value == "prefilling"
        return run_prompts(tasks)

    engine.executor.run_prompts = abort_meanwhile  # type: ignore[method-assign]
    assert engine.lane_step()
    deltas = [d for s in streams for frame in s.poll() for d in frame]
    bb0 = [d for d in deltas if d.request_id == "bb0"]
    assert bb0[-1].finish_reason == "abort"
    assert [r.request_id for r in engine.scheduler.running] == ["a0", "a1", "bb1"]
    while engine.has_work:
        engine.step()
    assert cache.num_free_pages == initial


def _one_decoding_then(make_engine, arriving: list[EngineRequest]):
    """An engine with its lane on (driven by hand), "a0" decoding after its first step, and
    `arriving` submitted for the lane; the engine, its streams and its free pages at first."""
    engine = make_engine()
    engine.scheduler.lane_on = True
    initial = engine.executor.cache.num_free_pages
    streams = [engine.submit(_reqs("a", [9]))]
    engine.step()
    streams.append(engine.submit(arriving))
    return engine, streams, initial


def test_prompts_that_outnumber_the_decodes_go_into_the_engines_own_step(make_engine):
    """A burst (three prompts while one request decodes): the engine's next step takes them all
    beside its decode instead of leaving them to the lane one by one; same tokens."""
    burst = _reqs("bb", [14, 9, 21])
    engine, streams, initial = _one_decoding_then(make_engine, burst)
    engine.step_log = []
    engine.step()
    first = engine.step_log[0]
    assert (first.num_decodes, first.num_prompt_tokens) == (1, 14 + 9 + 21)
    assert not engine.scheduler.waiting and not engine.scheduler.lane
    while engine.has_work:
        engine.step()
    assert _tokens(streams) == _reference(make_engine, [_reqs("a", [9]), burst])
    assert engine.stats_snapshot.num_lane_steps == 0
    assert engine.executor.cache.num_free_pages == initial


def test_a_failing_lane_step_fails_only_its_own_requests(make_engine):
    engine, streams, initial = _one_decoding_then(make_engine, _reqs("bb", [14]))

    def fail(tasks):
        raise RuntimeError("lane broke")

    engine.executor.run_prompts = fail  # type: ignore[method-assign]
    assert engine.lane_step()
    while engine.has_work:
        engine.step()
    ends = {
        d.request_id: d for s in streams for frame in s.poll() for d in frame if d.finish_reason
    }
    assert ends["bb0"].finish_reason == "error" and "lane broke" in (ends["bb0"].error or "")
    assert ends["a0"].finish_reason == "length"
    assert engine.executor.cache.num_free_pages == initial


def test_a_step_whose_results_cannot_be_applied_fails_its_requests_instead_of_stranding_them(
    make_engine,
):
    """A bug in applying a step's results (not in the step itself): its requests end with an
    error and give their pages back; the lane's are not left in the lane with no step to take
    them, and one that finished in there before the bug still gets its end. Later requests
    run as usual."""
    engine, streams, initial = _one_decoding_then(
        make_engine, _reqs("bb", [14]) + _reqs("c", [6], max_tokens=1)
    )
    applied = Engine._postprocess

    def broken(self, step, result):
        applied(self, step, result)  # "c0" finishes with its only token in here
        raise RuntimeError("bookkeeping broke")

    engine._postprocess = broken.__get__(engine)  # type: ignore[method-assign]
    assert engine.lane_step()
    assert not engine.scheduler.lane  # nothing stranded in the lane
    engine.step()  # the engine's own step: "a0" fails the same way
    del engine._postprocess
    ends = {
        d.request_id: d for s in streams for frame in s.poll() for d in frame if d.finish_reason
    }
    assert {rid: d.finish_reason for rid, d in ends.items()} == {
        "a0": "error",
        "bb0": "error",
        "c0": "error",
    }
    assert all("bookkeeping broke" in (d.error or "") for d in ends.values())
    assert not engine.has_work and engine.executor.cache.num_free_pages == initial
    later = engine.submit(_reqs("d", [8], max_tokens=3))
    while engine.has_work:
        engine.step()
    assert _tokens([later]) == _reference(make_engine, [_reqs("d", [8], max_tokens=3)])


def test_the_engines_steps_leave_the_lane_its_threads_while_it_runs_or_prompts_wait_for_it(
    make_engine,
):
    engine = make_engine(cpu_small_step_tokens=None)
    executor = engine.executor
    assert executor.step_threads(100) == 2
    executor.lane_wanted = True
    assert executor.step_threads(100) == 1
    executor.lane_wanted = False
    assert executor.claim_lane() and executor.step_threads(100) == 1
    executor.release_lane()
    executor.main_threads = 2  # a step of the engine's own on every thread: the lane waits
    assert not executor.claim_lane()
    executor.main_threads = 1
    assert executor.claim_lane()
    executor.release_lane()
    assert make_engine(cpu_prompt_lane=False).executor.lane is None
    assert make_engine(overlap=True).executor.lane is None


def test_the_lane_runs_on_one_thread_so_with_four_threads_or_more_there_is_none(make_engine):
    # with 4 or more its share would be an OpenMP team beside the loop's, which throttles every
    # barrier of the loop's steps once their threads outnumber the cores (Executor._lane_possible)
    lane = make_engine(threads=3).executor.lane
    assert lane is not None and lane.threads == 1
    assert make_engine(threads=4).executor.lane is None
    assert make_engine(threads=16).executor.lane is None


def test_a_started_engine_runs_new_prompts_in_the_lane_with_the_plain_engines_tokens(make_engine):
    # a0 and a1 decode long enough for the others to arrive
    roomy = dict(max_seq_len=512, num_pages=400)
    engine = make_engine(**roomy)
    engine.start()
    try:
        first = _reqs("a", [9, 14], max_tokens=400)
        later = _reqs("bb", [21, 17], max_tokens=8)  # as many as decode: for the lane
        stream = engine.submit(first)
        started = threading.Event()
        got: dict[str, list[int]] = {}

        def read():
            for frame in stream:
                for d in frame:
                    got.setdefault(d.request_id, []).extend(d.new_token_ids)
                started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(30)
        late = engine.submit(later)  # a0 and a1 decode: the lane takes these
        late_got: dict[str, list[int]] = {}
        for frame in late:
            for d in frame:
                late_got.setdefault(d.request_id, []).extend(d.new_token_ids)
        reader.join(60)
        deadline = time.monotonic() + 10
        while engine.has_work and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats().loop_alive  # both threads
    finally:
        engine.shutdown()
    assert not engine.stats().loop_alive
    assert engine.stats().num_lane_steps >= 1
    want = _reference(make_engine, [first, later], **roomy)
    assert {**got, **late_got} == want
    assert engine.executor.cache.num_free_pages == engine.executor.cache.num_total_pages


def test_streams_closed_at_random_moments_leave_no_request_behind(make_engine):
    """Both threads running; requests arrive while others decode and are cancelled at random
    points: in the queue, in the lane's forward, decoding. Each round ends with nothing
    running or waiting, and at the end every page is free."""
    import random

    engine = make_engine(max_seq_len=512, num_pages=400)
    engine.start()
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    try:
        for round_ in range(15):
            streams = []
            for i in range(4):
                prompt = random_prompts([rng.randint(20, 60)], seed=10 * round_ + i)[0]
                streams.append(engine.submit([EngineRequest(f"r{round_}-{i}", prompt, params)]))
                time.sleep(rng.random() * 0.01)
            time.sleep(rng.random() * 0.05)
            for s in streams:
                s.close()
                time.sleep(rng.random() * 0.003)
            deadline = time.monotonic() + 10
            while (
                engine.stats().num_running or engine.stats().num_waiting
            ) and time.monotonic() < deadline:
                time.sleep(0.005)
            stats = engine.stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0), round_
        assert engine.stats().num_lane_steps >= 1
    finally:
        engine.shutdown()
    cache = engine.executor.cache
    assert cache.num_free_pages == cache.num_total_pages
