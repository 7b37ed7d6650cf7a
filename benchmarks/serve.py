"""`kvray bench serve`: online serving benchmark, the method of `vllm bench serve`.

A synthetic dataset (random prompt and output lengths; optionally every prompt opens with
one shared prefix) is sent to `/v1/completions` as token-id prompts with `ignore_eos`, so
every request has exactly the planned lengths. Arrivals follow a Poisson process at
`--request-rate` (gamma with `--burstiness`), at most `--max-concurrency` in flight. The
run prints throughput and TTFT / TPOT / ITL / E2E mean, p50, p99.

The same requests, on the same arrival schedule, then go straight into an in-process
Engine built from the same EngineConfig. The difference between the two runs is what the
ingress, the router and Serve add. `--goodput ttft:MS tpot:MS e2e:MS` also counts the
requests per second that met every SLO; `--rounds N` alternates the two sides (ABBA) on
fresh apps so the machine's drift falls on both.

Reliability options: `--cancel-fraction` makes some clients leave early (before the first
byte or after a few chunks) and `--stop-fraction` gives some requests stop strings; every
request ends in one outcome (completed, stopped, cancelled, rejected, error, lost), where
"lost" means it neither completed nor got an error and must stay 0 (`kvray bench soak`
adds leak checks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.common import write_result
from benchmarks.stats import (
    BenchSample,
    Measured,
    RequestPlan,
    RequestResult,
    cpu_times,
    make_arrivals,
    make_plans,
    make_samples,
    opening_lines,
    paired_lines,
    parse_goodput,
    print_report,
    round_lines,
)
from worker.heap import frozen_heap

NO_PLAN = RequestPlan()
REPLICA_HEADER = "x-kvray-replica"  # cluster/api.py's (not imported: the client stays off Ray)


@dataclass(frozen=True)
class Load:
    """A run's server config and its requests: samples, their plans and arrival times."""

    config: Any
    vocab: int
    samples: list[BenchSample]
    plans: list[RequestPlan]
    arrivals: np.ndarray


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        help="ClusterConfig YAML of the server to launch (default: the demo model)",
    )
    parser.add_argument("--model", help="model directory or 'demo' (overrides the config)")
    parser.add_argument("--base-url", help="benchmark this running server instead of launching one")
    parser.add_argument("--api-key", default="unused", help="bearer token for --base-url")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    parser.add_argument(
        "--range-ratio", type=float, default=0.5, help="lengths drawn from mean x [1-r, 1+r]"
    )
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="shared-prefix variant: tokens every prompt starts with",
    )
    parser.add_argument(
        "--request-rate", type=_positive, default=float("inf"), help="requests/s; inf = all at once"
    )
    parser.add_argument(
        "--burstiness", type=_positive, default=1.0, help="1 = Poisson; <1 burstier, >1 steadier"
    )
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="draws the prompts: a second run with the same seed against one --base-url server "
        "hits the prefix cache the first filled",
    )
    parser.add_argument(
        "--skip-engine", action="store_true", help="do not run the in-process engine baseline"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="cut the prompts into this many rounds and run the sides round by round, in turns "
        "(ABBA: the app first, then the engine first, ...), each round on a freshly launched app, "
        "so the machine's drift during the run falls on both sides alike",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs in ms (ttft, tpot, e2e), e.g. ttft:200 tpot:50: goodput counts the requests "
        "per second that met every one",
    )
    parser.add_argument("--result-json", help="write the summaries to this file")
    parser.add_argument(
        "--cancel-fraction", type=float, default=0.0, help="share of clients that leave early"
    )
    parser.add_argument(
        "--stop-fraction", type=float, default=0.0, help="share of requests with stop strings"
    )
    parser.add_argument(
        "--stop", nargs="+", default=["e", "\n"], help="the stop strings of those requests"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="a request still open then is lost"
    )


ALONE = "in-process engine"  # the same load, no app (with --base-url: beside that server)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:  # 0 and nan: no gaps to draw
        raise argparse.ArgumentTypeError(f"must be above 0 (inf: all at once), not {text}")
    return value


