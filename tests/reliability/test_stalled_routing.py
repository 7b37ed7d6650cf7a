"""A worker replica whose engine is stuck in one step gets no new requests: it reports how
long it has held work without finishing a step, and the router ranks it last past
`router.stalled_after_s` (1 s in this app), until it reports progress again."""

from __future__ import annotations

import time

import httpx

from cluster.api import REPLICA_HEADER
from tests.cluster.conftest import Served
from tests.reliability.conftest import arm_fault, arm_faults, completion_body, post, wait_all_idle

STALL_S = 20.0  # the checks below take several seconds on a loaded 2-core machine


def test_a_replica_stuck_in_a_step_gets_no_new_requests(app: Served) -> None:
    stuck, other = sorted(wait_all_idle(app))
    arm_fault(app, stuck, steps=1, stall_s=STALL_S)
    streams: list[httpx.Response] = []
    client = httpx.Client(base_url=app.base_url, timeout=60)
    try:
        # open streams one at a time until one lands on the armed replica (its step stalls)
        body = completion_body("Stuck or not:", max_tokens=4, stream=True)
        for _ in range(8):
            request = client.build_request("POST", "/v1/completions", json=body)
            streams.append(client.send(request, stream=True))
            if streams[-1].headers[REPLICA_HEADER] == stuck:
                break
        assert streams[-1].headers[REPLICA_HEADER] == stuck, "no request reached the armed replica"
        stalled_at = time.monotonic()
        time.sleep(2.5)  # past stalled_after_s, and a routing report later

        # by load alone these would alternate: the stuck replica holds one request, and
        # each stream below adds one to the other
        long_body = completion_body("Busy:", max_tokens=48, ignore_eos=True, stream=True)
        for _ in range(3):
            request = client.build_request("POST", "/v1/completions", json=long_body)
            streams.append(client.send(request, stream=True))
            assert streams[-1].headers[REPLICA_HEADER] == other
        served_by = []
        for i in range(6):
            response = post(
                app, "/v1/completions", completion_body(f"Elsewhere {i}:", 4), timeout=30
            )
            assert response.status_code == 200, response.text
            served_by.append(response.headers[REPLICA_HEADER])
        assert time.monotonic() - stalled_at < STALL_S, "the stall ended before the check did"
        assert served_by == [other] * 6
    finally:
        arm_faults(app, steps=0)
        for stream in streams:
            stream.close()
        client.close()
    wait_all_idle(app, timeout_s=STALL_S + 60)
    assert post(app, "/v1/completions", completion_body("Both again:")).status_code == 200
