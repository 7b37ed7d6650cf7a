"""Where a lone request's time to first token goes through Serve: the client's clock, the
ingress's (`kvray:time_to_first_token_seconds`) and the engine's inside the worker
(`kvray:engine_time_to_first_token_seconds`), over sequential streamed requests on an idle
app. client − ingress = the HTTP proxy both ways; ingress − engine = the ingress → worker
call and the first frame's way back; engine = queueing and the prompt step.

    python -m benchmarks.serve_ttft_split [--requests 24] [--prompt-len 64] [--config FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import re
import statistics
import time
from typing import Any

from benchmarks.serve import http_client, local_app
from cluster.config import ClusterConfig

HISTOGRAMS = {
    "ingress": "kvray:time_to_first_token_seconds",
    "engine": "kvray:engine_time_to_first_token_seconds",
}


def _sums(text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram, over all label sets."""
    out = {}
    for key, name in HISTOGRAMS.items():
        total = sum(float(v) for v in re.findall(rf"^{name}_sum{{[^}}]*}} (\S+)$", text, re.M))
        count = sum(float(v) for v in re.findall(rf"^{name}_count{{[^}}]*}} (\S+)$", text, re.M))
        out[key] = (total, count)
    return out


async def _run(
    url: str, model: str, n: int, prompt_len: int, seed: int
) -> tuple[list[float], str, str]:
    ttfts = []
    async with http_client(url, 4, 600.0) as client:
        before = await (await client.get("/metrics")).text()
        for i in range(n):
            prompt = [(seed + 7919 * (i * prompt_len + j)) % 30000 + 100 for j in range(prompt_len)]
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 2,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            }
            start, first = time.perf_counter(), None
            async with client.post("/v1/completions", json=body) as response:
                async for line in response.content:
                    if first is None and line.startswith(b"data: {") and b'"choices"' in line:
                        first = time.perf_counter() - start
            assert first is not None, "no token came back"
            ttfts.append(first)
        after = await (await client.get("/metrics")).text()
    return ttfts, before, after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", help="ClusterConfig YAML (default: the demo model, one worker replica)"
    )
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)
    config = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig()
    with local_app(config) as url:
        asyncio.run(_run(url, config.model_name, 4, args.prompt_len, seed=1))  # warm-up
        ttfts, before, after = asyncio.run(
            _run(url, config.model_name, args.requests, args.prompt_len, seed=2)
        )
    b, a = _sums(before), _sums(after)
    mean = {k: (a[k][0] - b[k][0]) / (a[k][1] - b[k][1]) for k in HISTOGRAMS}
    client = statistics.fmean(ttfts)
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "host": platform.node(),
        "args": vars(args),
        "mean_ttft_ms": {"client": 1e3 * client, **{k: 1e3 * v for k, v in mean.items()}},
        "p50_client_ttft_ms": 1e3 * statistics.median(ttfts),
        "split_ms": {
            "proxy (client - ingress)": 1e3 * (client - mean["ingress"]),
            "ingress -> worker -> ingress (ingress - engine)": 1e3
            * (mean["ingress"] - mean["engine"]),
            "engine (queue + prompt step)": 1e3 * mean["engine"],
        },
    }
    for part, ms in result["split_ms"].items():
        print(f"{part:52} {ms:8.1f} ms")
    print(
        f"{'client TTFT, mean (p50)':52} {1e3 * client:8.1f} ms ({result['p50_client_ttft_ms']:.1f})"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