def prepare(args: argparse.Namespace) -> Load:
    """The config of the server and the load the arguments describe."""
    from cluster.app import load_config

    config = load_config(args.config)
    if args.model:
        config = config.model_copy(
            update={"engine": config.engine.model_copy(update={"model": args.model})}
        )
    vocab = _vocab_size(config.engine.model)
    samples = make_samples(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.prefix_len,
        vocab,
        args.seed,
    )
    arrivals = make_arrivals(args.num_prompts, args.request_rate, args.burstiness, args.seed)
    return Load(config, vocab, samples, request_plans(args, samples), arrivals)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.rounds <= args.num_prompts:
        raise SystemExit("--rounds: 1 to --num-prompts")
    load = prepare(args)
    config, samples, plans, arrivals = load.config, load.samples, load.plans, load.arrivals
    label = f"serve ({config.worker_replicas} worker replica(s), batch window {config.advanced.router.batch_window_ms} ms)"
    sides: dict[str, Measured] = {}
    rounds: list[dict[str, dict[str, Any]]] = []
    goodput = parse_goodput(args.goodput)
    for number, part in enumerate(_rounds(samples, plans, arrivals, args.rounds)):
        measured = _round(config, args, label, *part, engine_first=number % 2 == 1)
        order = [name for name in (label, ALONE) if name in measured]  # as the report lists them
        rounds.append({name: measured[name].summary(goodput) for name in order})
        for name in order:
            sides[name] = sides[name] + measured[name] if name in sides else measured[name]
    summaries = {name: sides[name].summary(goodput) for name in order}
    print_report(summaries, vars(args))
    closed_loop = args.request_rate == float("inf")  # every round opens with a burst
    opening = opening_lines(rounds, args.max_concurrency) if closed_loop else []
    for line in paired_lines(summaries) + opening + round_lines(rounds):
        print(line)
    # the cluster config the run used (its file may be gone later), without the API keys
    used = config.model_dump(mode="json", exclude={"api_keys"})
    data: dict[str, Any] = {"args": vars(args), "config": used, "results": summaries}
    if len(rounds) > 1:
        data["rounds"] = rounds
    write_result(args.result_json, "serve", data)
    return 0


def _rounds(
    samples: list[BenchSample], plans: list[RequestPlan], arrivals: np.ndarray, count: int
) -> Iterator[tuple[list[BenchSample], list[RequestPlan], np.ndarray]]:
    """The load cut into `count` consecutive parts, each part's arrivals from its own start."""
    bounds = np.linspace(0, len(samples), count + 1).round().astype(int)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        yield samples[lo:hi], plans[lo:hi], arrivals[lo:hi] - arrivals[lo]


def _round(
    config: Any,
    args: argparse.Namespace,
    label: str,
    samples: list[BenchSample],
    plans: list[RequestPlan],
    arrivals: np.ndarray,
    engine_first: bool,
) -> dict[str, Measured]:
    """One round of the comparison: the load through Serve (on a freshly launched app, or
    `--base-url`'s server) and the in-process engine alone, before the app when
    `engine_first`."""
    measured: dict[str, Measured] = {}

    def alone() -> None:
        if not args.skip_engine:
            measured[ALONE] = asyncio.run(
                _engine_load(
                    config.engine,
                    samples,
                    arrivals,
                    args.max_concurrency,
                    config.advanced.worker_cpu_threads,
                )
            )

    if engine_first:
        alone()
    if args.base_url:
        measured[label] = asyncio.run(
            http_load(
                args.base_url, args.api_key, config.model_name, samples, plans, arrivals, args
            )
        )
    else:
        with local_app(config) as base_url:
            key = config.api_keys[0] if config.api_keys else "unused"
            measured[label] = asyncio.run(
                http_load(base_url, key, config.model_name, samples, plans, arrivals, args)
            )
    if not engine_first:
        alone()
    return measured


def request_plans(args: argparse.Namespace, samples: list[BenchSample]) -> list[RequestPlan]:
    return make_plans(
        len(samples),
        args.cancel_fraction,
        args.stop_fraction,
        [s.output_len for s in samples],
        tuple(args.stop),
        args.seed,
    )


def _vocab_size(model: str) -> int:
    from worker.model.demo import resolve_model_path
    from worker.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model_path(model)).vocab_size


# -- the server ----------------------------------------------------------------------------------


