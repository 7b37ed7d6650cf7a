"""`kvray bench soak`: leak checks on a launched server, and the overload burst.

`kvray bench serve`'s load (the same options) with its checks around it: warm up, snapshot every replica (free KV pages, requests in the engine, process memory),
run the load with its cancellations and stop strings, snapshot again; optionally send a
burst past the waiting limit (429 + Retry-After) and check that the server recovers.
`scripts/soak` runs it; docs/reliability.md records the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np

from benchmarks import serve
from benchmarks.common import write_result
from benchmarks.serve import NO_PLAN, http_client, http_request, http_run, local_app, request_plans
from benchmarks.stats import BenchSample, RequestPlan, make_samples


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    parser.add_argument(
        "--warmup-prompts", type=int, default=100, help="requests before RSS is measured"
    )
    parser.add_argument(
        "--overload-requests", type=int, default=0, help="then a burst this large at once"
    )


def run(args: argparse.Namespace) -> int:
    """Exit status 0 when the soak passed (`soak_passed`), 1 otherwise."""
    if args.base_url:
        raise SystemExit("kvray bench soak launches its own server: no --base-url")
    load = serve.prepare(args)
    report = soak_launched(load.config, args, load.samples, load.plans, load.arrivals, load.vocab)
    write_result(args.result_json, "soak", report)
    return 0 if report["passed"] else 1


def soak_launched(
    config: Any,
    args: argparse.Namespace,
    samples: list[BenchSample],
    plans: list[RequestPlan],
    arrivals: np.ndarray,
    vocab: int,
) -> dict[str, Any]:
    """Warm up, snapshot the replicas, run the load, snapshot again (and the overload burst)."""
    model, key = config.model_name, config.api_keys[0] if config.api_keys else "unused"
    report: dict[str, Any] = {
        "args": vars(args),
        "config": config.model_dump(mode="json"),
    }
    with local_app(config) as base_url:
        warm = make_samples(
            args.warmup_prompts, args.input_len, args.output_len, args.range_ratio,
            args.prefix_len, vocab, args.seed + 100,
        )  # fmt: skip
        warm_run = http_run(
            base_url, key, model, warm, request_plans(args, warm), np.zeros(len(warm)), args
        )
        _say(f"soak: warm-up, {len(warm)} requests")
        report["warmup"] = asyncio.run(warm_run)["outcomes"]
        before = replica_snapshot(config.advanced.app_name)
        _say(f"soak: {len(samples)} requests")
        run = http_run(base_url, key, model, samples, plans, arrivals, args, warm_up=False)
        report["run"] = asyncio.run(run)
        report["leaks"] = leak_report(before, replica_snapshot(config.advanced.app_name))
        if args.overload_requests:
            _say(f"soak: overload burst of {args.overload_requests} requests")
            report["overload"] = asyncio.run(
                overload(base_url, key, model, args.overload_requests, vocab, args)
            )
            report["after_overload"] = leak_report(
                before, replica_snapshot(config.advanced.app_name)
            )
    report["passed"] = soak_passed(report)
    print(json.dumps({k: report[k] for k in report if k not in ("args", "config")}, indent=2))
    return report


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def soak_passed(report: dict[str, Any]) -> bool:
    """Nothing lost, no page leaked, nothing stuck, RSS growth under 5 %, recovered."""
    leaks = [report["leaks"], *([report["after_overload"]] if "after_overload" in report else [])]
    lost = report["run"]["outcomes"]["lost"]
    if "overload" in report:
        over = report["overload"]
        lost += over["burst"]["lost"]
        if over["recovery"]["completed"] != over["recovery"]["sent"]:
            return False
    return lost == 0 and all(
        leak["pages_leaked"] == 0 and leak["stuck_requests"] == 0 and leak["max_rss_growth_pct"] < 5
        for leak in leaks
    )


def replica_snapshot(app_name: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Once every worker replica is idle (or after `timeout_s`): each replica's engine
    stats and RSS, and every ingress replica's RSS."""
    from ray import serve

    from cluster.app import INGRESS_NAME, WORKER_NAME

    worker = serve.get_deployment_handle(WORKER_NAME, app_name=app_name)
    ingress = serve.get_deployment_handle(INGRESS_NAME, app_name=app_name)
    start = time.monotonic()
    while True:
        stats = [s for s in worker.broadcast("stats").results(timeout_s=30) if isinstance(s, dict)]
        idle = all(
            s["num_running"] == 0
            and s["num_waiting"] == 0
            and s["num_free_pages"] == s["num_total_pages"]
            for s in stats
        )
        if idle or time.monotonic() - start > timeout_s:
            break
        time.sleep(0.5)
    return {
        "idle": idle,
        "idle_wait_s": round(time.monotonic() - start, 1),
        "workers": {s["replica_id"]: s for s in stats},
        "ingress": {
            s["replica_id"]: s for s in ingress.broadcast("drain_status").results(timeout_s=30)
        },
    }


