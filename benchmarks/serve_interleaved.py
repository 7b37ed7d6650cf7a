"""#4's figure without the machine's drift: every prompt through Serve, into the engine beside
the idle app, and into the same engine alone, one after another.

`kvray bench serve --engine-beside-app` runs its sides one after another, minutes apart, and
a VM's speed moves between them by more than the figure it is after (benchmarks/README.md,
sessions 23-24: on one 16-core VM the engine alone took 58-77 ms a lone prompt within an
hour, and in two runs the engine beside the idle app was 10-13 ms faster than alone). Here one
app stands up once, in a child process (the app of `kvray bench serve`: `local_app`), and each
prompt goes three ways, one at a time, in an order that rotates through all six:
- serve: streamed through the app (HTTP, the ingress, the router, the worker replica);
- beside: into an engine in this process, built as a worker replica builds its own, while
  every process of the app runs, idle;
- alone: into that engine while every process of the app is stopped (SIGSTOP, and SIGCONT
  after the request), the prompt's first token changed so that it finds none of its pages
  cached from the beside way (`other_opening`; the replica's engine sees each prompt once).
This process never starts Ray, so while the app is stopped nothing of Ray runs. Each way
waits `--gap` seconds first (the stopped one with the app already stopped), so the app's
catching up after SIGCONT falls before the next request, and every request finds its engine
equally idle.

Per request it records the client's time to first token and, on the Serve side, the worker's
engine's own (from `/metrics` before and after the request), so the Serve path (client less
engine) is per request too. It prints each way's p50 and the paired medians (95 % bootstrap
intervals): serve - alone (the issue's figure), serve - beside (the requests' own way through
Serve) and beside - alone (Ray and Serve standing by).

    python -m benchmarks.serve_interleaved -c FILE [--num-prompts 48] [--input-len 64]
        [--output-len 16] [--gap 0.5] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import permutations
from typing import Any

from benchmarks import write_result
from benchmarks.serve import (
    _scrape_metrics,
    _vocab_size,
    http_client,
    http_request,
    local_app,
    parse_engine_ttft,
)
from benchmarks.standing_by import processes, stopped
from benchmarks.stats import BenchSample, cpu_shares, cpu_times, make_samples, paired_difference
from cluster.local_ray import _descendants
from worker.heap import frozen_heap

WAYS = ("serve", "beside", "alone")
ORDERS = list(permutations(WAYS))
READY = "serve_interleaved: ready at "


def app_processes(app_pid: int) -> list[int]:
    """Every process of the app: the child's tree, and any of Ray's that left it (a daemon
    re-parented to init), by `standing_by`'s titles."""
    pids = {app_pid, *_descendants(app_pid)}
    for group in processes().values():
        pids.update(group)
    pids.discard(os.getpid())
    return sorted(pids)


@contextmanager
def app_in_child(config_path: str) -> Iterator[tuple[int, str]]:
    """The app of `kvray bench serve`, up in a child process: (its pid, its base URL). The
    child stops the app when its stdin closes."""
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.serve_interleaved", "--app-only", "-c", config_path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        for line in child.stdout:
            if line.startswith(READY):
                url = line[len(READY) :].strip()
                break
            print(line, end="", flush=True)
        else:
            raise SystemExit(f"the app's process ended before it was ready (rc {child.wait()})")
        # its later output, passed on, so that a full pipe never blocks it
        threading.Thread(target=_pass_on, args=(child.stdout,), daemon=True).start()
        yield child.pid, url
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)


def _pass_on(lines: Any) -> None:
    for line in lines:
        print(line, end="", flush=True)


def run_app(config_path: str) -> int:
    """--app-only: the app up until stdin closes."""
    from cluster.app import load_config

    with local_app(load_config(config_path)) as url:
        print(READY + url, flush=True)
        sys.stdin.read()
    return 0


def other_opening(sample: BenchSample) -> BenchSample:
    """The same prompt but its first token: as long, and none of its pages in the prefix
    cache of an engine that has seen `sample` (page keys chain from the first page on)."""
    return BenchSample([sample.prompt[0] + 1, *sample.prompt[1:]], sample.output_len)


class InProcess:
    """An engine built as a worker replica builds its own (its threads, `Engine.launched`)."""

    def __init__(self, config: Any) -> None:
        from cluster.deployment import set_cpu_threads
        from worker.engine import Engine

        set_cpu_threads(config.engine, config.worker_cpu_threads)
        self.engine = Engine.launched(config.engine)
        self.count = 0

    async def request(self, sample: BenchSample) -> dict[str, float | None]:
        from worker.engine import EngineRequest
        from worker.sampling import SamplingParams

        params = SamplingParams(max_tokens=sample.output_len, ignore_eos=True, temperature=0.0)
        self.count += 1
        ttft = engine_ttft = None
        start = time.perf_counter()
        stream = self.engine.submit([EngineRequest(f"i-{self.count}", sample.prompt, params)])
        async for frame in stream:
            if ttft is None:
                ttft = time.perf_counter() - start
            for delta in frame:
                if delta.metrics is not None:
                    engine_ttft = delta.metrics.time_to_first_token
        return {"ttft": ttft, "engine_ttft": engine_ttft, "e2e": time.perf_counter() - start}