@contextlib.contextmanager
def local_app(config: Any) -> Iterator[str]:
    """Start local Ray and the app; yield its base URL; stop everything again."""
    import ray
    from ray import serve

    from cluster.app import build_app, cluster_runtime_env, resolve_http_proxy, set_serve_env
    from cluster.local_ray import set_own_ray_env

    set_serve_env()
    set_own_ray_env()  # as `kvray serve` does
    config = resolve_http_proxy(config, own_ray=True)
    # "local": a fresh Ray instance, never another process's cluster on this machine
    ray.init(
        address="local",
        runtime_env=cluster_runtime_env(config),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(
            build_app(config),
            name=config.advanced.app_name,
            route_prefix=config.advanced.route_prefix,
        )
        yield f"http://{config.host}:{config.port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def http_client(
    base_url: str, concurrency: int, timeout_s: float, api_key: str | None = None
) -> Any:
    """The load generator's HTTP session (aiohttp, which Ray Serve brings).

    Not httpx: its connection pool's CPU per request grows with the connections open, and at
    saturation an httpx client capped the whole benchmark (docs/performance.md)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else None
    return aiohttp.ClientSession(
        base_url,
        headers=headers,
        connector=aiohttp.TCPConnector(limit=concurrency + 4),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def http_run(
    base_url: str,
    api_key: str,
    model: str,
    samples: list[BenchSample],
    plans: list[RequestPlan],
    arrivals: np.ndarray,
    args: argparse.Namespace,
    warm_up: bool = True,
) -> dict[str, Any]:
    """Send every sample with its plan over HTTP; the latency summary and the outcomes."""
    measured = await http_load(base_url, api_key, model, samples, plans, arrivals, args, warm_up)
    return measured.summary()


async def http_load(
    base_url: str,
    api_key: str,
    model: str,
    samples: list[BenchSample],
    plans: list[RequestPlan],
    arrivals: np.ndarray,
    args: argparse.Namespace,
    warm_up: bool = True,
) -> Measured:
    """`http_run`'s load, not yet summarized."""
    concurrency = args.max_concurrency
    plan_of = {id(s): p for s, p in zip(samples, plans, strict=True)}
    async with http_client(base_url, concurrency, args.request_timeout, api_key) as client:

        async def one(sample: BenchSample) -> RequestResult:
            plan = plan_of.get(id(sample), NO_PLAN)
            return await http_request(client, model, sample, plan, args.request_timeout)

        if warm_up:
            await asyncio.gather(
                *(http_request(client, model, s) for s in warm_up_samples(samples))
            )
        before = await _scrape_metrics(client)
        measured = await drive(samples, arrivals, concurrency, one)
        after = await _scrape_metrics(client)
    measured.plans = list(plans)
    parsers = (
        ("engine_step_ms", parse_engine_steps),
        ("ingress_ttft_mean_ms", parse_ingress_ttft),
        ("engine_ttft_mean_ms", parse_engine_ttft),
        ("engine_queue_mean_ms", parse_engine_queue),
    )
    for key, parse in parsers:
        if (
            (first := parse(before)) is not None
            and (last := parse(after)) is not None
            and last[1] > first[1]
        ):
            measured.sums[key] = (last[0] - first[0], last[1] - first[1])
    return measured


def warm_up_samples(samples: list[BenchSample]) -> list[BenchSample]:
    """Two requests before the timed load, to warm the server (or engine) up: the first two
    samples with their prompts reversed, so no timed request finds its prompt cached."""
    return [BenchSample(s.prompt[::-1], s.output_len) for s in samples[:2]]


def _sum_series(text: str, seconds_name: str, count_name: str) -> tuple[float, int] | None:
    """(seconds, count) of two series summed over every label set (replica) in a
    /metrics page; None when the page has neither."""
    seconds, count, seen = 0.0, 0, False
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.split("{", 1)[0].split(" ", 1)[0], float(line.rsplit(" ", 1)[1])
        if name == seconds_name:
            seconds, seen = seconds + value, True
        elif name == count_name:
            count, seen = count + int(value), True
    return (seconds, count) if seen else None


def parse_engine_steps(text: str) -> tuple[float, int] | None:
    """(step seconds, steps) summed over the worker replicas in a /metrics page; None when
    the server exports neither counter."""
    return _sum_series(text, "kvray:engine_step_seconds_total", "kvray:engine_steps_total")