def _growth_pct(before: dict[str, Any], after: dict[str, Any]) -> float:
    return round(
        100.0 * (after["rss_bytes"] - before["rss_bytes"]) / max(1, before["rss_bytes"]), 2
    )


def _rss_row(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    mib = 1024 * 1024
    return {
        "rss_before_mib": round(before["rss_bytes"] / mib, 1),
        "rss_after_mib": round(after["rss_bytes"] / mib, 1),
        "rss_growth_pct": _growth_pct(before, after),
    }


def leak_report(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Pages not free, requests still in an engine, and RSS growth, per replica."""
    workers = {
        rid: {
            "free_pages": s["num_free_pages"],
            "total_pages": s["num_total_pages"],
            "pages_leaked": s["num_total_pages"] - s["num_free_pages"],
            "stuck_requests": s["num_running"] + s["num_waiting"],
            "faults_injected": s.get("faults_injected", 0),
            **(_rss_row(before["workers"][rid], s) if rid in before["workers"] else {}),
        }
        for rid, s in after["workers"].items()
    }
    ingress = {
        rid: _rss_row(before["ingress"][rid], s)
        for rid, s in after["ingress"].items()
        if rid in before["ingress"]
    }
    growth = [
        row["rss_growth_pct"]
        for row in [*workers.values(), *ingress.values()]
        if "rss_growth_pct" in row
    ]
    return {
        "idle_wait_s": after["idle_wait_s"],
        "pages_leaked": sum(w["pages_leaked"] for w in workers.values()),
        "stuck_requests": sum(w["stuck_requests"] for w in workers.values()),
        "max_rss_growth_pct": max(growth, default=0.0),
        "replicas_replaced": sorted(set(before["workers"]) - set(after["workers"])),
        "workers": workers,
        "ingress": ingress,
    }


async def overload(
    base_url: str,
    api_key: str,
    model: str,
    num: int,
    vocab: int,
    args: argparse.Namespace,
    output_len: int = 32,
) -> dict[str, Any]:
    """`num` requests at once (past the waiting limit: some get 429 + Retry-After; the
    accepted ones must complete within `--request-timeout`), then, once the burst is over,
    a few plain requests that must all succeed (recovery)."""
    burst = make_samples(num, 32, output_len, 0.0, 0, vocab, args.seed + 200)
    burst_args = argparse.Namespace(**{**vars(args), "max_concurrency": num})
    result = await http_run(
        base_url, api_key, model, burst, [NO_PLAN] * num, np.zeros(num), burst_args, warm_up=False
    )
    recovery = make_samples(8, 32, 16, 0.0, 0, vocab, args.seed + 300)
    async with http_client(base_url, 4, 120, api_key) as client:
        outcomes = [(await http_request(client, model, s)).outcome for s in recovery]
    return {
        "burst": {**result["outcomes"], "accepted_e2e_ms": result["e2e_ms"]},
        "recovery": {"sent": len(recovery), "completed": outcomes.count("completed")},
    }
