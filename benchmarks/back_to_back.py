"""Does a request through Serve wait longer for its first token when it follows another
request at once (as under `kvray bench serve --max-concurrency 1`) than after a pause? At
concurrency 1 the engine's own TTFT is a few ms longer inside the worker replica than beside
the idle app; if the previous request's tail (its last frames, the ingress and the proxy
closing it, the client's bookkeeping) ran into the next prompt's step, a pause would remove it.

    kvray serve -c FILE &     # the app, idle
    python -m benchmarks.back_to_back [--reps 40] [--out FILE]

Each repetition times two streamed completions of 64 random token ids (never a prefix-cache
hit), 16 tokens out: one sent the moment an unmeasured request of the same shape ends, one
after `--pause` seconds idle; the two in alternating order. Prints both sides' median TTFT
and the paired median of (at once - after the pause).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable

import aiohttp

from benchmarks import write_result


async def ttft_ms(
    session: aiohttp.ClientSession, url: str, rng: random.Random, prompt_len: int
) -> float:
    """One streamed completion of random token ids; ms to its first data chunk."""
    prompt = [rng.randrange(1, 40_000) for _ in range(prompt_len)]
    return await streamed_ttft_ms(session, url, prompt)


async def streamed_ttft_ms(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    on_send: Callable[[], None] | None = None,
    on_first: Callable[[], None] | None = None,
) -> float:
    """One streamed completion of `prompt` (16 tokens, greedy); ms to its first data chunk.
    `on_send` and `on_first` run as the request leaves and as its first token arrives."""
    body = {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first = None
    if on_send is not None:
        on_send()
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = 1e3 * (time.perf_counter() - start)
                if on_first is not None:
                    on_first()
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    rng = random.Random(args.seed)
    url = f"{args.base_url}/v1/completions"
    times: dict[str, list[float]] = {"at once": [], "after a pause": []}
    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # warm-up
            await ttft_ms(session, url, rng, args.prompt_len)
        for rep in range(args.reps):
            order = list(times) if rep % 2 == 0 else list(reversed(times))
            for side in order:
                if side == "at once":
                    await ttft_ms(session, url, rng, args.prompt_len)
                else:
                    await asyncio.sleep(args.pause)
                times[side].append(await ttft_ms(session, url, rng, args.prompt_len))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds idle before a request")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)

    times = asyncio.run(run(args))
    for side, values in times.items():
        print(
            f"{side:14s} TTFT median {statistics.median(values):7.1f} ms, mean {statistics.mean(values):7.1f} ms"
        )
    paired = [a - b for a, b in zip(times["at once"], times["after a pause"], strict=True)]
    print(
        f"at once - after a pause, paired median: {statistics.median(paired):+.1f} ms ({args.reps} pairs)"
    )
    write_result(args.out, args, ttft_ms=times, paired_median_ms=statistics.median(paired))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
