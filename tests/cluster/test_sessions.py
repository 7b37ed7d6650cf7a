"""The worker's side of the session protocol, on a real tiny engine, without Ray: requests
from several `submit` calls of one ingress come back on one `session` stream, one frame
per engine step; sessions end when idle, refuse the wrong replica, and a cancelled session
or an orphaned mailbox aborts its requests and frees their pages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import msgpack
import pytest

import cluster.deployment as deployment
from cluster.deployment import WorkerDeployment
from cluster.router import RouteHint
from cluster.transport import Accepted, Refused, decode_deltas, decode_first, encode_requests
from tests.factories.tiny_models import random_prompts
from worker.config import EngineConfig
from worker.outputs import RequestDelta
from worker.sampling import SamplingParams
from worker.validation import EngineRequest

REPLICA = "w-1"
HERE = RouteHint(replica_id=REPLICA)


@pytest.fixture
def make_worker(tiny_model, monkeypatch) -> Iterator[object]:
    path, _ = tiny_model("llama")
    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id=REPLICA))
    monkeypatch.setattr(deployment.serve, "get_replica_context", lambda: context)
    made: list[WorkerDeployment] = []

    def make(**options: float | bool) -> WorkerDeployment:
        config = EngineConfig(
            model=str(path),
            device="cpu",
            max_seq_len=128,
            max_running=8,
            num_pages=96,
            advanced={"page_size": 4},
        )
        worker = WorkerDeployment(config, **options)  # type: ignore[arg-type]
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker._engine.shutdown()


def payload(prefix: str, n: int, max_tokens: int = 12) -> bytes:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = random_prompts([9, 14, 5, 21][:n])
    return encode_requests(
        [EngineRequest(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]
    )


async def submit(worker: WorkerDeployment, body: bytes, ingress: str = "ing-a") -> str:
    answer = decode_first(await worker.submit(RouteHint(), body, ingress))
    assert isinstance(answer, Accepted), answer
    return answer.replica_id


async def read(frames: AsyncIterator[bytes]) -> tuple[int, list[RequestDelta]]:
    """Frames after the accept frame: (how many carried deltas, every delta)."""
    first = decode_first(await anext(frames))
    assert isinstance(first, Accepted) and first.replica_id == REPLICA
    count, deltas = 0, []
    async for frame in frames:
        step = decode_deltas(frame)
        count += bool(step)
        deltas.extend(step)
    return count, deltas


def tokens_by_request(deltas: list[RequestDelta]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in deltas:
        out[d.request_id] = out.get(d.request_id, 0) + len(d.new_token_ids)
    return out


def idle_and_free(worker: WorkerDeployment) -> bool:
    stats = worker._engine.stats()
    idle = stats.num_running + stats.num_waiting == 0 and not worker._engine.has_work
    return idle and stats.num_free_pages == stats.num_total_pages


async def wait_until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_one_session_carries_every_submit_of_its_ingress_one_frame_per_step(make_worker) -> None:
    worker = make_worker(linger_s=0.2)

    async def run() -> tuple[int, list[RequestDelta]]:
        assert await submit(worker, payload("a", 3)) == REPLICA
        assert await submit(worker, payload("b", 2)) == REPLICA
        return await read(worker.session(HERE, "ing-a"))

    frames, deltas = asyncio.run(run())
    assert tokens_by_request(deltas) == {"a0": 12, "a1": 12, "a2": 12, "b0": 12, "b1": 12}
    assert sorted(d.request_id for d in deltas if d.finished) == ["a0", "a1", "a2", "b0", "b1"]
    assert all(d.finish_reason == "length" for d in deltas if d.finished)
    assert frames < len(deltas)  # one frame per step, holding several requests
    assert idle_and_free(worker)


def test_an_idle_replicas_routing_reports_stay_alike(make_worker) -> None:
    """Serve's controller sends a replica's report to every router only when it changed: an
    idle replica's must not (its `time` is when the content last changed)."""
    worker = make_worker(linger_s=0.2)
    idle = worker.record_routing_stats()
    assert worker.record_routing_stats() == idle

    async def run() -> None:
        await submit(worker, payload("a", 2, max_tokens=4))
        await read(worker.session(HERE, "ing-a"))

    asyncio.run(run())
    served = worker.record_routing_stats()
    assert served != idle and served["time"] > idle["time"]
    assert served["prefix_keys"] and not idle["prefix_keys"]  # the prompts' pages, cached
    assert worker.record_routing_stats() == served  # idle again: alike again