def parse_ingress_ttft(text: str) -> tuple[float, int] | None:
    """(seconds, requests) of the ingress's time to first token (from the request's arrival
    at the ingress until its first token is written), as `parse_engine_ttft`: the client's
    TTFT less this is the HTTP front (proxy both ways), this less the engine's is the way
    ingress -> worker and the first frame's way back."""
    name = "kvray:time_to_first_token_seconds"
    return _sum_series(text, f"{name}_sum", f"{name}_count")


def parse_engine_ttft(text: str) -> tuple[float, int] | None:
    """(seconds, requests) of the engines' own time to first token (from a request's arrival
    at its engine), as the ingress replica that served the /metrics page observed them."""
    name = "kvray:engine_time_to_first_token_seconds"
    return _sum_series(text, f"{name}_sum", f"{name}_count")


def parse_engine_queue(text: str) -> tuple[float, int] | None:
    """(seconds, requests) of the engines' queue time (arrival at the engine until its first
    step is queued), as `parse_engine_ttft`."""
    name = "kvray:request_queue_time_seconds"
    return _sum_series(text, f"{name}_sum", f"{name}_count")


async def _scrape_metrics(client: Any) -> str:
    """The /metrics page, or "" without one. Its engine step counters give the mean engine
    step under Serve next to the in-process engine's, so a slower engine (the host shared
    with Serve's processes) and the request's path can be told apart; the engines' own time
    to first token does the same for the first token."""
    try:
        async with client.get("/metrics") as response:
            return await response.text() if response.status == 200 else ""
    except Exception:  # an older server, or none: the figures are left out
        return ""


async def http_request(
    client: Any,
    model: str,
    sample: BenchSample,
    plan: RequestPlan = NO_PLAN,
    timeout_s: float = 600.0,
) -> RequestResult:
    """One streaming completion that follows `plan`; its timings and outcome. `client`: an
    `http_client` session."""
    import aiohttp

    body: dict[str, Any] = {
        "model": model,
        "prompt": sample.prompt,
        "max_tokens": sample.output_len,
        "ignore_eos": True,  # so "stop" can only mean a stop string hit
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if plan.stop:
        body["stop"] = list(plan.stop)
    result = RequestResult(prompt_tokens=len(sample.prompt))
    start = result.sent_at = time.perf_counter()
    leave = plan.leave_after_s is not None
    try:
        async with asyncio.timeout(plan.leave_after_s if leave else timeout_s):
            await _stream(client, body, plan, result, start)
    except TimeoutError:
        if leave:
            result.outcome = "cancelled"  # left before the first byte
        else:
            result.outcome, result.error = "lost", f"no answer within {timeout_s:.0f} s"
    except aiohttp.ClientError as exc:
        result.outcome, result.error = "lost", f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    return result


async def _stream(
    client: Any, body: dict[str, Any], plan: RequestPlan, result: RequestResult, start: float
) -> None:
    # Leaving the block early (cancel, timeout) closes the connection: the server sees a disconnect.
    async with client.post("/v1/completions", json=body) as response:
        if plan.leave_after_s is not None:
            result.outcome = "cancelled"  # the headers beat the client's leaving: leave now
            response.close()
            return
        if response.status != 200:
            result.status = response.status
            result.retry_after = response.headers.get("retry-after")
            result.outcome = "rejected" if response.status == 429 else "error"
            result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return
        result.replica = response.headers.get(REPLICA_HEADER)
        await _read_events(response, plan, result, start)


async def _read_events(
    response: Any, plan: RequestPlan, result: RequestResult, start: float
) -> None:
    last, chunks, done = start, 0, False
    finish: str | None = None
    async for raw in response.content:  # one SSE line at a time
        line = raw.decode().rstrip("\r\n")
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            result.outcome, result.error = "error", chunk["error"]["message"]
        elif chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]
        elif chunk.get("choices"):
            now = time.perf_counter()
            if result.ttft is None:
                result.ttft = now - start
                result.response_id = chunk.get("id")
            else:
                result.itls.append(now - last)
            last, chunks = now, chunks + 1
            finish = chunk["choices"][0].get("finish_reason") or finish
            if plan.cancel_after_chunks is not None and chunks >= plan.cancel_after_chunks:
                result.outcome = "cancelled"
                response.close()  # drop the connection, not just this read
                return
    if result.outcome == "error":
        return
    if not done or finish is None:
        missing = " and ".join(
            m for m, ok in (("a finish_reason", finish), ("[DONE]", done)) if not ok
        )
        result.outcome = "lost"
        result.error = f"the stream ended after {chunks} chunks without {missing}"
    else:
        result.outcome = "stopped" if finish == "stop" else "completed"


