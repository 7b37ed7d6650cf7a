"""`kvray bench cluster --scenarios prefix`: the router policies side by side on a
prefix-heavy workload whose shared contexts overflow one replica's KV cache.

The workload follows SGLang's `generated-shared-prefix`: `--tenants` tenants, each with a
context of its own (`--tenant-context-len` random tokens) and `--tenant-questions` questions
(`--question-len` tokens, `--answer-len` tokens out), all tenants' requests shuffled together
and sent with Poisson arrivals at `--tenant-rate`. Before them, unless `--no-tenant-warmup`,
each tenant asks one question of its own (not measured, same arrivals): the run measures
the steady state, where a tenant's context was seen before. Without the warm-up, the first
question of every tenant is a miss under any policy (96 tenants x 4k tokens is ~30 s of
prefill on one H200), and that backlog, the same for every policy, sets the TTFT tail of a
short run. The low-reuse control has the same
request lengths, but every prompt is its own random sequence (`--control-requests` of
them, default as many as the tenants' requests). Each replica's KV
cache holds `--tenant-kv-tokens` (default 1.5 x all contexts / replicas: the replicas
together hold every context, one alone cannot), so where a tenant's requests go decides
what stays cached.

Every `--policies` entry (`advanced.router.policy`) runs both loads on the same replicas
with prompts of its own (fresh random tokens), so one policy's cache never helps the next.
Each reports throughput, TTFT and ITL, and the engine's prefix hit rate (cached prompt
tokens over prompt tokens) per replica; for the tenants also where their questions went
(`placement`, from the replica each response names: the share served at their tenant's
usual replica, and how many tenants each replica is home to; `warmup_tenants_per_replica`
for the warm-up). Then, with the first policy deployed:
- staleness: how long a prompt the engine has just cached takes to reach a router's view
  (`staleness_probe`);
- the routing decision's cost at `--router-replicas` simulated replicas (`router_cost`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np

from benchmarks.serve import http_load
from benchmarks.stats import BenchSample, RequestPlan, RequestResult, make_arrivals
from cluster.config import ClusterConfig

POLICIES = "prefix_load,power_of_two,round_robin"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefix scenario (--scenarios prefix)")
    g.add_argument("--tenants", type=int, default=64, help="tenants, each with its own context")
    g.add_argument("--tenant-context-len", type=int, default=2048, help="tokens of a context")
    g.add_argument("--tenant-questions", type=int, default=16, help="questions per tenant")
    g.add_argument("--question-len", type=int, default=128)
    g.add_argument("--answer-len", type=int, default=256)
    g.add_argument("--tenant-rate", type=float, default=16.0, help="requests/s, Poisson")
    g.add_argument("--tenant-concurrency", type=int, default=256, help="most requests in flight")
    g.add_argument(
        "--tenant-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one unmeasured question per tenant first, so the run measures the steady state",
    )
    g.add_argument(
        "--tenant-kv-tokens",
        type=int,
        help="KV capacity per replica (tokens); default 1.5 x tenants x context / replicas",
    )
    g.add_argument("--policies", default=POLICIES, help="router policies to run, in order")
    g.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the low-reuse control (same request lengths, no shared prefix)",
    )
    g.add_argument(
        "--control-requests",
        type=int,
        help="requests of the control; default tenants x questions (fewer keeps a "
        "prefill-bound control short)",
    )
    g.add_argument("--staleness-trials", type=int, default=20, help="0 = no staleness probe")
    g.add_argument(
        "--gpus-per-replica",
        type=float,
        help="num_gpus of a worker replica (0.5: two on one GPU); default the config's",
    )


# -- the workload --------------------------------------------------------------------------------


def tenant_samples(
    args: argparse.Namespace, vocab: int, seed: int
) -> tuple[list[BenchSample], list[BenchSample]]:
    """The warm-up (one question per tenant, in random order; empty with --no-tenant-warmup)
    and every tenant's questions behind its context, the tenants interleaved at random."""
    rng = np.random.default_rng(seed)
    low, high = min(1000, vocab // 4), vocab - 1
    warmup: list[BenchSample] = []
    samples: list[BenchSample] = []
    for _ in range(args.tenants):
        context = rng.integers(low, high, size=args.tenant_context_len).tolist()
        for i in range(args.tenant_questions + 1):
            question = rng.integers(low, high, size=args.question_len).tolist()
            (samples if i else warmup).append(BenchSample(context + question, args.answer_len))
    order = rng.permutation(len(samples))
    warmup = [warmup[i] for i in rng.permutation(len(warmup))] if args.tenant_warmup else []
    return warmup, [samples[i] for i in order]


def control_samples(args: argparse.Namespace, vocab: int, seed: int) -> list[BenchSample]:
    """Requests of the tenants' lengths, each prompt random from its first token."""
    rng = np.random.default_rng(seed)
    low, high = min(1000, vocab // 4), vocab - 1
    length = args.tenant_context_len + args.question_len
    return [
        BenchSample(rng.integers(low, high, size=length).tolist(), args.answer_len)
        for _ in range(control_requests(args))
    ]


def control_requests(args: argparse.Namespace) -> int:
    return args.control_requests or args.tenants * args.tenant_questions


def kv_tokens_per_replica(args: argparse.Namespace) -> int:
    if args.tenant_kv_tokens is not None:
        return int(args.tenant_kv_tokens)
    return int(1.5 * args.tenants * args.tenant_context_len / max(1, args.replicas))


# -- the scenario --------------------------------------------------------------------------------


def prefix_scenario(
    args: argparse.Namespace, base: dict[str, Any], port: int, url: str, vocab: int
) -> dict[str, Any]:
    """Deploy `args.replicas` worker replicas per policy on a running Serve, run the loads."""
    from benchmarks.cluster import _deploy, _hit_rate, _show, _worker_stats, router_cost

    page_size = int(base["engine"].get("advanced", {}).get("page_size", 16))
    kv_tokens = kv_tokens_per_replica(args)
    engine = {**base["engine"], "num_pages": max(1, kv_tokens // page_size)}
    result: dict[str, Any] = {
        "replicas": args.replicas,
        "kv_tokens_per_replica": kv_tokens,
        "shared_context_tokens": args.tenants * args.tenant_context_len,
        "requests": args.tenants * args.tenant_questions,
        "control_requests": control_requests(args),
        "warmup_requests": args.tenants if args.tenant_warmup else 0,
        "policies": {},
    }
    policies = [p for p in args.policies.split(",") if p]
    for i, policy in enumerate(policies):
        config = _config(args, base, engine, port, policy)
        runs: dict[str, Any] = {"deploy_s": _deploy(config)}
        warmup, tenants = tenant_samples(args, vocab, args.seed + 200 + i)
        if warmup:
            start = time.monotonic()
            warm, results = _send(args, url, config.model_name, warmup, args.seed + 100 + i)
            if warm["failed"]:
                raise RuntimeError(f"{policy}: {warm['failed']} warm-up requests failed")
            time.sleep(4 * config.advanced.router.stats_period_s)  # the routers see the pages
            runs["warmup_s"] = time.monotonic() - start
            # where each tenant's first question went: its context's first home
            where = placement(warmup, results, args.tenant_context_len)
            runs["warmup_tenants_per_replica"] = where["tenants_per_replica"]
        loads = {"tenants": tenants}
        if args.control:
            loads["control"] = control_samples(args, vocab, args.seed + 300 + i)
        for load, samples in loads.items():
            before = _worker_stats()
            summary, results = _send(args, url, config.model_name, samples, args.seed + i)
            summary.update(_hit_rate(before, _worker_stats()))
            if load == "tenants":
                summary["placement"] = placement(samples, results, args.tenant_context_len)
            runs[load] = summary
            _show(f"{policy}, {load}", summary)
            print(
                f"    prefix hit rate {summary['prefix_hit_rate']:.3f}, per replica "
                f"{[round(h, 3) for h in summary['per_replica_hit_rate']]}",
                flush=True,
            )
            if "placement" in summary:
                where = summary["placement"]
                print(
                    f"    placement: {where['home_share']:.3f} of the questions on their "
                    f"tenant's replica, tenants per replica {where['tenants_per_replica']}",
                    flush=True,
                )
        result["policies"][policy] = runs
        if i == 0 and args.staleness_trials > 0:
            result["staleness"] = staleness_probe(
                args.staleness_trials, page_size, vocab, args.seed, config
            )
    _compare(result)
    result["router_decision"] = router_cost(
        args.router_replicas, args.router_keys, args.router_prompt_pages, args.router_calls
    )
    return result


def _send(
    args: argparse.Namespace, url: str, model: str, samples: list[BenchSample], seed: int
) -> tuple[dict[str, Any], list[RequestResult]]:
    """`samples` over HTTP with Poisson arrivals at --tenant-rate: the latency summary, and
    each sample's result."""
    measured = asyncio.run(
        http_load(
            url,
            "unused",
            model,
            samples,
            [RequestPlan()] * len(samples),
            make_arrivals(len(samples), args.tenant_rate, 1.0, seed),
            argparse.Namespace(max_concurrency=args.tenant_concurrency, request_timeout=900.0),
            warm_up=False,  # _deploy warmed the replicas; a warm-up would count as misses
        )
    )
    return measured.summary(), measured.results


def placement(
    samples: list[BenchSample], results: list[RequestResult], context_len: int
) -> dict[str, Any]:
    """Where the router put each tenant's questions (from the replica each response names):
    a tenant's home is the replica that served most of them; `home_share` is the share of
    answered questions served at their tenant's home (1.0: no tenant was ever split), and
    `tenants_per_replica` how many homes each replica is, most first."""
    by_tenant: dict[tuple[int, ...], list[str]] = {}
    for sample, result in zip(samples, results, strict=True):
        if result.replica is not None:
            by_tenant.setdefault(tuple(sample.prompt[:context_len]), []).append(result.replica)
    homes: dict[str, int] = {}
    at_home = answered = 0
    for replicas in by_tenant.values():
        home, count = Counter(replicas).most_common(1)[0]
        homes[home] = homes.get(home, 0) + 1
        at_home, answered = at_home + count, answered + len(replicas)
    return {
        "home_share": at_home / answered if answered else 0.0,
        "tenants_per_replica": sorted(homes.values(), reverse=True),
        "questions_away": answered - at_home,
    }


def _config(
    args: argparse.Namespace, base: dict[str, Any], engine: dict[str, Any], port: int, policy: str
) -> ClusterConfig:
    advanced = base.get("advanced", {})
    data = {
        **base,
        "engine": engine,
        "worker_replicas": args.replicas,
        "autoscaling": None,
        "port": port,
        "advanced": {**advanced, "router": {**advanced.get("router", {}), "policy": policy}},
    }
    if args.gpus_per_replica is not None:
        data["worker_resources"] = {"num_gpus": args.gpus_per_replica}
    return ClusterConfig.model_validate(data)


def _compare(result: dict[str, Any]) -> None:
    """One line per policy and load: the figures to set side by side."""
    print(
        "\n  policy        load      hit rate  out tok/s  req/s   TTFT p50/p90 ms   ITL p50/p99 ms"
    )
    for policy, runs in result["policies"].items():
        for load in ("tenants", "control"):
            if load in runs:
                s = runs[load]
                t, i = s["ttft_ms"], s["itl_ms"]
                print(
                    f"  {policy:13} {load:9} {s['prefix_hit_rate']:8.3f} "
                    f"{s['output_throughput']:10.1f} {s['request_throughput']:6.2f} "
                    f"{t['p50']:8.1f} {t['p90']:8.1f} {i['p50']:8.1f} {i['p99']:8.1f}",
                    flush=True,
                )
    if "staleness" in result:
        s = result["staleness"]
        print(f"  router view staleness: p50 {s['ms']['p50']:.0f} ms, max {s['ms']['max']:.0f} ms "
              f"over {s['trials']} prompts (stats period {s['stats_period_s']} s)", flush=True)  # fmt: skip


# -- staleness of the router's view --------------------------------------------------------------


def staleness_probe(
    trials: int, page_size: int, vocab: int, seed: int, config: ClusterConfig
) -> dict[str, Any]:
    """How long after the engine caches a prompt's pages a router ranks by them.

    Per trial, on two replicas A and B: a prompt X (4 pages) is run on B, and the probe waits
    until a router sends X to B. Then P = X + 4 pages more is run on A, and the time its first
    token reaches this process starts the clock (the engine has cached P's pages by then;
    the clock starts late by the token's way here, a few ms). This process's own handle
    (its PrefixLoadRouter, fed by the same Serve updates as every ingress's) is then asked
    every few ms where P would go: B while the router's view of A lacks P (B holds 4 of
    its pages, A none), A once it has it (8). Probes are `info` calls whose hint claims
    nothing, so only the replicas' reports can move the answer."""
    from ray import serve

    from benchmarks.cluster import APP
    from cluster.app import WORKER_NAME
    from worker.engine import SUMMARY_REFRESH_S

    handle = serve.get_deployment_handle(WORKER_NAME, app_name=APP)
    replicas = sorted(r["replica_id"] for r in handle.broadcast("stats").results(timeout_s=60) if r)
    if len(replicas) < 2:
        raise ValueError("the staleness probe needs two worker replicas")
    rng = np.random.default_rng(seed + 400)
    low, high = min(1000, vocab // 4), vocab - 1
    samples_ms, probes = [], []
    for trial in range(trials):
        a, b = replicas[trial % len(replicas)], replicas[(trial + 1) % len(replicas)]
        head = rng.integers(low, high, size=4 * page_size).tolist()
        prompt = head + rng.integers(low, high, size=4 * page_size).tolist()
        _run_on(handle, b, head)
        _wait_routed(handle, head, page_size, b, settle=5)
        cached_at = _run_on(handle, a, prompt)
        seen_at, n = _wait_routed(handle, prompt, page_size, a, settle=1)
        samples_ms.append((seen_at - cached_at) * 1000)
        probes.append(n)
    ms = np.asarray(samples_ms)
    return {
        "trials": trials,
        "ms": {
            "p50": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)),
            "max": float(ms.max()),
        },
        "samples_ms": [round(float(x), 1) for x in ms],
        "probes_per_trial": probes,
        "stats_period_s": config.advanced.router.stats_period_s,
        "engine_summary_refresh_s": SUMMARY_REFRESH_S,
        # Serve's controller loop, which collects and broadcasts the reports (Serve: 0.1 s)
        "control_loop_s": float(os.environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", 0.1)),
    }


def _run_on(handle: Any, replica_id: str, prompt: list[int]) -> float:
    """Run `prompt` for one token on one replica (as an ingress of its own would); when its
    token arrived here (perf_counter)."""
    from cluster.router import RouteHint
    from cluster.transport import Accepted, decode_deltas, decode_first, encode_requests
    from worker.sampling import SamplingParams
    from worker.validation import EngineRequest

    ingress_id, hint = uuid.uuid4().hex[:16], RouteHint(replica_id=replica_id)
    request = EngineRequest(f"staleness-{ingress_id}", prompt, SamplingParams(max_tokens=1))
    submit = handle.options(method_name="submit").remote(
        hint, encode_requests([request]), ingress_id
    )
    answer = decode_first(submit.result(timeout_s=120))
    if not isinstance(answer, Accepted):
        raise RuntimeError(f"the probe prompt was refused: {answer}")
    session = handle.options(method_name="session", stream=True).remote(hint, ingress_id)
    frames = iter(session)
    next(frames)  # the accept frame
    try:
        for frame in frames:
            if any(d.new_token_ids for d in decode_deltas(frame)):
                return time.perf_counter()
    finally:
        session.cancel()
    raise RuntimeError("the probe prompt's session ended without a token")


def _wait_routed(
    handle: Any, prompt: list[int], page_size: int, replica_id: str, settle: int
) -> tuple[float, int]:
    """Ask where `prompt` would be routed until it is `replica_id` `settle` times in a row;
    when that began (perf_counter) and the probes it took."""
    from cluster.router import RouteHint
    from worker.page_hash import page_hashes

    hint = RouteHint(page_hashes=(tuple(page_hashes(prompt, page_size)),))
    probe = handle.options(method_name="info")
    deadline, run_start, in_a_row, n = time.monotonic() + 60, 0.0, 0, 0
    while time.monotonic() < deadline:
        asked = time.perf_counter()
        where = probe.remote(hint).result(timeout_s=30)["replica_id"]
        n += 1
        if where == replica_id:
            run_start = asked if in_a_row == 0 else run_start
            in_a_row += 1
            if in_a_row >= settle:
                return run_start, n
        else:
            in_a_row = 0
        time.sleep(0.002)
    raise TimeoutError(f"no router sent the probe prompt to {replica_id} within 60 s")
