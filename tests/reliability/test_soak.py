"""A scaled-down soak through `kvray bench serve`'s client: a few hundred short requests,
some leaving before the first byte or mid-stream, some cut by stop strings. Afterwards no
request is lost, every worker is idle with every KV page free, and memory did not run away.
The full-size run and its figures: benchmarks/results/soak-cpu-*.json."""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

from benchmarks.serve import http_run
from benchmarks.soak import leak_report, replica_snapshot
from benchmarks.stats import make_plans, make_samples
from tests.cluster.conftest import Served
from tests.reliability.conftest import wait_all_idle

NUM = 160


def soak_args(**extra: object) -> argparse.Namespace:
    return argparse.Namespace(max_concurrency=8, request_timeout=120.0, **extra)


def test_short_soak_with_cancellations_and_stop_strings_leaks_nothing(app: Served) -> None:
    wait_all_idle(app)
    vocab = 49152
    samples = make_samples(NUM, 16, 8, 0.5, 0, vocab, seed=7)
    plans = make_plans(NUM, 0.3, 0.3, [s.output_len for s in samples], ("e", "\n"), seed=7)
    before = replica_snapshot("kvray")
    run = http_run(app.base_url, "unused", "demo", samples, plans, np.zeros(NUM), soak_args())
    outcomes = asyncio.run(run)["outcomes"]
    leaks = leak_report(before, replica_snapshot("kvray"))
    assert outcomes["requests"] == NUM
    assert outcomes["lost"] == 0 and outcomes["error"] == 0, outcomes["errors_seen"]
    # a planned cancellation may come after its request already finished (a stop string)
    assert 0 < outcomes["cancelled"] <= outcomes["planned_cancellations"]
    assert outcomes["stopped"] > 0  # stop strings hit
    assert (
        outcomes["completed"] + outcomes["stopped"] + outcomes["cancelled"] + outcomes["rejected"]
        == NUM
    )
    assert leaks["pages_leaked"] == 0 and leaks["stuck_requests"] == 0, leaks
    assert leaks["replicas_replaced"] == []
    assert leaks["max_rss_growth_pct"] < 25, leaks  # a short run; the full soak holds < 5 %
