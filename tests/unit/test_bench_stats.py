"""The step summary that explains an ITL tail (benchmarks/itl_tail.py)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pytest
from cluster.timeline import read_timelines, summarize, write_client

from cluster import bench_serve, timeline
from cluster.bench_serve import (
    parse_engine_queue,
    parse_engine_steps,
    parse_engine_ttft,
    parse_ingress_ttft,
)
from cluster.bench_stats import (
    Measured,
    RequestPlan,
    RequestResult,
    comparisons,
    cpu_shares,
    cpu_times,
    opening_lines,
    paired_difference,
    paired_lines,
    pooled_difference,
    round_lines,
    step_summary,
)
from cluster.metrics import Metrics
from tests.factories.tiny_models import random_prompts
from worker.config import EngineConfig
from worker.engine import Engine, EngineRequest, StepRecord
from worker.outputs import RequestMetrics
from worker.sampling import SamplingParams


def _step(
    ms: float, decodes: int, prompt: int = 0, overlapped: bool = True, launch_ms: float = 0.5
) -> StepRecord:
    return StepRecord(ms / 1e3, decodes, prompt, overlapped, launch_ms / 1e3)


def test_step_summary_splits_steps_by_kind_and_finds_slow_decodes_before_prompt_steps():
    steps = [_step(5.0, 8) for _ in range(20)]
    steps[5] = _step(12.0, 8)  # a decode step whose call also launched the prompt step after it
    steps[6] = _step(9.0, 8, prompt=128, launch_ms=6.0)
    steps[12] = _step(15.0, 8, prompt=600)
    s = step_summary(steps)
    assert s["steps"] == 20
    assert s["decode_only"]["steps"] == 18 and s["decode_only"]["over_2x_decode_p50"] == 1
    # 15 > 10, 9 is not
    assert s["with_prompt"]["steps"] == 2 and s["with_prompt"]["over_2x_decode_p50"] == 1
    assert set(s["with_prompt_by_tokens"]) == {"65-256", "513-1024"}
    assert s["with_prompt_by_tokens"]["513-1024"]["p50"] == 15.0
    slow = s["slow_decode_only"]
    assert slow["steps"] == 1 and slow["overlapped"] == 1
    assert slow["before_prompt_step"] == 1 and slow["after_prompt_step"] == 0
    assert slow["next_launch_ms"]["p50"] == 6.0


def test_engine_step_log_records_each_steps_launch_time(tiny_model):
    path, _ = tiny_model("llama")
    engine = Engine(
        EngineConfig(
            model=str(path),
            device="cpu",
            max_seq_len=64,
            max_running=4,
            num_pages=64,
            advanced={"page_size": 4},
        )
    )
    engine.step_log = []
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    stream = engine.submit(
        [EngineRequest(f"r{i}", p, sp) for i, p in enumerate(random_prompts([9, 14]))]
    )
    start = time.perf_counter()
    while not stream.finished:
        engine.step()
    wall = time.perf_counter() - start
    assert len(engine.step_log) == 6 and engine.step_log[0].num_prompt_tokens == 23
    stats = engine.stats()  # the counters /metrics exports (kvray:engine_steps, _step_seconds)
    assert stats.num_steps == 6
    assert sum(s.seconds for s in engine.step_log) <= stats.step_seconds_total <= wall
    # on CPU nothing overlaps: each step is launched and read in one call
    assert all(not s.overlapped and 0 < s.launch_seconds <= s.seconds for s in engine.step_log)
    assert all(0 < s.schedule_seconds < s.seconds for s in engine.step_log)
    summary = step_summary(engine.step_log)
    assert summary["with_prompt"]["steps"] == 1 and summary["decode_only"]["launch_ms"]["p50"] > 0


def test_the_mean_engine_step_is_read_back_from_metrics_over_every_replica():
    replicas = [
        {"replica_id": "w-1", "num_steps": 100, "step_seconds_total": 8.0},
        {"replica_id": "w-2", "num_steps": 50, "step_seconds_total": 4.5},
    ]
    text = Metrics("demo", "ing-1").render(replicas).decode()
    assert parse_engine_steps(text) == (12.5, 150)
    assert parse_engine_steps(Metrics("demo", "ing-1").render([]).decode()) is None


def test_the_ingress_and_engine_time_to_first_token_and_queue_time_are_read_back_from_metrics():
    metrics = Metrics("demo", "ing-1")
    assert parse_engine_ttft(metrics.render([]).decode()) is None
    for ttft in (0.25, 0.5, 0.75):
        metrics.observe_engine(
            RequestMetrics(
                queue_time=0.1,
                time_to_first_token=ttft,
                time_per_output_token=0.05,
                e2e_latency=2.0,
            )
        )
    assert parse_engine_ttft(metrics.render([]).decode()) == (1.5, 3)
    assert parse_engine_queue(metrics.render([]).decode()) == (pytest.approx(0.3), 3)
    # nothing through the ingress yet
    assert parse_ingress_ttft(metrics.render([]).decode()) is None
    metrics.observe_choice(0.52, 0.05, 2.1, 16)
    metrics.observe_choice(0.78, None, 2.3, 1)
    assert parse_ingress_ttft(metrics.render([]).decode()) == (pytest.approx(1.3), 2)


def test_the_path_timeline_joins_each_requests_points_across_processes(tmp_path) -> None:
    ingress = [
        "arrived 1.000",
        "dispatched 1.001",
        "routed 1.002",
        "sent 1.003",
        "first_read 1.207",
        "first_sent 1.208",
        "engine_ttft 0.2",
        "engine_queue 0.03",
    ]
    worker = ["received 1.004", "queued 1.005", "first_written 1.2062"]
    for pid, lines in (("100", ingress), ("200", worker)):
        (tmp_path / f"{pid}.txt").write_text(
            "".join(f"r-1 {line}\n" for line in lines) + "r-2 arrived 3.0\n"
        )
    timelines = read_timelines(tmp_path)
    assert timelines["r-1"]["published"] == pytest.approx(1.205)  # queued + the engine's TTFT
    summary = summarize(timelines)
    assert (summary["requests"], summary["complete"]) == (2, 1)  # r-2 passed one point only
    hops = {(h["from"], h["to"]): h["p50"] for h in summary["hops"]}
    assert hops[("queued", "published")] == pytest.approx(200.0)
    assert hops[("published", "first_written")] == pytest.approx(1.2)
    assert summary["to_engine"]["mean"] == pytest.approx(5.0)
    assert summary["from_engine"]["mean"] == pytest.approx(3.0)
    assert summary["ingress_path"]["p50"] == pytest.approx(8.0)
    # queued -> its first step scheduled
    assert summary["engine_queue"]["p50"] == pytest.approx(30.0)


def test_a_clients_times_join_the_timeline_and_give_each_requests_whole_serve_path(
    tmp_path,
) -> None:
    ingress = [
        "arrived 1.000",
        "dispatched 1.001",
        "routed 1.002",
        "sent 1.003",
        "first_read 1.207",
        "first_sent 1.208",
        "engine_ttft 0.2",
    ]
    worker = ["received 1.004", "queued 1.005", "first_written 1.2062"]
    for pid, lines in (("100", ingress), ("200", worker)):
        (tmp_path / f"{pid}.txt").write_text(
            "".join(f"cmpl-a-0-0 {line}\n" for line in lines) + "warm-0-0 arrived 0.5\n"
        )
    write_client(tmp_path, [("cmpl-a-0-0", 0.998, 1.2115)])  # 2 ms to the ingress, 3.5 ms back
    summary = summarize(read_timelines(tmp_path))
    assert (summary["requests"], summary["complete"]) == (2, 1)  # the warm-up has no client times
    hops = {(h["from"], h["to"]): h["p50"] for h in summary["hops"]}
    assert hops[("client_sent", "arrived")] == pytest.approx(2.0)
    assert hops[("first_sent", "client_first")] == pytest.approx(3.5)
    assert summary["ingress_path"]["p50"] == pytest.approx(8.0)
    assert summary["http_front"]["p50"] == pytest.approx(5.5)
    # the client's TTFT (213.5 ms) less the engine's (200 ms): the front and the ingress's part
    assert summary["path"]["p50"] == pytest.approx(13.5)


def test_a_timeline_directory_no_one_made_yet_is_made_by_whoever_writes_first(
    tmp_path, monkeypatch
) -> None:
    """`KVRAY_TIMELINE_DIR=/new/dir kvray bench serve`: the replicas and the client make it
    (before, a replica's flusher thread died on the missing directory and kept every row in
    memory, and the client's write failed the benchmark at its end)."""
    directory = tmp_path / "new" / "run"
    monkeypatch.setattr(timeline, "_rows", [])
    timeline.configure(str(directory))
    try:
        timeline.mark("cmpl-a-0-0", "arrived", 1.0)
        timeline.flush()
    finally:
        timeline.configure(None)
    write_client(tmp_path / "other", [("cmpl-a-0-0", 0.998, 1.2)])
    assert read_timelines(directory) == {"cmpl-a-0-0": {"arrived": 1.0}}
    assert read_timelines(tmp_path / "other")["cmpl-a-0-0"]["client_first"] == 1.2


def test_the_report_splits_what_serve_adds_into_the_app_standing_by_and_the_requests_way() -> None:
    def side(ttft_p50: float, itl_p50: float, itl_p99: float) -> dict:
        return {"ttft_ms": {"p50": ttft_p50}, "itl_ms": {"p50": itl_p50, "p99": itl_p99}}

    serve = side(400.0, 90.0, 171.0) | {"path_ms": {"mean": 6.9, "p50": 6.0, "p90": 11.6}}
    summaries = {
        "serve": serve,
        "in-process, app idle": side(390.0, 85.0, 153.0),
        "in-process engine": side(360.0, 80.0, 136.0),
    }
    lines = comparisons(summaries)
    assert "serve - engine: TTFT p50 +40.00 ms, ITL p50 +10.00 ms" in lines
    assert any(
        line.startswith(" Ray and Serve standing by")
        and line.endswith("TTFT p50 +30.00 ms, ITL p50 +5.00 ms")
        for line in lines
    )
    assert any(
        line.startswith(" requests through Serve")
        and line.endswith("TTFT p50 +10.00 ms, ITL p50 +5.00 ms")
        for line in lines
    )
    assert "p50 6.00 ms, p90 11.60 ms" in lines[-2]
    assert lines[-1] == "ITL p99 / p50: serve 1.90, engine beside the idle app 1.80, engine 1.70"
    # the usual pair: no split; the Serve side alone: nothing to compare
    two = comparisons({"serve": serve, "in-process engine": summaries["in-process engine"]})
    assert (
        not any("standing by" in line for line in two)
        and two[-1] == "ITL p99 / p50: serve 1.90, engine 1.70"
    )
    assert comparisons({"serve": serve}) == []


def test_each_side_reports_how_busy_the_machine_was_and_how_much_the_host_stole() -> None:
    before = [1000, 10, 200, 5000, 5, 0, 3, 40]
    after = [1600, 110, 300, 5150, 5, 0, 13, 80]  # 1000 jiffies: 810 busy, 150 idle, 40 stolen
    shares = cpu_shares(before, after)
    assert shares["cpu_busy_pct"] == pytest.approx(81.0)
    assert shares["cpu_steal_pct"] == pytest.approx(4.0)
    assert cpu_shares(None, after) == {} and cpu_shares(after, after) == {}
    now = cpu_times()
    assert now is None or (len(now) == 8 and all(x >= 0 for x in now))


def _result(ttft_s: float, tokens: int = 4) -> RequestResult:
    return RequestResult(
        prompt_tokens=8,
        output_tokens=tokens,
        ttft=ttft_s,
        itls=[0.01] * (tokens - 1),
        e2e=ttft_s + 0.03,
    )


def test_a_sides_rounds_pool_into_one_summary() -> None:
    first = Measured(
        [_result(0.1), _result(0.3)],
        2.0,
        [100, 0, 0, 100, 0, 0, 0, 0],
        {"engine_step_ms": (0.5, 10)},
    )
    second = Measured(
        [_result(0.2)],
        1.0,
        [50, 0, 0, 0, 0, 0, 0, 50],
        {"engine_step_ms": (0.7, 10)},
        extra={"steps": "last"},
    )
    pooled = (first + second).summary()
    assert pooled["completed"] == 3 and pooled["duration_s"] == 3.0
    assert pooled["ttft_ms"]["p50"] == pytest.approx(200.0)  # over every round's requests
    assert pooled["output_throughput"] == pytest.approx(12 / 3.0)
    assert pooled["engine_step_ms"] == pytest.approx(60.0)  # 1.2 s over 20 steps
    assert pooled["cpu_busy_pct"] == pytest.approx(50.0) and pooled[
        "cpu_steal_pct"
    ] == pytest.approx(16.67, abs=0.01)
    assert pooled["steps"] == "last" and "outcomes" not in pooled
    with_plans = Measured([_result(0.1)], 1.0, plans=[RequestPlan()]) + Measured(
        [_result(0.1)], 1.0, plans=[RequestPlan()]
    )
    assert with_plans.summary()["outcomes"]["completed"] == 2


def test_the_report_lists_each_rounds_difference_and_their_median() -> None:
    def side(ttft_p50: float) -> dict:
        return {"ttft_ms": {"p50": ttft_p50}}

    rounds = [
        {
            "serve": side(310.0),
            "in-process, app idle": side(300.0),
            "in-process engine": side(296.0),
        },
        {
            "serve": side(290.0),
            "in-process, app idle": side(295.0),
            "in-process engine": side(280.0),
        },
        {
            "serve": side(330.0),
            "in-process, app idle": side(320.0),
            "in-process engine": side(329.0),
        },
    ]
    lines = round_lines(rounds)
    assert lines[0] == "serve - engine, TTFT p50 by round (ms): +14.0, +10.0, +1.0; median +10.0"
    assert lines[1] == " standing by, TTFT p50 by round (ms): +4.0, +15.0, -9.0; median +4.0"
    assert lines[2] == " through Serve, TTFT p50 by round (ms): +10.0, -5.0, +10.0; median +10.0"
    assert round_lines(rounds[:1]) == []  # one round: the pooled comparison says it all


def test_rounds_cut_the_load_and_take_turns_between_the_sides(
    monkeypatch, tmp_path, capsys
) -> None:
    calls: list[tuple[str, int, float]] = []

    async def fake_http(
        base_url, api_key, model, samples, plans, arrivals, args, warm_up=True
    ) -> Measured:
        calls.append(("serve", len(samples), float(arrivals[0])))
        return Measured([_result(0.2) for _ in samples], 1.0, plans=list(plans))

    async def fake_engine(
        engine_config, samples, arrivals, concurrency, cpu_threads=None, step_log=False
    ) -> Measured:
        calls.append(("engine", len(samples), float(arrivals[0])))
        return Measured([_result(0.1) for _ in samples], 1.0, sums={"engine_step_ms": (0.1, 2)})

    monkeypatch.setattr(bench_serve, "http_load", fake_http)
    monkeypatch.setattr(bench_serve, "_engine_load", fake_engine)
    monkeypatch.setattr(bench_serve, "_vocab_size", lambda model: 49152)
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    out = tmp_path / "result.json"
    argv = [
        "--base-url",
        "http://127.0.0.1:9",
        "--num-prompts",
        "10",
        "--request-rate",
        "5",
        "--rounds",
        "3",
    ]
    assert bench_serve.run(parser.parse_args([*argv, "--result-json", str(out)])) == 0
    # ABBA...: the engine goes first in every other round; 10 prompts in parts of 3, 4, 3,
    # each part's arrivals counted from its own first
    assert [(side, n) for side, n, _ in calls] == [
        ("serve", 3),
        ("engine", 3),
        ("engine", 4),
        ("serve", 4),
        ("serve", 3),
        ("engine", 3),
    ]
    assert all(at == 0.0 for _, _, at in calls)
    data = json.loads(out.read_text())
    serve_label, engine_label = list(data["results"])
    assert (
        data["results"][serve_label]["completed"] == 10
        and data["results"][serve_label]["outcomes"]["requests"] == 10
    )
    assert data["results"][engine_label]["engine_step_ms"] == pytest.approx(50.0)
    assert len(data["rounds"]) == 3 and data["rounds"][1][engine_label]["completed"] == 4
    assert (
        "serve - engine, TTFT p50 by round (ms): +100.0, +100.0, +100.0; median +100.0"
        in capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        bench_serve.run(parser.parse_args([*argv[:-1], "11"]))  # more rounds than prompts


def test_the_difference_paired_by_request_ignores_what_the_prompts_lengths_spread() -> None:
    # first tokens spread over 100-400 ms by prompt length; Serve adds 4 ms to each
    engine = [100.0 + 300.0 * i / 39 for i in range(40)]
    serve: list[float | None] = [t + 4.0 for t in engine]
    serve[3] = None  # a request Serve did not complete drops out of the pairs
    d = paired_difference(serve, engine)
    assert d is not None and d["pairs"] == 39
    assert (
        d["median"] == pytest.approx(4.0)
        and d["low"] == pytest.approx(4.0)
        and d["high"] == pytest.approx(4.0)
    )
    assert paired_difference(serve[:6], engine[:6]) is None  # too few pairs to say anything

    def side(ttfts: list) -> dict:
        return {"ttft_per_request_ms": ttfts}

    lines = paired_lines({"serve": side(serve), "in-process engine": side(engine)})
    assert lines == [
        "serve - engine, TTFT paired by request: median +4.0 ms (95 % interval +4.0 to +4.0, 39 pairs)"
    ]
    three = paired_lines(
        {
            "serve": side(serve),
            "in-process, app idle": side([t + 1.0 for t in engine]),
            "in-process engine": side(engine),
        }
    )
    assert [line.split(",")[0] for line in three] == [
        "serve - engine",
        " standing by",
        " through Serve",
    ]
    assert "median +1.0 ms" in three[1] and "median +3.0 ms" in three[2]
    assert Measured([_result(0.25)], 1.0).summary()["ttft_per_request_ms"] == [250.0]


def test_the_rounds_opening_bursts_are_paired_apart_from_the_steady_load() -> None:
    # each round: 4 requests that open it (Serve +50 ms each), then 6 of the steady load (+5 ms)
    def round_(serve_extra: list[float]) -> dict:
        engine = [200.0 + 10.0 * i for i in range(10)]
        serve = [t + extra for t, extra in zip(engine, serve_extra, strict=True)]
        return {
            "serve": {"ttft_per_request_ms": serve},
            "in-process engine": {"ttft_per_request_ms": engine},
        }

    rounds = [round_([50.0] * 4 + [5.0] * 6) for _ in range(3)]
    assert opening_lines(rounds, 4) == [
        "serve - engine, TTFT paired: each round's first 4 median +50.0 ms (12 pairs), the rest +5.0 ms (18 pairs)"
    ]
    assert opening_lines(rounds[:1], 4) == []  # 4 openers are too few pairs to say anything
    assert (
        opening_lines([{"serve": {"ttft_ms": {}}, "in-process engine": {"ttft_ms": {}}}], 4) == []
    )


def test_bench_serve_takes_only_rates_above_zero(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    assert parser.parse_args(["--request-rate", "inf"]).request_rate == float("inf")
    assert parser.parse_args(["--request-rate", "2.5"]).request_rate == 2.5
    for bad in (["--request-rate", "0"], ["--request-rate", "nan"], ["--burstiness", "-1"]):
        with pytest.raises(SystemExit):  # an argparse error, not a ZeroDivisionError later
            parser.parse_args(bad)
    assert "must be above 0" in capsys.readouterr().err


def test_pooled_difference_over_runs():
    rng = np.random.default_rng(3)
    shifted, noisy = [], []
    for offset, n in ((0.0, 48), (40.0, 30)):  # two VMs: one 40 ms slower, fewer requests
        y = offset + rng.normal(60.0, 5.0, n)
        shifted.append((list(y + 4.0), list(y)))  # x: every request of y, 4 ms later
        noisy.append((list(y + 4.0 + rng.normal(0.0, 2.0, n)), list(y)))
    exact = pooled_difference(shifted, paired=True)
    assert exact["pairs"] == 78
    assert exact["median"] == exact["low"] == exact["high"] == pytest.approx(4.0)
    paired = pooled_difference(noisy, paired=True)
    assert paired["low"] < paired["median"] < paired["high"]
    assert paired["low"] > 3.0 and paired["high"] < 5.0
    between = pooled_difference(noisy, paired=False)
    x_pool = np.concatenate([x for x, _ in noisy])
    y_pool = np.concatenate([y for _, y in noisy])
    assert between["median"] == pytest.approx(np.median(x_pool) - np.median(y_pool))
    assert between["low"] < between["median"] < between["high"]
    # unpaired, each side's own spread shows: a wider interval than the paired one
    assert between["high"] - between["low"] > paired["high"] - paired["low"]
    assert pooled_difference(noisy, paired=False) == between  # the same seed, the same interval