async def serve_request(
    client: Any, model: str, sample: BenchSample, gap: float
) -> dict[str, float | None]:
    """One streamed completion through the app, `gap` seconds after its worker's engine's own
    time to first token was read (a /metrics page asks every replica for its figures; the
    request is not to meet that work), and that time for this request (the engine
    histogram's growth over it)."""
    before = parse_engine_ttft(await _scrape_metrics(client))
    await asyncio.sleep(gap)
    result = await http_request(client, model, sample)
    after = parse_engine_ttft(await _scrape_metrics(client))
    engine_ttft = None
    if before is not None and after is not None and after[1] == before[1] + 1:
        engine_ttft = after[0] - before[0]
    if not result.ok:
        raise RuntimeError(f"a request through Serve failed: {result.outcome} {result.error}")
    return {"ttft": result.ttft, "engine_ttft": engine_ttft, "e2e": result.e2e}


async def measure(
    args: argparse.Namespace, config: Any, samples: list[BenchSample], app_pid: int, url: str
) -> dict[str, list[dict[str, float | None]]]:
    engine = InProcess(config)
    key = config.api_keys[0] if config.api_keys else None
    rows: dict[str, list[dict[str, float | None]]] = {way: [] for way in WAYS}
    try:
        async with http_client(url, 1, 600.0, key) as client:

            async def way(name: str, sample: BenchSample) -> dict[str, float | None]:
                if name == "serve":
                    return await serve_request(client, config.model_name, sample, args.gap)
                if name == "beside":
                    await asyncio.sleep(args.gap)
                    return await engine.request(sample)
                with stopped(app_processes(app_pid)):
                    await asyncio.sleep(args.gap)
                    return await engine.request(other_opening(sample))

            warm = [BenchSample(s.prompt[::-1], s.output_len) for s in samples[: args.warmup]]
            for sample in warm:  # reversed prompts: no timed one finds its own cached
                for name in WAYS:
                    await way(name, sample)
            with frozen_heap():  # as a replica's heap is (worker.heap)
                for i, sample in enumerate(samples):
                    for name in ORDERS[i % len(ORDERS)]:
                        rows[name].append(await way(name, sample))
                    if (i + 1) % 8 == 0:
                        print(f"  {i + 1}/{len(samples)} prompts", flush=True)
    finally:
        engine.engine.shutdown()
    return rows


def _ms(values: list[float | None]) -> list[float | None]:
    return [None if v is None else 1000 * v for v in values]


def summarize(rows: dict[str, list[dict[str, float | None]]]) -> dict[str, Any]:
    ttft = {way: _ms([r["ttft"] for r in rows[way]]) for way in WAYS}
    engine = {way: _ms([r["engine_ttft"] for r in rows[way]]) for way in WAYS}
    path = [
        None if t is None or e is None else t - e
        for t, e in zip(ttft["serve"], engine["serve"], strict=True)
    ]

    def p50(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    return {
        "ttft_p50_ms": {way: p50(ttft[way]) for way in WAYS},
        "engine_ttft_p50_ms": {way: p50(engine[way]) for way in WAYS},
        "serve_path_p50_ms": p50(path),
        "paired_ms": {
            "serve - alone": paired_difference(ttft["serve"], ttft["alone"]),
            "serve - beside": paired_difference(ttft["serve"], ttft["beside"]),
            "beside - alone": paired_difference(ttft["beside"], ttft["alone"]),
        },
        "ttft_per_request_ms": ttft,
        "engine_ttft_per_request_ms": engine,
    }


def report(summary: dict[str, Any], cpu: dict[str, float]) -> None:
    p50, engine = summary["ttft_p50_ms"], summary["engine_ttft_p50_ms"]
    print("TTFT p50 (ms), client / engine's own:")
    for way in WAYS:
        print(f"  {way:7s} {p50[way]:8.1f} / {engine[way] or float('nan'):8.1f}")
    print(f"  the Serve path (client - worker engine), p50: {summary['serve_path_p50_ms']:.2f} ms")
    print(f"  serve - alone, p50s: {p50['serve'] - p50['alone']:+.1f} ms")
    for name, d in summary["paired_ms"].items():
        if d is not None:
            print(
                f"  {name}, paired median {d['median']:+.1f} ms "
                f"(95 % {d['low']:+.1f} to {d['high']:+.1f}, {d['pairs']} pairs)"
            )
    if cpu:
        print(f"  machine: {cpu['cpu_busy_pct']:.1f} % busy, {cpu['cpu_steal_pct']:.1f} % stolen")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", required=True, help="the cluster YAML (launched here)")
    parser.add_argument("--app-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="untimed prompts, each way")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds before each request")
    parser.add_argument("--out", help="write the result JSON here")
    args = parser.parse_args(argv)
    if args.app_only:
        return run_app(args.config)
    from cluster.app import load_config

    config = load_config(args.config)
    samples = make_samples(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        0,
        _vocab_size(config.engine.model),
        args.seed,
    )
    with app_in_child(args.config) as (app_pid, url):
        print(f"app up ({len(app_processes(app_pid))} processes); {len(samples)} prompts x 3")
        before = cpu_times()
        rows = asyncio.run(measure(args, config, samples, app_pid, url))
        cpu = cpu_shares(before, cpu_times())
    summary = summarize(rows)
    report(summary, cpu)
    used = config.model_dump(mode="json", exclude={"api_keys"})
    write_result(args.out, args, config=used, cpu=cpu, **summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
