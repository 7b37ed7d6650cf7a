"""The worker's side of the session protocol, on a real tiny engine, without Ray: requests
from several `submit` calls of one ingress come back on one `session` stream, one frame
per engine step; sessions end when idle, refuse the wrong replica, and a cancelled session
or an orphaned mailbox aborts its requests and frees their pages."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Iterator
from types import SimpleNamespace

import pytest

import cluster.deployment as deployment
from cluster import timeline
from cluster.config import RequestLimits
from cluster.deployment import WorkerDeployment
from cluster.dispatch import Dispatcher, Group
from cluster.router import RouteHint
from cluster.transport import (
    Accepted,
    FrameWriter,
    Refused,
    WireRequest,
    decode_deltas,
    decode_first,
    decode_submit_answer,
    encode_deltas,
    encode_hello,
    encode_requests,
    encode_submit,
    read_frame,
    write_frame,
)
from tests.factories.tiny_models import random_prompts
from worker.config import EngineConfig
from worker.outputs import RequestDelta
from worker.sampling import SamplingParams
from worker.streams import OutputStream

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
            model=str(path), device="cpu", max_seq_len=128, max_running=8, page_size=4, num_pages=96
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
    return encode_requests([WireRequest(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)])


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


# -- the session over the frame socket -----------------------------------------------------------


async def open_socket_session(worker: WorkerDeployment, body: bytes, ingress: str = "ing-a"):
    """Submit, then connect to the address the accept frame names and say hello."""
    answer = decode_first(await worker.submit(RouteHint(), body, ingress))
    assert isinstance(answer, Accepted) and answer.frames_at is not None, answer
    reader, writer = await asyncio.open_connection(*answer.frames_at)
    write_frame(writer, encode_hello(ingress, REPLICA))
    first = decode_first(await read_frame(reader))  # type: ignore[arg-type]
    assert isinstance(first, Accepted) and first.replica_id == REPLICA
    return reader, writer


async def read_to_the_end(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> list[list[RequestDelta]]:
    """Every frame of a socket session until the worker closes it."""
    frames = []
    while (frame := await read_frame(reader)) is not None:
        frames.append(decode_deltas(frame))
    writer.close()
    return frames


def test_a_session_reads_the_same_frames_over_the_frame_socket(make_worker) -> None:
    worker = make_worker(linger_s=0.2, frame_socket=True)

    async def run() -> list[list[RequestDelta]]:
        return await read_to_the_end(*await open_socket_session(worker, payload("s", 3)))

    deltas = [d for frame in asyncio.run(run()) for d in frame]
    assert tokens_by_request(deltas) == {"s0": 12, "s1": 12, "s2": 12}
    assert sorted(d.request_id for d in deltas if d.finished) == ["s0", "s1", "s2"]
    assert idle_and_free(worker)


def test_closing_the_frame_socket_aborts_the_sessions_requests(make_worker) -> None:
    worker = make_worker(fault_injection=True, frame_socket=True)
    worker._faults.arm(steps=10_000, stall_s=0.01)  # slow steps: 100 tokens take over 1 s

    async def run() -> None:
        reader, writer = await open_socket_session(worker, payload("long", 2, max_tokens=100))
        assert decode_deltas(await read_frame(reader))  # type: ignore[arg-type]  # running
        writer.close()  # the ingress gave up, or died
        await wait_until(lambda: idle_and_free(worker))

    asyncio.run(run())
    assert worker._engine.stats().generation_tokens_total < 200


def test_a_worker_without_the_frame_socket_names_no_address(make_worker) -> None:
    worker = make_worker()
    answer = decode_first(
        asyncio.run(worker.submit(RouteHint(), payload("n", 1, max_tokens=2), "ing-a"))
    )
    assert isinstance(answer, Accepted) and answer.frames_at is None
    asyncio.run(read(worker.session(HERE, "ing-a")))


async def open_submit_link(
    worker: WorkerDeployment, ingress: str = "ing-a"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    at = (await worker.record_replica_metadata())["frames_at"]
    reader, writer = await asyncio.open_connection(at[0], at[1])
    write_frame(writer, encode_hello(ingress, "", kind="submit"))
    return reader, writer


def test_submits_over_a_submit_link_are_answered_by_id_and_deliver_on_the_session(
    make_worker,
) -> None:
    worker = make_worker(linger_s=0.2, frame_socket=True)

    async def run() -> tuple[list[tuple[int, Accepted | Refused]], list[RequestDelta]]:
        reader, writer = await open_submit_link(worker)
        write_frame(writer, encode_submit(7, 2, "ing-a", payload("a", 2)))
        write_frame(writer, encode_submit(8, 1, "ing-a", payload("b", 1)))
        answers = []
        for _ in range(2):
            submit_id, answer = decode_submit_answer(await read_frame(reader))  # type: ignore[arg-type]
            answers.append((submit_id, decode_first(answer)))
        at = answers[0][1].frames_at  # type: ignore[union-attr]
        s_reader, s_writer = await asyncio.open_connection(*at)
        write_frame(s_writer, encode_hello("ing-a", REPLICA))
        assert isinstance(decode_first(await read_frame(s_reader)), Accepted)  # type: ignore[arg-type]
        deltas = []
        while (frame := await read_frame(s_reader)) is not None:
            deltas.extend(decode_deltas(frame))
        s_writer.close()
        writer.close()
        return answers, deltas

    answers, deltas = asyncio.run(run())
    assert [i for i, _ in answers] == [7, 8]
    assert all(isinstance(a, Accepted) and a.replica_id == REPLICA for _, a in answers)
    assert tokens_by_request(deltas) == {"a0": 12, "a1": 12, "b0": 12}
    assert worker._answered["ing-a"][0] == 3  # the routers' load accounting sees link submits too
    assert idle_and_free(worker)


def test_a_refused_submit_on_a_link_keeps_the_link_open(make_worker) -> None:
    worker = make_worker(frame_socket=True)

    async def run() -> list[Accepted | Refused]:
        reader, writer = await open_submit_link(worker)
        # an empty prompt
        bad = encode_requests([WireRequest("x", [], SamplingParams(max_tokens=2))])
        answers = []
        for i, body in enumerate((bad, payload("ok", 1, max_tokens=2))):
            write_frame(writer, encode_submit(i, 1, "ing-a", body))
            answers.append(decode_first(decode_submit_answer(await read_frame(reader))[1]))  # type: ignore[arg-type]
        await read(worker.session(HERE, "ing-a"))
        writer.close()
        return answers

    first, second = asyncio.run(run())
    assert isinstance(first, Refused) and first.kind == "invalid"
    assert isinstance(second, Accepted)


def test_a_draining_worker_closes_its_submit_links_and_takes_no_new_ones(make_worker) -> None:
    worker = make_worker(frame_socket=True, fault_injection=True)
    worker._faults.arm(steps=10_000, stall_s=0.05)  # 8 tokens take 0.4 s: unfinished at the stop

    async def run() -> tuple[bytes | None, bytes | None]:
        reader, writer = await open_submit_link(worker)
        write_frame(writer, encode_submit(1, 1, "ing-a", payload("d", 1, max_tokens=8)))
        assert isinstance(decode_first(decode_submit_answer(await read_frame(reader))[1]), Accepted)  # type: ignore[arg-type]
        stopping = worker.__del__()  # Serve stops the replica; its request is unfinished
        closed = await read_frame(reader)  # the link closes: a submit sent now is sent elsewhere
        late_reader, _ = await open_submit_link(worker)
        refused = await read_frame(late_reader)
        await read(worker.session(HERE, "ing-a"))  # the accepted request still finishes
        assert stopping is not None
        await stopping
        return closed, refused

    assert asyncio.run(run()) == (None, None)


class _ChoosingHandle:
    """A worker handle in front of one in-process worker, with Serve's `choose_replica`
    (its replica metadata naming `frames_at`): counts the Serve calls made through it."""

    def __init__(
        self,
        worker: WorkerDeployment,
        frames_at: list[object],
        calls: dict[str, int] | None = None,
        method: str = "",
    ):
        self.worker, self.frames_at, self.method = worker, frames_at, method
        self.calls: dict[str, int] = {} if calls is None else calls

    def options(self, method_name: str, stream: bool = False) -> _ChoosingHandle:
        return _ChoosingHandle(self.worker, self.frames_at, self.calls, method_name)

    @contextlib.asynccontextmanager
    async def choose_replica(self, hint: RouteHint, _reserve: bool = True) -> AsyncIterator[object]:
        assert not _reserve
        yield SimpleNamespace(replica_id=REPLICA, replica_metadata={"frames_at": self.frames_at})

    async def remote(self, *args: object) -> bytes:
        self.calls[self.method] = self.calls.get(self.method, 0) + 1
        assert self.method == "submit", self.method
        return await self.worker.submit(*args)  # type: ignore[arg-type]


def _dispatch(
    handle: _ChoosingHandle, request_id: str
) -> Awaitable[tuple[list[RequestDelta], Dispatcher]]:
    async def run() -> tuple[list[RequestDelta], Dispatcher]:
        dispatcher = Dispatcher(handle, 0.0, 8, RequestLimits(), submit_socket=True)
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        stream = dispatcher.submit(
            Group([WireRequest(request_id, random_prompts([9])[0], params)], ())
        )
        assert await stream.accepted() == REPLICA
        deltas = [d async for frame in stream for d in frame]
        stream.close()
        return deltas, dispatcher

    return run()


def test_the_dispatcher_submits_over_the_chosen_replicas_link_without_a_serve_call(
    make_worker,
) -> None:
    worker = make_worker(linger_s=0.2, frame_socket=True)

    async def run() -> tuple[list[RequestDelta], dict[str, int]]:
        at = (await worker.record_replica_metadata())["frames_at"]
        handle = _ChoosingHandle(worker, at)
        deltas, _ = await _dispatch(handle, "l-1")
        return deltas, handle.calls

    deltas, calls = asyncio.run(run())
    assert tokens_by_request(deltas) == {"l-1": 5} and calls == {}
    assert idle_and_free(worker)


def test_a_link_that_cannot_be_opened_falls_back_to_a_serve_call(make_worker) -> None:
    worker = make_worker(linger_s=0.2, frame_socket=True)
    with socket.socket() as probe:  # a port that was free a moment ago: connects are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def run() -> tuple[list[RequestDelta], dict[str, int], set[tuple[str, int]]]:
        handle = _ChoosingHandle(worker, ["127.0.0.1", port])
        deltas, dispatcher = await _dispatch(handle, "f-1")
        return deltas, handle.calls, dispatcher.unreachable

    deltas, calls, unreachable = asyncio.run(run())
    assert tokens_by_request(deltas) == {"f-1": 5} and calls == {"submit": 1}
    assert unreachable == {("127.0.0.1", port)}


def test_the_timeline_records_a_first_tokens_hops_between_dispatcher_and_worker(
    make_worker, tmp_path
) -> None:
    worker = make_worker(linger_s=0.2, frame_socket=True)

    async def run() -> list[RequestDelta]:
        at = (await worker.record_replica_metadata())["frames_at"]
        deltas, _ = await _dispatch(_ChoosingHandle(worker, at), "t-1")
        return deltas

    timeline.configure(str(tmp_path))
    try:
        deltas = asyncio.run(run())
    finally:
        timeline.configure(None)  # writes what is recorded
    assert tokens_by_request(deltas) == {"t-1": 5}
    points = timeline.read_timelines(tmp_path)["t-1"]
    order = ["routed", "sent", "received", "queued", "first_written", "first_read"]
    assert [points[p] for p in order] == sorted(points[p] for p in order)
    timeline.mark("t-2", "routed")  # off again: nothing more is written
    timeline.flush()
    assert "t-2" not in timeline.read_timelines(tmp_path)


def test_a_socket_sessions_frames_are_written_by_the_engine_thread(make_worker) -> None:
    worker = make_worker(linger_s=5.0, frame_socket=True)

    async def until_finished(reader: asyncio.StreamReader, rid: str) -> list[list[RequestDelta]]:
        frames: list[list[RequestDelta]] = []
        while not any(d.request_id == rid and d.finished for f in frames for d in f):
            frames.append(decode_deltas(await read_frame(reader)))  # type: ignore[arg-type]
        return frames

    async def run() -> tuple[int, int]:
        reader, writer = await open_socket_session(worker, payload("h", 1))
        await until_finished(reader, "h0")  # its first steps may precede the session
        before = (await worker.stats())["frames_handed_off"]
        await submit(worker, payload("i", 1))  # comes on the session, lingering, attached
        frames = await until_finished(reader, "i0")
        writer.close()
        return (await worker.stats())["frames_handed_off"] - before, sum(map(bool, frames))

    handed_off, frames = asyncio.run(run())
    # an idle socket takes each step's frame at once: none went through the event loop
    assert handed_off == frames == 12


def test_frames_from_the_engine_thread_and_the_loop_arrive_whole_and_in_order() -> None:
    """A slow reader: the engine thread's sends fill the socket, leave rests to the loop and
    are declined while anything is queued; the loop writes what waited, as a session does."""
    count, tokens = 200, 4000  # frames of ~12 KB against buffers of a few

    class Writer(FrameWriter):
        rests = 0  # sends the socket took part of

        def _flush(self) -> None:
            with self.lock:
                Writer.rests += bool(self._rest)
                super()._flush()

    async def run() -> tuple[list[int], int, int]:
        stream = OutputStream(["a"], abort=lambda rid: None)
        wake = asyncio.Event()
        stream.wakeup(asyncio.get_running_loop(), wake)
        taken, declined, sent = 0, 0, asyncio.Event()

        async def serve(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal taken, declined
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sink = Writer(writer)

            def take(frame: list[RequestDelta]) -> bool:
                nonlocal taken, declined
                ok = sink.try_write(encode_deltas(frame))
                taken, declined = taken + ok, declined + (not ok)
                return ok

            stream.hand_off(take)
            sent.set()
            while True:  # the session's part: what waited, under the writer's lock
                wake.clear()
                with sink.lock:
                    frames, finished = stream.drain()
                    for frame in frames:
                        sink.write(encode_deltas(frame))
                await sink.drain()
                if finished and not frames:
                    break
                if not frames:
                    await wake.wait()
            sink.close()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before the handshake
        client.connect(server.sockets[0].getsockname()[:2])
        reader, writer = await asyncio.open_connection(sock=client)
        await sent.wait()

        def engine() -> None:
            for i in range(count):
                stream.push(step_of(i))

        def step_of(i: int) -> list[RequestDelta]:
            last = i == count - 1
            return [RequestDelta("a", [i] * tokens, finish_reason="length" if last else None)]

        pushing = asyncio.ensure_future(asyncio.to_thread(engine))
        seen = []
        while (frame := await read_frame(reader)) is not None:
            (delta,) = decode_deltas(frame)
            assert delta.new_token_ids == [delta.new_token_ids[0]] * tokens
            seen.append(delta.new_token_ids[0])
            await asyncio.sleep(0.001)  # a slow reader
        await pushing
        writer.close()
        server.close()
        return seen, taken, declined

    seen, taken, declined = asyncio.run(run())
    assert seen == list(range(200))
    assert taken > 0 and declined > 0 and Writer.rests > 0, (taken, declined, Writer.rests)


def test_heartbeats_come_while_a_request_waits_and_not_while_its_frames_flow(make_worker) -> None:
    worker = make_worker(frame_socket=True, heartbeat_s=0.05, linger_s=0.2, fault_injection=True)
    worker._faults.arm(steps=10_000, stall_s=0.02)  # steps of 20 ms, frames from the engine thread

    async def run() -> list[list[RequestDelta]]:
        for prefix in ("b", "c"):  # 8 requests of another ingress fill every running slot
            await submit(worker, payload(prefix, 4, max_tokens=20), "ing-other")
        body = payload("a", 1, max_tokens=20)
        return await read_to_the_end(*await open_socket_session(worker, body))

    frames = asyncio.run(run())
    first = next(i for i, frame in enumerate(frames) if frame)
    assert first >= 2, frames[: first + 1]  # empty frames while it waited behind the 8
    assert all(frames[first:])  # none among its 20 steps' frames (~0.4 s, 8 heartbeat periods)
    assert tokens_by_request([d for f in frames for d in f]) == {"a0": 20}
