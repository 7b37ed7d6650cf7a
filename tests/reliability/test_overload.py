"""Past the waiting limit requests get 429 with Retry-After; the accepted ones complete;
once the burst is over the server serves normally again."""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.soak import overload
from tests.cluster.conftest import ENGINE, Served
from tests.reliability.conftest import wait_all_idle

# 2 replicas x (max_running + max_waiting) can be held at once; send twice that
BURST = 4 * (ENGINE["max_running"] + ENGINE["max_waiting"])
# Long enough that the first accepted requests still hold their places when the last of the
# burst arrive: on a loaded 2-core CI machine the burst's arrivals once spread over seconds, and
# with 12 tokens each the queues drained as fast as they filled (40 accepted, none refused).
OUTPUT_LEN = 64


def test_overload_rejects_with_retry_after_and_recovers(app: Served) -> None:
    wait_all_idle(app)
    args = argparse.Namespace(max_concurrency=BURST, request_timeout=300.0, seed=0)
    report = asyncio.run(
        overload(app.base_url, "unused", "demo", BURST, 49152, args, output_len=OUTPUT_LEN)
    )
    burst = report["burst"]
    assert burst["lost"] == 0 and burst["error"] == 0, burst
    assert burst["rejected"] > 0, burst  # a request past the waiting limits got 429
    assert burst["rejected_with_retry_after"] == burst["rejected"], burst
    assert burst["completed"] + burst["rejected"] == BURST
    assert report["recovery"]["completed"] == report["recovery"]["sent"]
    wait_all_idle(app)
