"""`kvray bench serve`: its statistics, its report and its rounds (benchmarks/serve.py, stats.py)."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from benchmarks import serve as bench_serve
from benchmarks.offline import step_profile
from benchmarks.serve import (
    parse_engine_queue,
    parse_engine_steps,
    parse_engine_ttft,
    parse_ingress_ttft,
)
from benchmarks.stats import (
    Measured,
    RequestPlan,
    RequestResult,
    comparisons,
    cpu_shares,
    cpu_times,
    opening_lines,
    paired_difference,
    paired_lines,
    parse_goodput,
    round_lines,
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
    # decode step k (from 1) reads each request's prompt and k tokens of output
    contexts = [s.decode_context_tokens for s in engine.step_log]
    assert contexts == [0] + [23 + 2 * k for k in range(1, 6)]
    stats = engine.stats()  # the counters /metrics exports (kvray:engine_steps, _step_seconds)
    assert stats.num_steps == 6
    assert sum(s.seconds for s in engine.step_log) <= stats.step_seconds_total <= wall
    # on CPU nothing overlaps: each step is launched and read in one call
    assert all(not s.overlapped and 0 < s.launch_seconds <= s.seconds for s in engine.step_log)
    assert all(0 < s.schedule_seconds < s.seconds for s in engine.step_log)
    profile = step_profile(engine.step_log)  # what `kvray bench offline` prints from it
    assert sum(row["steps"] for row in profile) == 6
    assert [row["steps"] for row in profile if row["kind"] == "prompt"] == [1]


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


def test_the_report_ends_with_what_serve_adds_over_the_in_process_engine() -> None:
    def side(ttft_p50: float, itl_p50: float, itl_p99: float) -> dict:
        return {"ttft_ms": {"p50": ttft_p50}, "itl_ms": {"p50": itl_p50, "p99": itl_p99}}

    lines = comparisons({"serve": side(400.0, 90.0, 171.0), "engine": side(360.0, 80.0, 136.0)})
    assert lines[1:] == [
        "serve - engine: TTFT p50 +40.00 ms, ITL p50 +10.00 ms",
        "ITL p99 / p50: serve 1.90, engine 1.70",
    ]
    assert comparisons({"serve": side(400.0, 90.0, 171.0)}) == []  # nothing to compare


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
            "in-process engine": side(296.0),
        },
        {
            "serve": side(290.0),
            "in-process engine": side(280.0),
        },
        {
            "serve": side(330.0),
            "in-process engine": side(329.0),
        },
    ]
    lines = round_lines(rounds)
    assert lines[0] == "serve - engine, TTFT p50 by round (ms): +14.0, +10.0, +1.0; median +10.0"
    assert len(lines) == 1
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


def test_goodput_counts_the_requests_per_second_that_met_every_slo() -> None:
    fast = RequestResult(prompt_tokens=8, output_tokens=5, ttft=0.1, e2e=0.3)  # TPOT 50 ms
    slow_first = RequestResult(prompt_tokens=8, output_tokens=5, ttft=0.5, e2e=0.7)
    slow_tokens = RequestResult(prompt_tokens=8, output_tokens=5, ttft=0.1, e2e=0.9)  # 200 ms
    slos = parse_goodput(["ttft:200", "tpot:100"])
    assert slos == {"ttft": pytest.approx(0.2), "tpot": pytest.approx(0.1)}
    summary = Measured([fast, slow_first, slow_tokens], 2.0).summary(slos)
    assert summary["request_goodput"] == pytest.approx(0.5)  # one request of three, over 2 s
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert "request_goodput" not in Measured([fast], 1.0).summary()
    with pytest.raises(SystemExit):
        parse_goodput(["itl:10"])