def test_a_submit_while_the_session_lingers_comes_on_the_same_session(make_worker) -> None:
    worker = make_worker(linger_s=1.0)

    async def run() -> list[RequestDelta]:
        await submit(worker, payload("first", 1, max_tokens=4))
        reader = asyncio.create_task(read(worker.session(HERE, "ing-a")))
        await wait_until(lambda: worker._engine.stats().generation_tokens_total >= 4)
        await asyncio.sleep(0.05)  # the first request is done; the session lingers
        await submit(worker, payload("second", 1, max_tokens=4))
        _, deltas = await reader
        return deltas

    deltas = asyncio.run(run())
    assert tokens_by_request(deltas) == {"first0": 4, "second0": 4}


def test_sessions_of_two_ingresses_stay_apart(make_worker) -> None:
    worker = make_worker(linger_s=0.1)

    async def run() -> tuple[list[RequestDelta], list[RequestDelta]]:
        await submit(worker, payload("a", 2), "ing-a")
        await submit(worker, payload("b", 2), "ing-b")
        (_, a), (_, b) = await asyncio.gather(
            read(worker.session(HERE, "ing-a")), read(worker.session(HERE, "ing-b"))
        )
        return a, b

    a, b = asyncio.run(run())
    assert set(tokens_by_request(a)) == {"a0", "a1"}
    assert set(tokens_by_request(b)) == {"b0", "b1"}


def test_a_session_for_another_replica_is_refused(make_worker) -> None:
    worker = make_worker()

    async def run() -> list[bytes]:
        return [frame async for frame in worker.session(RouteHint(replica_id="gone"), "ing-a")]

    [frame] = asyncio.run(run())
    answer = decode_first(frame)
    assert isinstance(answer, Refused) and answer.kind == "gone"


def test_a_cancelled_session_aborts_its_requests_and_frees_their_pages(make_worker) -> None:
    worker = make_worker(fault_injection=True)
    worker._faults.arm(steps=10_000, stall_s=0.01)  # slow steps: 100 tokens take over 1 s

    async def run() -> None:
        await submit(worker, payload("long", 2, max_tokens=100))
        frames = worker.session(HERE, "ing-a")
        await anext(frames)  # accept
        await anext(frames)  # a step's deltas: they are running
        await frames.aclose()  # what Serve does when the ingress cancels the call
        await wait_until(lambda: idle_and_free(worker))

    asyncio.run(run())
    assert worker._engine.stats().generation_tokens_total < 200


def test_a_mailbox_no_session_reads_is_reaped(make_worker) -> None:
    worker = make_worker(orphan_timeout_s=0.3, fault_injection=True)
    worker._faults.arm(steps=10_000, stall_s=0.01)  # slow steps: 100 tokens take over 1 s

    async def run() -> None:
        await submit(worker, payload("orphan", 2, max_tokens=100))  # and the ingress dies
        await wait_until(lambda: "ing-a" not in worker._mailboxes and idle_and_free(worker))

    asyncio.run(run())
    assert 0 < worker._engine.stats().generation_tokens_total < 200


def test_a_lagging_session_merges_steps_into_one_delta_per_request(make_worker) -> None:
    worker = make_worker(linger_s=0.1)

    async def run() -> list[list[RequestDelta]]:
        await submit(worker, payload("lag", 2, max_tokens=12))
        frames = worker.session(HERE, "ing-a")
        await anext(frames)  # accept
        await wait_until(lambda: worker._engine.stats().generation_tokens_total >= 24)
        return [decode_deltas(frame) async for frame in frames]  # read only now

    frames = asyncio.run(run())
    for frame in frames:  # an SSE chunk per frame must not carry a choice twice
        ids = [d.request_id for d in frame]
        assert len(ids) == len(set(ids)), ids
    deltas = [d for frame in frames for d in frame]
    assert tokens_by_request(deltas) == {"lag0": 12, "lag1": 12}
    assert any(len(d.new_token_ids) > 1 for d in deltas)  # steps were merged
    assert sorted(d.request_id for d in deltas if d.finish_reason == "length") == ["lag0", "lag1"]


