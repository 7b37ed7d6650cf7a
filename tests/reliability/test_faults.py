"""An engine step that raises fails only its own requests (500 JSON, or an SSE error event
then [DONE]); the engine, the other replica and later requests keep working; no page leaks.
A worker that stalls ends its clients' requests after `limits.stall_timeout_s`."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from tests.cluster.conftest import Served
from tests.reliability.conftest import (
    STALL_TIMEOUT_S,
    arm_fault,
    arm_faults,
    completion_body,
    post,
    sse_lines,
    wait_all_idle,
)
from worker.outputs import RequestDelta
from worker.sampling import SamplingParams
from worker.validation import EngineRequest


def test_a_failing_step_answers_500_with_openai_error_json(app: Served) -> None:
    wait_all_idle(app)
    arm_faults(app, steps=1)
    try:
        failed = post(app, "/v1/completions", completion_body("A failing step:"))
    finally:
        arm_faults(app, steps=0)
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    later = post(app, "/v1/completions", completion_body("After the fault:"))
    assert later.status_code == 200
    wait_all_idle(app)


def test_a_failing_step_ends_a_stream_with_an_error_event_then_done(app: Served) -> None:
    arm_faults(app, steps=1)
    try:
        lines = sse_lines(app, completion_body("A failing stream:", max_tokens=16))
    finally:
        arm_faults(app, steps=0)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    assert sse_lines(app, completion_body("A healthy stream:"))[-1] == "data: [DONE]"
    stats = wait_all_idle(app)
    assert sum(s["faults_injected"] for s in stats.values()) >= 2


def generate_on(
    app: Served, replica_id: str, request_id: str, max_tokens: int
) -> list[RequestDelta]:
    """One request straight through the worker handle, pinned to one replica; its deltas."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return app.generate_on(
        replica_id, [EngineRequest(request_id, [1000, 1001, 1002, 1003], params)]
    )


def test_a_fault_on_one_replica_leaves_the_other_streaming(app: Served) -> None:
    replicas = sorted(wait_all_idle(app))
    victim, healthy = replicas
    results: dict[str, list[RequestDelta]] = {}

    def run(replica_id: str, request_id: str, max_tokens: int) -> None:
        results[request_id] = generate_on(app, replica_id, request_id, max_tokens)

    long_one = threading.Thread(target=run, args=(healthy, "fault-healthy", 48))
    long_one.start()
    time.sleep(0.5)
    arm_fault(app, victim, steps=1)
    run(victim, "fault-victim", 48)
    long_one.join(timeout=120)
    [failed] = results["fault-victim"]
    assert failed.finish_reason == "error" and "injected fault" in (failed.error or "")
    healthy_deltas = results["fault-healthy"]
    assert healthy_deltas[-1].finish_reason == "length"
    assert sum(len(d.new_token_ids) for d in healthy_deltas) == 48
    after = wait_all_idle(app)
    assert after[victim]["faults_injected"] >= 1 and after[victim]["loop_alive"]


def timed_request(app: Served, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    return post(
        app, "/v1/completions", body, timeout=STALL_TIMEOUT_S * 10
    ), time.monotonic() - start


def steps_taken(app: Served) -> int:
    return sum(s["num_steps"] for s in app.worker_stats().values())


def test_a_stalled_worker_fails_its_clients_after_the_stall_timeout(app: Served) -> None:
    wait_all_idle(app)
    steps_before = steps_taken(app)
    stall_s = STALL_TIMEOUT_S + 8
    arm_faults(app, steps=1, stall_s=stall_s)
    try:
        response, waited = timed_request(app, completion_body("A stalled step:", max_tokens=8))
    finally:
        arm_faults(app, steps=0)
    assert response.status_code == 503, response.text
    # the stall timeout ended it, not the worker waking up
    assert f"sent nothing for {STALL_TIMEOUT_S:.0f} s" in response.json()["error"]["message"]
    assert response.headers["Retry-After"]
    assert waited < stall_s + 30  # bounded: the client never waits for the worker to wake up
    # a stalled engine still reports its last (idle) snapshot: wait for the step to end
    deadline = time.monotonic() + stall_s + 60
    while steps_taken(app) == steps_before and time.monotonic() < deadline:
        time.sleep(0.2)
    wait_all_idle(app, timeout_s=60)
    assert post(app, "/v1/completions", completion_body("Awake again:")).status_code == 200
