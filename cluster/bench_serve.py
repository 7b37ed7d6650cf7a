"""`kvray bench serve`: online serving benchmark, the method of `vllm bench serve`.

A synthetic dataset (random prompt and output lengths; optionally every prompt opens with
one shared prefix) is sent to `/v1/completions` as token-id prompts with `ignore_eos`, so
every request has exactly the planned lengths. Arrivals follow a Poisson process at
`--request-rate` (gamma with `--burstiness`), at most `--max-concurrency` in flight. The
run prints throughput and TTFT / TPOT / ITL / E2E mean, p50, p99.

The same requests, on the same arrival schedule, then go straight into an in-process
Engine built from the same EngineConfig. The difference between the two runs is what the
ingress, the router and Serve add.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from cluster.bench_stats import (
    BenchSample,
    RequestResult,
    make_arrivals,
    make_samples,
    print_report,
    summarize,
)


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
        "--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once"
    )
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="1 = Poisson; <1 burstier, >1 steadier"
    )
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skip-engine", action="store_true", help="do not run the in-process engine baseline"
    )
    parser.add_argument("--result-json", help="write both summaries to this file")


def run(args: argparse.Namespace) -> int:
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
    summaries: dict[str, dict[str, Any]] = {}
    label = f"serve ({config.worker_replicas} worker replica(s), batch window {config.router.batch_window_ms} ms)"
    if args.base_url:
        summaries[label] = asyncio.run(
            _http_run(
                args.base_url,
                args.api_key,
                config.model_name,
                samples,
                arrivals,
                args.max_concurrency,
            )
        )
    else:
        summaries[label] = _launched_run(config, samples, arrivals, args.max_concurrency)
    if not args.skip_engine:
        summaries["in-process engine"] = asyncio.run(
            _engine_run(config.engine, samples, arrivals, args.max_concurrency)
        )
    print_report(summaries, vars(args))
    if args.result_json:
        Path(args.result_json).write_text(
            json.dumps({"args": vars(args), "results": summaries}, indent=2, default=str)
        )
    return 0


def _vocab_size(model: str) -> int:
    from worker.model.demo import resolve_model_path
    from worker.tokenizer import Tokenizer

    return Tokenizer.from_dir(resolve_model_path(model)).vocab_size


# -- the server ----------------------------------------------------------------------------------


def _launched_run(
    config: Any, samples: list[BenchSample], arrivals: np.ndarray, concurrency: int
) -> dict[str, Any]:
    """Start local Ray and the app, run the load over HTTP, stop everything again."""
    import ray
    from ray import serve

    from cluster.app import build_app, checkout_runtime_env

    # "local": a fresh Ray instance, never another process's cluster on this machine
    ray.init(
        address="local",
        runtime_env=checkout_runtime_env(),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix)
        base_url = f"http://{config.host}:{config.port}"
        key = config.api_keys[0] if config.api_keys else "unused"
        return asyncio.run(
            _http_run(base_url, key, config.model_name, samples, arrivals, concurrency)
        )
    finally:
        serve.shutdown()
        ray.shutdown()


async def _http_run(
    base_url: str,
    api_key: str,
    model: str,
    samples: list[BenchSample],
    arrivals: np.ndarray,
    concurrency: int,
) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4
    )
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=600, limits=limits
    ) as client:

        async def one(sample: BenchSample) -> RequestResult:
            return await _http_request(client, model, sample)

        await asyncio.gather(*(one(s) for s in samples[:2]))  # warm-up, not measured
        return await _drive(samples, arrivals, concurrency, one)


async def _http_request(client: Any, model: str, sample: BenchSample) -> RequestResult:
    body = {
        "model": model,
        "prompt": sample.prompt,
        "max_tokens": sample.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_tokens=len(sample.prompt))
    start = time.perf_counter()
    last = start
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = chunk["error"]["message"]
            elif chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices"):
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    result.e2e = time.perf_counter() - start
    return result


# -- the in-process engine -------------------------------------------------------------------


async def _engine_run(
    engine_config: Any, samples: list[BenchSample], arrivals: np.ndarray, concurrency: int
) -> dict[str, Any]:
    from worker.engine import Engine, EngineRequest
    from worker.sampling import SamplingParams

    engine = Engine(engine_config)
    engine.start()
    counter = iter(range(10**9))

    async def one(sample: BenchSample) -> RequestResult:
        params = SamplingParams(max_tokens=sample.output_len, ignore_eos=True, temperature=0.0)
        result = RequestResult(prompt_tokens=len(sample.prompt))
        start = last = time.perf_counter()
        stream = engine.submit([EngineRequest(f"bench-{next(counter)}", sample.prompt, params)])
        async for frame in stream:
            now = time.perf_counter()
            result.output_tokens += sum(len(d.new_token_ids) for d in frame)
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
        result.e2e = time.perf_counter() - start
        return result

    try:
        await asyncio.gather(*(one(s) for s in samples[:2]))
        return await _drive(samples, arrivals, concurrency, one)
    finally:
        engine.shutdown()


# -- the load ------------------------------------------------------------------------------------


async def _drive(
    samples: list[BenchSample], arrivals: np.ndarray, concurrency: int, one: Any
) -> dict[str, Any]:
    """Send every sample at its arrival time (at most `concurrency` in flight); summarize."""
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def scheduled(sample: BenchSample, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with gate:
            try:
                return await one(sample)
            except Exception as exc:  # a failed request is counted, not fatal
                return RequestResult(prompt_tokens=len(sample.prompt), error=repr(exc))

    results = await asyncio.gather(
        *(scheduled(s, float(t)) for s, t in zip(samples, arrivals, strict=True))
    )
    return summarize(results, time.perf_counter() - start)
