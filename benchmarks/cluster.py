"""`kvray bench cluster`: the whole cluster, scenario by scenario, over `kvray bench serve`'s
client: 1 -> N worker replicas, router policies side by side, and the in-process engine.

The server is `-c`'s ClusterConfig (default: the demo model) with `--model` over it; each
scenario overrides only what it varies (`--scenarios`, in this order):
- scaling: 1 worker replica, a latency load (Poisson arrivals at `--lat-rate`) and a
  saturation load (everything at once), streamed as `vllm bench serve` does, then the
  saturation load without streaming; then N replicas (`--replicas`, one GPU each) with the
  saturation loads N times the size (per replica the load stays the same).
- affinity: N replicas whose KV cache cannot hold every shared system prompt on each, many
  requests sharing a few long system prompts, `router.prefix_affinity` on, then off (fresh
  system prompts, so the first run's cache does not help the second): prefix hit rate and
  throughput side by side.
- prefix: the router policies side by side on tenants' shared contexts that overflow one
  replica's KV cache, and a low-reuse control; the router view's staleness
  (benchmarks/cluster_prefix.py).
- front: per HTTP front (`--front-proxies`: HAProxy, Serve's proxy), a Ray of its own with
  1 replica of the config's model, then `--front-replicas` N replicas of the far smaller
  `--front-model` sharing the GPU (`--front-gpu-share`), the streamed saturation load N
  times the size: what the front carries over one replica's saturation throughput, each
  figure beside the client's own floor (the load against an instant stub server)
  (benchmarks/cluster_front.py).
- engine: Serve stopped, the latency and saturation loads against an in-process Engine of
  the same EngineConfig on the same device; the 1-replica latency load less this one is
  what the ingress, the router and Serve add to TTFT.
- router: no Ray and no model: the routing decision alone (`rank_replicas` over replicas'
  prefix keys as the router holds them) at `--router-replicas` simulated replicas, each
  reporting `--router-keys` page keys; p50/p99 microseconds a call.
Per-process CPU use of the Serve proxy, ingress and worker replicas is recorded per load.
A saturation load needs a server that queues it: set `engine.max_waiting` and the limits'
timeouts in the YAML to match `--sat-prompts`.

    kvray bench cluster -c cluster.yaml --model DIR --replicas 2 --result-json r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import cluster_front, cluster_prefix
from benchmarks.common import copy_tokenizer, write_result
from benchmarks.serve import drive, engine_run, http_client, http_request, http_run
from benchmarks.stats import (
    BenchSample,
    RequestPlan,
    RequestResult,
    make_arrivals,
    make_samples,
    summarize,
    tally,
)
from cluster.config import ClusterConfig
from cluster.local_ray import free_port, ray_session
from cluster.router import ReplicaView, RouteHint, _KnownKeys, rank_replicas

APP = "kvray"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="ClusterConfig YAML (default: the demo model)")
    p.add_argument("--model", help="model directory or 'demo' (overrides the config)")
    p.add_argument("--load-format", choices=["safetensors", "random"], help="overrides the config")
    p.add_argument("--tokenizer-from", help="copy tokenizer files from this model dir (or 'demo')")
    p.add_argument(
        "--scenarios",
        default="scaling,engine",
        help="comma-separated: scaling (1 and N replicas), affinity, prefix (router policies "
        "on a shared-prefix workload), front (the HTTP front's streamed throughput, per "
        "proxy), engine (in-process); or router alone (the routing decision's cost, no Ray)",
    )
    p.add_argument("--replicas", type=int, default=2, help="the scaled-out replica count")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--sat-prompts",
        type=int,
        default=512,
        help="saturation load per worker replica: N replicas get N times the prompts and the "
        "concurrency, so each replica is as loaded as the one in the 1-replica run",
    )
    p.add_argument("--sat-concurrency", type=int, default=512, help="per worker replica")
    p.add_argument(
        "--client-procs",
        type=int,
        default=4,
        help="processes of the streaming saturation client (one parses about 6k SSE events/s)",
    )
    p.add_argument("--lat-prompts", type=int, default=160)
    p.add_argument("--lat-rate", type=float, default=8.0)
    p.add_argument("--lat-output-len", type=int, default=128)
    p.add_argument("--lat-concurrency", type=int, default=64)
    p.add_argument("--prefix-groups", type=int, default=24, help="distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--prefix-prompts", type=int, default=768)
    p.add_argument("--prefix-suffix-len", type=int, default=128)
    p.add_argument("--prefix-output-len", type=int, default=64)
    p.add_argument("--prefix-concurrency", type=int, default=128)
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=49152,
        help="KV capacity per replica in the affinity scenario (tokens); below groups x "
        "prefix-len, so without affinity a replica cannot keep every shared prompt",
    )
    p.add_argument(
        "--affinity-gpus-per-replica",
        type=float,
        default=1.0,
        help="affinity on one GPU: 0.5 puts both replicas on it (hit rates still compare)",
    )
    p.add_argument("--skip-nonstream", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-num-cpus", type=int, help="CPUs Ray may hand out (default: all)")
    p.add_argument(
        "--ray-nodes",
        type=int,
        default=1,
        help="Ray nodes on this machine, each with its share of the GPUs and its own Serve "
        "HTTP proxy (one proxy caps streamed throughput)",
    )
    p.add_argument("--router-replicas", type=int, default=64)
    p.add_argument("--router-keys", type=int, default=4096, help="page keys each replica reports")
    p.add_argument("--router-prompt-pages", type=int, default=256, help="pages hashed a prompt")
    p.add_argument("--router-calls", type=int, default=2000)
    p.add_argument("--result-json", help="write the results to this file")
    cluster_prefix.add_arguments(p)
    cluster_front.add_arguments(p)


# -- processes ----------------------------------------------------------------------------------


def _cpu_seconds() -> dict[tuple[int, str], float]:
    """CPU seconds used so far by each Serve process, keyed (pid, kind)."""
    kinds = {
        "ProxyActor": "proxy",
        "KvrayIngress": "ingress",
        "KvrayWorker": "worker",
        "ServeController": "controller",
    }
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[tuple[int, str], float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = next((k for key, k in kinds.items() if key in cmdline), None)
        if kind is None and os.getpid() in (int(pid), int(fields[1])):  # itself, its client procs
            kind = "bench client"
        if kind:
            used[(int(pid), kind)] = (int(fields[11]) + int(fields[12])) / tick
    return used


async def _measured(coro: Any) -> dict[str, Any]:
    before, start = _cpu_seconds(), time.perf_counter()
    summary = await coro
    wall = time.perf_counter() - start
    after = _cpu_seconds()
    busy: dict[str, float] = {}
    for key in after.keys() & before.keys():  # processes alive through the whole load
        busy[key[1]] = busy.get(key[1], 0.0) + (after[key] - before[key]) / wall
    summary["cpu_cores_busy"] = {k: round(v, 2) for k, v in sorted(busy.items())}
    return summary


# -- loads --------------------------------------------------------------------------------------


async def _http_run(
    url: str, model: str, samples: list[BenchSample], arrivals: np.ndarray, concurrency: int
) -> dict[str, Any]:
    """`kvray bench serve`'s streaming client: every request runs to its planned length."""
    plans = [RequestPlan()] * len(samples)
    options = argparse.Namespace(max_concurrency=concurrency, request_timeout=900.0)
    return await http_run(url, "unused", model, samples, plans, arrivals, options)