# -- the in-process engine -------------------------------------------------------------------


async def engine_run(
    engine_config: Any,
    samples: list[BenchSample],
    arrivals: np.ndarray,
    concurrency: int,
    cpu_threads: int | None = None,
) -> dict[str, Any]:
    """The same load against an engine in this process; `cpu_threads` as a worker replica's
    (`ClusterConfig.advanced.worker_cpu_threads`), so both sides compute with the same torch threads."""
    measured = await _engine_load(engine_config, samples, arrivals, concurrency, cpu_threads)
    return measured.summary()


async def _engine_load(
    engine_config: Any,
    samples: list[BenchSample],
    arrivals: np.ndarray,
    concurrency: int,
    cpu_threads: int | None = None,
) -> Measured:
    """`engine_run`'s load, not yet summarized."""
    from cluster.deployment import set_cpu_threads
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    set_cpu_threads(engine_config, cpu_threads)
    engine = Engine.launched(engine_config)  # as a worker replica starts it
    counter = iter(range(10**9))
    engine_ttfts: list[float] = []  # the engine's own, as the ingress's histograms have them
    engine_queues: list[float] = []

    async def one(sample: BenchSample) -> RequestResult:
        params = SamplingParams(max_tokens=sample.output_len, ignore_eos=True, temperature=0.0)
        result = RequestResult(prompt_tokens=len(sample.prompt))
        start = last = time.perf_counter()
        stream = engine.submit([EngineRequest(f"bench-{next(counter)}", sample.prompt, params)])
        async for frame in stream:
            now = time.perf_counter()
            result.output_tokens += sum(len(d.new_token_ids) for d in frame)
            for d in frame:
                if d.metrics is not None:
                    engine_ttfts.append(d.metrics.time_to_first_token)
                    engine_queues.append(d.metrics.queue_time)
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
        result.e2e = time.perf_counter() - start
        return result

    try:
        await asyncio.gather(*(one(s) for s in warm_up_samples(samples)))
        before = engine.stats()
        engine_ttfts.clear()
        engine_queues.clear()
        measured = await drive(samples, arrivals, concurrency, one)
        after = engine.stats()
        if engine_ttfts:
            measured.sums["engine_ttft_mean_ms"] = (sum(engine_ttfts), len(engine_ttfts))
            measured.sums["engine_queue_mean_ms"] = (sum(engine_queues), len(engine_queues))
        measured.sums["engine_step_ms"] = (
            after.step_seconds_total - before.step_seconds_total,
            after.num_steps - before.num_steps,
        )
        if engine.scheduler.pacer is not None:  # what EngineConfig.prefill_slowdown learnt
            measured.extra["pacer"] = engine.scheduler.pacer.describe()
        return measured
    finally:
        engine.shutdown()


# -- the load ------------------------------------------------------------------------------------


async def drive(
    samples: list[BenchSample], arrivals: np.ndarray, concurrency: int, one: Any
) -> Measured:
    """Send every sample at its arrival time (at most `concurrency` in flight), with this
    process's heap frozen as a replica's is (`worker.heap`): no full collection of the
    client's (or the in-process engine's) heap stalls the load."""
    with frozen_heap():
        gate = asyncio.Semaphore(concurrency)
        cpu_before = cpu_times()
        start = time.perf_counter()

        async def scheduled(sample: BenchSample, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with gate:
                try:
                    return await one(sample)
                except Exception as exc:  # a failed request is counted, not fatal
                    return RequestResult(
                        prompt_tokens=len(sample.prompt), error=repr(exc), outcome="lost"
                    )

        results = await asyncio.gather(
            *(scheduled(s, float(t)) for s, t in zip(samples, arrivals, strict=True))
        )
        seconds, cpu_after = time.perf_counter() - start, cpu_times()
        jiffies = (
            None
            if cpu_before is None or cpu_after is None
            else [b - a for a, b in zip(cpu_before, cpu_after, strict=True)]
        )
        return Measured(list(results), seconds, jiffies)
