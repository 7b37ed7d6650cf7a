"""`kvray bench cluster --scenarios front` end to end at a tiny size on a Ray of its own:
Serve's proxy only (HAProxy's Ray would double the time), 1 demo replica, then 2, each load
beside the client's floor against the SSE stub. The figures are CPU figures of a 135M
model: the test checks the result's shape and what must hold whatever the machine."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from benchmarks import cluster as bench
from tests.cluster.conftest import ENGINE, RayHarness

PROMPTS, REPLICAS = 8, 2
ARGV = [
    "--scenarios", "front",
    "--front-proxies", "serve",
    "--front-model", "demo",
    "--front-replicas", str(REPLICAS),
    "--sat-prompts", str(PROMPTS),
    "--sat-concurrency", str(PROMPTS),
    "--input-len", "16",
    "--output-len", "8",
    "--client-procs", "1",
    "--ray-num-cpus", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def front(ray_harness: RayHarness, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    ray_harness.stop()  # the scenario starts a Ray of its own per proxy
    here = tmp_path_factory.mktemp("front")
    config = {
        "engine": {**ENGINE, "max_waiting": 64},
        "advanced": {"worker_cpu_threads": 1},  # two replicas on two cores
    }
    (here / "cluster.yaml").write_text(yaml.safe_dump(config))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = here / "result.json"
    args = parser.parse_args(["-c", str(here / "cluster.yaml"), *ARGV, "--result-json", str(out)])
    assert bench.run(args) == 0
    yield json.loads(out.read_text())["front"]


def _check(run: dict[str, Any], requests: int) -> None:
    assert (run["completed"], run["failed"], run["outcomes"]["lost"]) == (requests, 0, 0), run
    for key in ("output_throughput", "request_throughput"):
        assert math.isfinite(run[key]) and run[key] > 0, (key, run[key])


def test_each_load_and_its_client_floor_answer_every_request(front: dict[str, Any]) -> None:
    assert list(front) == ["serve"]
    entry = front["serve"]
    assert entry["http_proxy"] == "serve"
    assert (entry["reference"]["replicas"], entry["front"]["replicas"]) == (1, REPLICAS)
    for key, requests in (("reference", PROMPTS), ("front", PROMPTS * REPLICAS)):
        run, floor = entry[key], entry["client_floor"][key]
        _check(run, requests)
        _check(floor, requests)
        # the stub sent the run's SSE chunks per token, and as many tokens
        assert floor["stub_chunks_per_token"] == run["sse_chunks_per_token"] > 0
        tokens = run["output_throughput"] * run["duration_s"]
        assert floor["output_throughput"] * floor["duration_s"] == pytest.approx(tokens)


def test_the_ratios_are_the_front_over_the_reference(front: dict[str, Any]) -> None:
    entry = front["serve"]
    ref, many = entry["reference"], entry["front"]
    assert entry["ratio_tok_s"] == pytest.approx(
        many["output_throughput"] / ref["output_throughput"]
    )
    assert entry["ratio_req_s"] == pytest.approx(
        many["request_throughput"] / ref["request_throughput"]
    )
    assert all(math.isfinite(entry[k]) and entry[k] > 0 for k in ("ratio_tok_s", "ratio_req_s"))
