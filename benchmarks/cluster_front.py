"""`kvray bench cluster --scenarios front`: the streamed load the default HTTP path carries,
against one replica's saturation throughput (issue #43: a second GPU must never wait on
the front).

Every `--front-proxies` entry gets a Ray of its own (the HTTP front, HAProxy or Serve's
Python proxy, is fixed when Ray starts: `resolve_http_proxy`, `cluster_runtime_env`); in it:
- reference: 1 worker replica of `-c`'s model and the streamed saturation load
  (`--sat-prompts`, `--sat-concurrency`, from `--client-procs` processes);
- front: `--front-replicas` N replicas of `--front-model`, a model small enough that its
  engines outrun the front, sharing a GPU where Ray has one (`num_gpus:
  --front-gpu-share` each, each sizing its KV cache from that share of the free memory),
  and the same load N times the size; its output tok/s and req/s over the reference's.
Only one model is deployed at a time: the reference's app is deleted before the front's.
Then, Ray stopped, the client's floor beside each figure: the same load from the same client
processes at the same concurrency against `sse_stub` (no engine, the real run's SSE chunks
per token), what the client alone carries. A figure near its floor measures the client.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from benchmarks import sse_stub
from benchmarks.common import copy_tokenizer
from benchmarks.stats import BenchSample, make_samples
from cluster.config import ClusterConfig

PROXIES = "haproxy,serve"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("front scenario (--scenarios front)")
    g.add_argument(
        "--front-proxies",
        default=PROXIES,
        help="HTTP fronts to run, each in a Ray of its own: haproxy (HAProxy before the "
        "ingress; Serve's proxy where there is no binary), serve (Serve's Python proxy)",
    )
    g.add_argument(
        "--front-model",
        default="demo",
        help="model directory or 'demo' of the front load, far smaller than -c's so its "
        "engines outrun the front (--tokenizer-from gives it the tokenizer too)",
    )
    g.add_argument(
        "--front-replicas",
        type=int,
        default=2,
        help="worker replicas of --front-model; the saturation load is this many times the "
        "reference's (prompts and concurrency)",
    )
    g.add_argument(
        "--front-gpu-share",
        type=float,
        default=0.5,
        help="num_gpus of a --front-model replica where Ray has GPUs (0.5: two on one GPU); "
        "without GPUs the config's worker_resources",
    )


def front_scenario(args: argparse.Namespace, config: ClusterConfig) -> dict[str, Any]:
    """Every proxy's reference and front loads, and the client's floor of each."""
    from benchmarks.cluster import _ready
    from worker.model.demo import resolve_model_path

    front_dir = resolve_model_path(args.front_model)
    if args.tokenizer_from:
        copy_tokenizer(resolve_model_path(args.tokenizer_from), front_dir)
    n = args.front_replicas
    loads = {
        "reference": (_samples(args, config.engine.model, 1, args.seed + 7), args.sat_concurrency),
        "front": (_samples(args, args.front_model, n, args.seed + 9), args.sat_concurrency * n),
    }
    results: dict[str, Any] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.client_procs, mp_context=context) as pool:
        list(pool.map(_ready, range(args.client_procs)))  # started and imported before any load
        for proxy in [p for p in args.front_proxies.split(",") if p]:
            results[proxy] = _proxy_run(args, config, proxy, pool, loads)
    _table(results)
    return results


def _samples(args: argparse.Namespace, model: str, replicas: int, seed: int) -> list[BenchSample]:
    from worker.model.demo import resolve_model_path
    from worker.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(resolve_model_path(model)).vocab_size
    count = args.sat_prompts * replicas
    return make_samples(count, args.input_len, args.output_len, 0.5, 0, vocab, seed)


def _proxy_run(
    args: argparse.Namespace,
    config: ClusterConfig,
    proxy: str,
    pool: ProcessPoolExecutor,
    loads: dict[str, tuple[list[BenchSample], int]],
) -> dict[str, Any]:
    """One proxy's Ray: the reference, then the front; then the client's floor of both."""
    import ray
    from ray import serve

    from benchmarks.cluster import APP, serve_session
    from cluster.app import resolve_http_proxy

    wanted = config.model_copy(update={"http_proxy": proxy})
    config = resolve_http_proxy(wanted, own_ray=True, nodes=args.ray_nodes)
    entry: dict[str, Any] = {"http_proxy": config.http_proxy}
    with serve_session(config, args) as (port, url):
        one = _reference_config(config, port)
        entry["reference"] = _saturate(pool, url, one, *loads["reference"], proxy)
        serve.delete(APP)  # its replica gone, and its GPU memory with it
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
        many = _front_config(args, config, port, has_gpu)
        entry["front"] = _saturate(pool, url, many, *loads["front"], proxy)
    ref, front = entry["reference"], entry["front"]
    entry["ratio_tok_s"] = front["output_throughput"] / max(1e-9, ref["output_throughput"])
    entry["ratio_req_s"] = front["request_throughput"] / max(1e-9, ref["request_throughput"])
    entry["client_floor"] = {
        key: _client_floor(pool, args.client_procs, *loads[key], entry[key]["sse_chunks_per_token"])
        for key in ("reference", "front")
    }
    return entry


def _saturate(
    pool: ProcessPoolExecutor,
    url: str,
    config: ClusterConfig,
    samples: list[BenchSample],
    concurrency: int,
    proxy: str,
) -> dict[str, Any]:
    """Deploy `config`, then the streamed saturation load from every client process."""
    import ray

    from benchmarks.cluster import _deploy, _http_run_procs, _measured, _show

    deploy_s = _deploy(config)
    ingress = config.ingress_count(ray.cluster_resources().get("CPU", 0))  # as build_app chose
    name = config.model_name
    summary = asyncio.run(_measured(_http_run_procs(pool, url, name, samples, concurrency)))
    _show(f"{proxy}, {ingress} ingress, {config.worker_replicas} x {name}", summary)
    return {
        **summary,
        "model": name,
        "replicas": config.worker_replicas,
        "ingress_replicas": ingress,
        "deploy_s": deploy_s,
    }


def _reference_config(config: ClusterConfig, port: int) -> ClusterConfig:
    base = config.model_dump(mode="json")
    return ClusterConfig.model_validate(
        {**base, "worker_replicas": 1, "autoscaling": None, "port": port}
    )


def _front_config(
    args: argparse.Namespace, config: ClusterConfig, port: int, has_gpu: bool
) -> ClusterConfig:
    base = config.model_dump(mode="json")
    engine = {**base["engine"], "model": args.front_model}
    data = {
        **base,
        "engine": engine,
        "worker_replicas": args.front_replicas,
        "autoscaling": None,
        "port": port,
    }
    if has_gpu:
        # replicas sharing a GPU may size their KV caches at the same moment: each takes its
        # share of the free memory
        engine["kv_memory_fraction"] = engine["kv_memory_fraction"] * args.front_gpu_share
        data["worker_resources"] = {"num_gpus": args.front_gpu_share}
    return ClusterConfig.model_validate(data)


def _client_floor(
    pool: ProcessPoolExecutor,
    procs: int,
    samples: list[BenchSample],
    concurrency: int,
    chunks_per_token: float,
) -> dict[str, Any]:
    """The load against `sse_stub` at the real run's SSE chunks per token."""
    from benchmarks.cluster import _http_run_procs, _show

    with sse_stub.running(procs, chunks_per_token) as url:
        summary = asyncio.run(_http_run_procs(pool, url, "stub", samples, concurrency))
    _show(f"client floor, {len(samples)} requests", summary)
    return {**summary, "stub_chunks_per_token": chunks_per_token}


def _table(results: dict[str, Any]) -> None:
    """One line per proxy: each figure with the client's floor of its load beside it."""
    if not results:
        return
    first = next(iter(results.values()))
    ref, front = first["reference"], first["front"]

    def cell(run: dict[str, Any], floor: dict[str, Any]) -> str:
        return (
            f"{run['output_throughput']:10,.0f} {run['request_throughput']:7.1f} "
            f"({floor['output_throughput']:,.0f} / {floor['request_throughput']:.1f})"
        )

    print(f"\n  {ref['replicas']} x {ref['model']} (reference), {front['replicas']} x {front['model']} (front); tok/s, req/s "
          "(the client's floor of that load, tok/s / req/s)")  # fmt: skip
    print(f"  {'proxy':8} | {'reference tok/s, req/s':>32} | {'front tok/s, req/s':>32} | ratio")
    for proxy, entry in results.items():
        floors = entry["client_floor"]
        print(
            f"  {proxy:8} | {cell(entry['reference'], floors['reference']):>32} | "
            f"{cell(entry['front'], floors['front']):>32} | "
            f"{entry['ratio_tok_s']:.2f}x tok/s, {entry['ratio_req_s']:.2f}x req/s",
            flush=True,
        )