def test_heartbeats_come_while_a_request_waits_and_not_while_its_frames_flow(make_worker) -> None:
    worker = make_worker(heartbeat_s=0.05, linger_s=0.2, fault_injection=True)
    worker._faults.arm(steps=10_000, stall_s=0.02)  # steps of 20 ms

    async def run() -> list[list[RequestDelta]]:
        for prefix in ("b", "c"):  # 8 requests of another ingress fill every running slot
            await submit(worker, payload(prefix, 4, max_tokens=20), "ing-other")
        await submit(worker, payload("a", 1, max_tokens=20))
        frames = worker.session(HERE, "ing-a")
        await anext(frames)  # accept
        return [decode_deltas(frame) async for frame in frames]

    frames = asyncio.run(run())
    first = next(i for i, frame in enumerate(frames) if frame)
    assert first >= 2, frames[: first + 1]  # empty frames while it waited behind the 8
    assert all(frames[first:])  # none among its 20 steps' frames (~0.4 s, 8 heartbeat periods)
    assert tokens_by_request([d for f in frames for d in f]) == {"a0": 20}


def test_a_request_behind_slow_steps_hears_from_its_worker_every_step(make_worker) -> None:
    """Steps six heartbeat periods long are slow, not stalled: a waiting request gets a
    heartbeat after each step, not only after every second one (the ingress's stall
    timeout is four periods)."""
    worker = make_worker(heartbeat_s=0.05, linger_s=0.2, fault_injection=True)
    worker._faults.arm(steps=10_000, stall_s=0.3)

    async def run() -> tuple[int, int]:
        for prefix in ("b", "c"):  # 8 requests of another ingress fill every running slot
            await submit(worker, payload(prefix, 4, max_tokens=6), "ing-other")
        await submit(worker, payload("a", 1, max_tokens=2))
        frames = worker.session(HERE, "ing-a")
        await anext(frames)  # accept
        start, heartbeats = worker._engine.stats_snapshot.num_steps, 0
        async for frame in frames:
            if decode_deltas(frame):
                break
            heartbeats += 1
        waited = worker._engine.stats_snapshot.num_steps - start
        async for _ in frames:
            pass
        return heartbeats, waited

    heartbeats, waited = asyncio.run(run())
    assert waited >= 6
    assert heartbeats >= waited - 2, (heartbeats, waited)


# -- what a worker takes from a caller that skipped the ingress ---------------------------


def raw_submit(rows: object) -> bytes:
    return msgpack.packb(rows)


GOOD = {"max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([["f", [1.5, 2.0, 3.0], GOOD]], "integers"),  # float token ids are not truncated
        ([["t", [True, 2], GOOD]], "integers"),
        ([["v", [1, 10**9], GOOD]], "vocabulary"),
        ([["n", [-1, 2], GOOD]], "vocabulary"),
        ([["e", [], GOOD]], "empty"),
        ([["m", [1, 2, 3], {"max_tokens": 2**63}]], "context length"),
        ([["c", [1, 2, 3], {"max_tokens": 200}]], "context length"),  # 128 is the limit
        ([["l", [1] * 128, GOOD]], "context length"),
        ([["p", [1, 2], {"temperature": -1}]], "sampling parameters"),
        ([["p", [1, 2], {"top_p": 0}]], "sampling parameters"),
        ([["p", [1, 2], {"n": 0}]], "sampling parameters"),
        ([["x", [1, 2], {"no_such_field": 1}]], "sampling parameters"),
        ([["", [1, 2], GOOD]], "request id"),
        ([[7, [1, 2], GOOD]], "request id"),
        ([["k", "1 2 3", GOOD]], "malformed"),
        ([["k", [1, 2]]], "malformed"),
        ({"not": "rows"}, "malformed"),
        ([], "at least one"),
    ],
)
def test_a_worker_refuses_what_the_ingress_would_refuse_and_queues_nothing(
    make_worker, rows: object, reason: str
) -> None:
    worker = make_worker()
    answer = decode_first(asyncio.run(worker.submit(RouteHint(), raw_submit(rows), "anyone")))
    assert isinstance(answer, Refused) and answer.kind == "invalid", answer
    assert reason in answer.message, answer.message
    assert not worker._engine.has_work and not worker._mailboxes
    # still healthy and serving
    worker.check_health()
    assert asyncio.run(submit(worker, payload("ok", 1, max_tokens=2), "anyone")) == REPLICA