def _client_part(
    url: str, model: str, samples: list[BenchSample], concurrency: int
) -> tuple[float, float, list[RequestResult]]:
    """One client process's share of a saturation load: (start, end, results), wall clock."""

    async def run() -> tuple[float, float, list[RequestResult]]:
        async with http_client(url, concurrency, 900.0) as client:

            async def one(sample: BenchSample) -> RequestResult:
                return await http_request(client, model, sample, RequestPlan(), 900.0)

            start = time.time()
            results = (await drive(samples, np.zeros(len(samples)), concurrency, one)).results
            return start, time.time(), results

    return asyncio.run(run())


def _ready(_: int = 0) -> int:
    return os.getpid()


async def _http_run_procs(
    pool: Any, url: str, model: str, samples: list[BenchSample], concurrency: int
) -> dict[str, Any]:
    """The streamed saturation load from every process of `pool` (all requests at once, the
    samples dealt round-robin), summarized as one run."""
    procs = pool._max_workers
    loop = asyncio.get_running_loop()
    parts = [
        loop.run_in_executor(
            pool, _client_part, url, model, samples[i::procs], max(1, concurrency // procs)
        )
        for i in range(procs)
    ]
    done = await asyncio.gather(*parts)
    results = [r for _, _, part in done for r in part]
    duration = max(end for _, end, _ in done) - min(start for start, _, _ in done)
    plans = [RequestPlan()] * len(results)
    ok = [r for r in results if r.ok]
    chunks = sum(1 + len(r.itls) for r in ok)  # a request's first chunk has no ITL
    return {
        **summarize(results, duration),
        "outcomes": tally(results, plans),
        "client_procs": procs,
        "sse_chunks_per_token": chunks / max(1, sum(r.output_tokens for r in ok)),
    }


async def _nonstream_run(
    base_url: str, model: str, samples: list[BenchSample], concurrency: int
) -> dict[str, Any]:
    """The saturation load without streaming: one response per request, no per-token SSE."""
    async with http_client(base_url, concurrency, 900.0) as client:

        async def one(sample: BenchSample) -> RequestResult:
            body = {
                "model": model,
                "prompt": sample.prompt,
                "max_tokens": sample.output_len,
                "ignore_eos": True,
                "temperature": 0.0,
            }
            result = RequestResult(prompt_tokens=len(sample.prompt))
            start = time.perf_counter()
            async with client.post("/v1/completions", json=body) as response:
                payload = await response.read()
            result.e2e = time.perf_counter() - start
            if response.status != 200:
                result.error = f"HTTP {response.status}: {payload[:200]!r}"
                return result
            result.ttft = result.e2e  # no stream: the whole answer is the first byte
            result.output_tokens = json.loads(payload)["usage"]["completion_tokens"]
            return result

        return (await drive(samples, np.zeros(len(samples)), concurrency, one)).summary()


def _prefix_samples(args: argparse.Namespace, vocab: int, seed: int) -> list[BenchSample]:
    """`prefix-prompts` requests, each a random one of `prefix-groups` system prompts plus
    its own suffix, shuffled so the groups interleave."""
    rng = np.random.default_rng(seed)
    low, high = min(1000, vocab // 4), vocab - 1
    systems = [
        rng.integers(low, high, size=args.prefix_len).tolist() for _ in range(args.prefix_groups)
    ]
    groups = rng.integers(0, args.prefix_groups, size=args.prefix_prompts)
    return [
        BenchSample(
            systems[g] + rng.integers(low, high, size=args.prefix_suffix_len).tolist(),
            args.prefix_output_len,
        )
        for g in groups
    ]


# -- Serve --------------------------------------------------------------------------------------


@contextmanager
def serve_session(config: ClusterConfig, args: argparse.Namespace) -> Iterator[tuple[int, str]]:
    """A Ray of this benchmark's own (`--ray-nodes`, `--ray-num-cpus`) set up for
    `config.http_proxy` (resolved: `resolve_http_proxy`), Serve started on a free port;
    (port, base URL). Serve and Ray are shut down after the block."""
    from ray import serve

    from cluster.app import cluster_runtime_env, set_serve_env

    set_serve_env()
    runtime_env = cluster_runtime_env(config)
    with ray_session(nodes=args.ray_nodes, num_cpus=args.ray_num_cpus, runtime_env=runtime_env,
                     include_dashboard=False, log_to_driver=False):  # fmt: skip
        try:
            port = free_port()
            # a proxy on every Ray node; with --ray-nodes they share the port (SO_REUSEPORT)
            serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "EveryNode"})
            yield port, f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()


def _deploy(config: ClusterConfig) -> float:
    from ray import serve

    from cluster.app import build_app

    start = time.perf_counter()
    serve.run(build_app(config), name=APP, route_prefix="/")
    base = f"http://{config.host}:{config.port}"
    body = {"model": config.model_name, "prompt": [1, 2, 3], "max_tokens": 2}
    for _ in range(4 * config.worker_replicas):  # every replica has stepped once
        httpx.post(f"{base}/v1/completions", json=body, timeout=300).raise_for_status()
    return time.perf_counter() - start


def _worker_stats() -> list[dict[str, Any]]:
    from ray import serve

    from cluster.app import WORKER_NAME

    handle = serve.get_deployment_handle(WORKER_NAME, app_name=APP)
    stats = handle.broadcast("stats").results(timeout_s=60, return_exceptions=True)
    return sorted((s for s in stats if isinstance(s, dict)), key=lambda s: s["replica_id"])


def _hit_rate(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    hits = [a["prefix_hits"] - b["prefix_hits"] for a, b in zip(after, before, strict=True)]
    queries = [
        a["prefix_queries"] - b["prefix_queries"] for a, b in zip(after, before, strict=True)
    ]
    return {
        "prefix_hit_rate": sum(hits) / max(1, sum(queries)),
        "per_replica_hit_rate": [h / max(1, q) for h, q in zip(hits, queries, strict=True)],
        "per_replica_queries": queries,
        "preemptions": sum(
            a["num_preemptions"] - b["num_preemptions"] for a, b in zip(after, before, strict=True)
        ),
        "per_replica_generated_tokens": [
            a["generation_tokens_total"] - b["generation_tokens_total"]
            for a, b in zip(after, before, strict=True)
        ],
    }


def _show(title: str, summary: dict[str, Any]) -> None:
    t, i, p = summary["ttft_ms"], summary["itl_ms"], summary["tpot_ms"]
    print(  # a line of its own: progress bars before it end without a newline
        f"\n  {title:34} {summary['completed']:4d} ok {summary['failed']:3d} failed  "
        f"out {summary['output_throughput']:9.1f} tok/s  TTFT p50 {t['p50']:8.2f} p99 {t['p99']:8.2f}  "
        f"TPOT p50 {p['p50']:6.2f}  ITL p50 {i['p50']:6.2f} p99 {i['p99']:7.2f} ms  "
        f"cpu {summary.get('cpu_cores_busy', {})}",
        flush=True,
    )
    if "workers" in summary:
        w = summary["workers"]
        print(f"    workers: generated {w['per_replica_generated_tokens']}, prefix hit rate "
              f"{w['prefix_hit_rate']:.3f}, preemptions {w['preemptions']}", flush=True)  # fmt: skip
    if "pacer" in summary:
        print(f"    pacer: {summary['pacer']}", flush=True)
    for error in summary["errors"]:
        print(f"    error: {error}", flush=True)


def router_cost(
    replicas: int, keys: int, prompt_pages: int, calls: int, seed: int = 0
) -> dict[str, Any]:
    """Time `rank_replicas` for calls of one prompt over `replicas` simulated replicas. Each
    holds `keys` page keys, half of them drawn from a common pool of shared prefixes, as the
    router sees them (`_KnownKeys`: reported plus recently claimed); each prompt is a run of
    `prompt_pages` pool keys, so some replicas match a long leading run and most a short one."""
    rng = np.random.default_rng(seed)
    pool = [int(k) for k in rng.integers(1, 2**62, size=4 * keys)]
    now = time.monotonic()
    views = []
    for i in range(replicas):
        own = {int(k) for k in rng.integers(1, 2**62, size=keys // 2)}
        start = int(rng.integers(0, len(pool) - keys // 2))
        reported = frozenset(own | set(pool[start : start + keys // 2]))
        known = _KnownKeys(reported, {}, now)
        views.append(ReplicaView(f"r{i}", float(rng.integers(0, 64)), float(rng.random()), known))
    hints = []
    for _ in range(calls):
        start = int(rng.integers(0, len(pool) - prompt_pages))
        hints.append(RouteHint(page_hashes=(tuple(pool[start : start + prompt_pages]),)))
    micros = []
    for hint in hints:
        began = time.perf_counter_ns()
        rank_replicas(hint, views, imbalance_threshold=8.0, imbalance_ratio=1.25)
        micros.append((time.perf_counter_ns() - began) / 1000)
    p50, p99 = np.percentile(micros, [50, 99])
    return {
        "replicas": replicas,
        "keys_per_replica": keys,
        "prompt_pages": prompt_pages,
        "calls": calls,
        "decision_us_p50": float(p50),
        "decision_us_p99": float(p99),
    }


def run(args: argparse.Namespace) -> int:
    if args.scenarios == "router":  # no model, no Ray
        result = router_cost(
            args.router_replicas,
            args.router_keys,
            args.router_prompt_pages,
            args.router_calls,
            args.seed,
        )
        print(
            f"routing decision, {result['replicas']} replicas x {result['keys_per_replica']} keys:"
            f" p50 {result['decision_us_p50']:.1f} us, p99 {result['decision_us_p99']:.1f} us"
        )
        write_result(args.result_json, "cluster", {"router": result})
        return 0
    from cluster.app import load_config, resolve_http_proxy
    from worker.model.demo import resolve_model_path
    from worker.tokenizer import Tokenizer

    config = load_config(args.config)
    engine = config.engine
    if args.model:
        engine = engine.model_copy(update={"model": args.model})
    if args.load_format:
        advanced = engine.advanced.model_copy(update={"load_format": args.load_format})
        engine = engine.model_copy(update={"advanced": advanced})
    config = config.model_copy(update={"engine": engine})
    if set(args.scenarios.split(",")) & {"scaling", "affinity", "prefix"}:  # a Ray of its own
        config = resolve_http_proxy(config, own_ray=True, nodes=args.ray_nodes)
    model_dir = resolve_model_path(engine.model)
    if args.tokenizer_from:
        copy_tokenizer(resolve_model_path(args.tokenizer_from), model_dir)
    name = config.model_name
    vocab = Tokenizer.from_dir(model_dir).vocab_size
    base = config.model_dump(mode="json")
    lat_samples = make_samples(
        args.lat_prompts, args.input_len, args.lat_output_len, 0.5, 0, vocab, args.seed
    )
    lat_arrivals = make_arrivals(args.lat_prompts, args.lat_rate, 1.0, args.seed)
    # the saturation load grows with the replicas (see --sat-prompts); 1 replica gets the first share
    sat_samples = make_samples(
        args.sat_prompts * args.replicas,
        args.input_len,
        args.output_len,
        0.5,
        0,
        vocab,
        args.seed + 7,
    )
    sat_arrivals = np.zeros(len(sat_samples))
    # The non-streamed load has prompts of its own: the streamed one's are in the replicas'
    # prefix caches when it starts, and resending them would measure cache hits.
    nonstream_samples = make_samples(
        args.sat_prompts * args.replicas,
        args.input_len,
        args.output_len,
        0.5,
        0,
        vocab,
        args.seed + 8,
    )
    used = {k: v for k, v in base.items() if k != "api_keys"}
    results: dict[str, Any] = {"model": name, "args": vars(args), "config": used}

    def save() -> None:
        write_result(args.result_json, "cluster", results)

    phases = set(args.scenarios.split(","))
    if phases & {"scaling", "affinity", "prefix"}:
        with serve_session(config, args) as (port, url):
            if "scaling" in phases:
                loads = {
                    "lat": (lat_samples, lat_arrivals),
                    "sat": (sat_samples, sat_arrivals),
                    "sat_nonstream": (nonstream_samples, sat_arrivals),
                }
                _scaling_phase(args, base, port, url, name, loads, results, save)
            if "affinity" in phases:
                results["affinity"] = _affinity_phase(args, base, port, url, name, vocab)
                save()
            if "prefix" in phases:
                results["prefix"] = cluster_prefix.prefix_scenario(args, base, port, url, vocab)
                save()
    if "front" in phases:  # a Ray of its own per proxy
        results["front"] = cluster_front.front_scenario(args, config)
        save()
    if "engine" in phases:
        _release_device()
        results["engine_inprocess"] = {
            "latency": asyncio.run(
                _measured(engine_run(engine, lat_samples, lat_arrivals, args.lat_concurrency))
            ),
        }
        _show("in-process engine, latency", results["engine_inprocess"]["latency"])
        _release_device()
        results["engine_inprocess"]["saturation"] = asyncio.run(
            _measured(
                engine_run(
                    engine,
                    sat_samples[: args.sat_prompts],
                    sat_arrivals[: args.sat_prompts],
                    args.sat_concurrency,
                )
            )
        )
        _show("in-process engine, saturation", results["engine_inprocess"]["saturation"])
    if "serve_1" in results and "engine_inprocess" in results:
        _overhead(results)
    save()
    if shown := {k: results[k] for k in ("scaling", "overhead") if k in results}:
        print(json.dumps(shown, indent=2))
    return 0


def _scaling_phase(
    args: argparse.Namespace,
    base: dict[str, Any],
    port: int,
    url: str,
    name: str,
    loads: dict[str, tuple[list[BenchSample], np.ndarray]],
    results: dict[str, Any],
    save: Any,
) -> None:
    """1 worker replica, then `args.replicas`: latency (1 only) and saturation loads; the
    streamed saturation load comes from `args.client_procs` processes."""
    counts = list(dict.fromkeys((1, args.replicas)))  # one GPU: --replicas 1 runs once
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.client_procs, mp_context=context) as pool:
        list(pool.map(_ready, range(args.client_procs)))  # started and imported before any load
        for replicas in counts:
            _scale_to(args, base, port, url, name, replicas, counts, pool, loads, results)
            save()
    if len(counts) > 1:
        _scaling(results, args.replicas)


def _scale_to(
    args: argparse.Namespace,
    base: dict[str, Any],
    port: int,
    url: str,
    name: str,
    replicas: int,
    counts: list[int],
    pool: ProcessPoolExecutor,
    loads: dict[str, tuple[list[BenchSample], np.ndarray]],
    results: dict[str, Any],
) -> None:
    """Deploy `replicas` worker replicas and run the loads against them."""
    (lat_samples, lat_arrivals), (all_sat, _) = loads["lat"], loads["sat"]
    sat_samples, sat_concurrency = (
        all_sat[: args.sat_prompts * replicas],
        args.sat_concurrency * replicas,
    )
    nonstream_samples = loads["sat_nonstream"][0][: args.sat_prompts * replicas]
    config = ClusterConfig.model_validate({**base, "worker_replicas": replicas, "port": port})
    key = f"serve_{replicas}"
    results[key] = {"deploy_s": _deploy(config)}
    print(
        f"[{name}] {replicas} worker replica(s) up in {results[key]['deploy_s']:.1f} s",
        flush=True,
    )
    if replicas == 1:
        results[key]["latency"] = asyncio.run(
            _measured(_http_run(url, name, lat_samples, lat_arrivals, args.lat_concurrency))
        )
        _show("latency (stream)", results[key]["latency"])
    before = _worker_stats()
    results[key]["saturation"] = asyncio.run(
        _measured(_http_run_procs(pool, url, name, sat_samples, sat_concurrency))
    )
    after = _worker_stats()
    results[key]["saturation"]["workers"] = _hit_rate(before, after)  # each replica's share too
    _show("saturation (stream)", results[key]["saturation"])
    if not args.skip_nonstream:
        results[key]["saturation_nonstream"] = asyncio.run(
            _measured(_nonstream_run(url, name, nonstream_samples, sat_concurrency))
        )
        before, after = after, _worker_stats()
        results[key]["saturation_nonstream"]["workers"] = _hit_rate(before, after)
        _show("saturation (no stream)", results[key]["saturation_nonstream"])
    results[key]["worker_stats"] = after


def _affinity_phase(
    args: argparse.Namespace, base: dict[str, Any], port: int, url: str, name: str, vocab: int
) -> dict[str, Any]:
    engine = {**base["engine"], "num_pages": args.prefix_cache_tokens // 16}
    phase: dict[str, Any] = {
        "kv_tokens_per_replica": args.prefix_cache_tokens,
        "shared_prompt_tokens": args.prefix_groups * args.prefix_len,
    }
    for i, affinity in enumerate((True, False)):
        config = ClusterConfig.model_validate(
            {
                **base,
                "engine": engine,
                "worker_replicas": args.replicas,
                "worker_resources": {"num_gpus": args.affinity_gpus_per_replica},
                "port": port,
                "advanced": {
                    **base.get("advanced", {}),
                    "router": {
                        **base.get("advanced", {}).get("router", {}),
                        "prefix_affinity": affinity,
                    },
                },
            }
        )
        deploy_s = _deploy(config)
        samples = _prefix_samples(args, vocab, args.seed + 100 + i)
        before = _worker_stats()
        summary = asyncio.run(
            _measured(
                _http_run(url, name, samples, np.zeros(len(samples)), args.prefix_concurrency)
            )
        )
        summary.update(_hit_rate(before, _worker_stats()), deploy_s=deploy_s)
        key = "affinity_on" if affinity else "affinity_off"
        phase[key] = summary
        _show(f"shared prompts, {key}", summary)
        print(
            f"    prefix hit rate {summary['prefix_hit_rate']:.3f} per replica {summary['per_replica_hit_rate']}",
            flush=True,
        )
    on, off = phase["affinity_on"], phase["affinity_off"]
    phase["throughput_ratio_on_off"] = on["output_throughput"] / max(1e-9, off["output_throughput"])
    return phase


def _scaling(results: dict[str, Any], replicas: int) -> None:
    one, many = results["serve_1"], results[f"serve_{replicas}"]
    scaling = {}
    for load in ("saturation", "saturation_nonstream"):
        if load in one and load in many:
            scaling[load] = many[load]["output_throughput"] / max(
                1e-9, one[load]["output_throughput"]
            )
    results["scaling"] = scaling
    print(f"  throughput scaling 1 -> {replicas} replicas: {scaling}", flush=True)


def _overhead(results: dict[str, Any]) -> None:
    served, engine = results["serve_1"]["latency"], results["engine_inprocess"]["latency"]
    results["overhead"] = {
        "ttft_p50_added_ms": served["ttft_ms"]["p50"] - engine["ttft_ms"]["p50"],
        "itl_p50_added_ms": served["itl_ms"]["p50"] - engine["itl_ms"]["p50"],
        "serve_itl_p99_over_p50": served["itl_ms"]["p99"] / served["itl_ms"]["p50"],
        "engine_itl_p99_over_p50": engine["itl_ms"]["p99"] / engine["itl_ms"]["p50"],
    }


def _release_device(timeout_s: float = 60.0) -> None:
    """Before an in-process engine sizes its KV cache from free memory: drop the previous
    engine's cached blocks and wait for the Serve workers' memory to be given back."""
    import gc

    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free > 0.9 * total:
            return
        time.sleep(1.0)