def test_garbage_bytes_are_refused_not_raised(make_worker) -> None:
    worker = make_worker()
    for body in (b"", b"\xc1", b"\x93\x01", bytes(range(256))):
        answer = decode_first(asyncio.run(worker.submit(RouteHint(), body, "anyone")))
        assert isinstance(answer, Refused) and answer.kind == "invalid", (body, answer)


def test_the_answered_count_is_the_workers_own_not_the_callers_word(make_worker) -> None:
    """A router counts its unanswered sends from this; a hint's num_requests may lie."""
    worker = make_worker(linger_s=0.1)
    hint = RouteHint(num_requests=-1000, sender="ing-a")
    asyncio.run(worker.submit(hint, payload("a", 2, max_tokens=2), "ing-a"))
    assert worker.record_routing_stats()["answered"] == {"ing-a": 2}


def test_an_abort_names_its_ingress_and_leaves_another_ingresss_requests_alone(make_worker) -> None:
    worker = make_worker(linger_s=0.2, fault_injection=True)
    worker._faults.arm(steps=10_000, stall_s=0.01)  # slow steps: 12 tokens take a while

    async def run() -> tuple[dict[str, int], dict[str, int]]:
        await submit(worker, payload("a", 1), "ing-a")
        await submit(worker, payload("b", 1), "ing-b")
        await worker.abort(HERE, ["a0", "b0"], "ing-b")  # ing-b's own and a guess at ing-a's
        (_, a), (_, b) = await asyncio.gather(
            read(worker.session(HERE, "ing-a")), read(worker.session(HERE, "ing-b"))
        )
        return tokens_by_request(a), {d.request_id: d.finish_reason for d in b if d.finished}

    a, b = asyncio.run(run())
    assert a == {"a0": 12}  # untouched
    assert b == {"b0": "abort"}


def test_a_queued_prompts_pages_are_reported_until_the_engine_reports_them(
    make_worker, monkeypatch
) -> None:
    """A tenant's next prompt must find this replica before its context is computed: the
    page hashes of an accepted prompt are reported for QUEUED_KEYS_S, newest first, then
    drop out; at most as many as the cache has pages."""
    import time

    monkeypatch.setattr(deployment, "QUEUED_KEYS_S", 0.5)
    worker = make_worker(linger_s=0.1)
    asyncio.run(worker.submit(RouteHint(page_hashes=((11, 12, 13),)), payload("a", 1, 1), "i"))
    asyncio.run(worker.submit(RouteHint(page_hashes=((11, 21),)), payload("b", 1, 1), "i"))
    stats = worker.record_routing_stats()
    assert stats["prefix_keys"][:4] == [21, 11, 13, 12]
    # how full the cache is counts every key, however few the summary shows (the router's
    # placement of new prefixes)
    assert stats["resident_pages"] == len(stats["prefix_keys"]) >= 4
    assert stats["num_total_pages"] == worker._engine.executor.cache.num_total_pages
    worker._summary_pages = 2
    assert worker.record_routing_stats()["prefix_keys"] == [21, 11]
    assert worker.record_routing_stats()["resident_pages"] == stats["resident_pages"]
    worker._summary_pages = None
    time.sleep(0.6)
    assert not {11, 12, 13, 21} & set(worker.record_routing_stats()["prefix_keys"])

    pages = worker._engine.executor.cache.num_total_pages
    many = tuple(range(10_000, 10_000 + pages + 50))
    asyncio.run(worker.submit(RouteHint(page_hashes=(many,)), payload("d", 1, 1), "i"))
    assert len(worker._queued_keys) == pages and many[-1] in worker._queued_keys
