"""Dataset, arrival schedule and statistics of `kvray bench serve` (no Ray, no HTTP here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class BenchSample:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What the soak client does with one request: leave before the first byte (after
    `leave_after_s`), leave after `cancel_after_chunks` chunks, and/or send `stop` strings."""

    leave_after_s: float | None = None
    cancel_after_chunks: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def cancels(self) -> bool:
        return self.leave_after_s is not None or self.cancel_after_chunks is not None


# How a request ended, seen from the client. "lost": it neither completed nor got an error
# (the stream broke off, the connection failed, or it outlived its timeout) — must be 0.
Outcome = str
OUTCOMES = ("completed", "stopped", "cancelled", "rejected", "error", "lost")


@dataclass(slots=True)
class RequestResult:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str | None = None
    outcome: Outcome = "completed"
    status: int = 200
    retry_after: str | None = None
    response_id: str | None = None  # the response's `id`
    sent_at: float = 0.0  # time.perf_counter() when it was sent
    replica: str | None = None  # the worker replica that served it (kvray's response header)

    @property
    def ok(self) -> bool:
        finished = self.outcome in ("completed", "stopped")
        return finished and self.error is None and self.ttft is not None


def make_samples(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    vocab: int,
    seed: int,
) -> list[BenchSample]:
    """Random token-id prompts (ids clear of the special tokens at both ends of the vocabulary);
    with `prefix_len`, every prompt opens with the same `prefix_len` tokens."""
    rng = np.random.default_rng(seed)
    low, high = min(1000, vocab // 4), vocab - 1

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num)

    prefix = rng.integers(low, high, size=prefix_len).tolist()
    return [
        BenchSample(prefix + rng.integers(low, high, size=int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(lengths(input_len), lengths(output_len), strict=True)
    ]


def make_plans(
    num: int,
    cancel_fraction: float,
    stop_fraction: float,
    output_lens: list[int],
    stop: tuple[str, ...],
    seed: int,
) -> list[RequestPlan]:
    """A plan per request: `cancel_fraction` of them leave early (half before the first
    byte, after 0-50 ms; half after a random number of chunks), `stop_fraction` send `stop`."""
    rng = np.random.default_rng(seed + 2)
    plans = []
    for n_out in output_lens:
        leave_after_s, cancel_after = None, None
        if rng.random() < cancel_fraction:
            if rng.random() < 0.5:
                leave_after_s = float(rng.uniform(0.0, 0.05))
            else:
                cancel_after = int(rng.integers(1, max(2, n_out)))
        stops = stop if rng.random() < stop_fraction else ()
        plans.append(RequestPlan(leave_after_s, cancel_after, stops))
    return plans


def tally(results: list[RequestResult], plans: list[RequestPlan]) -> dict[str, Any]:
    """Outcome counts of a soak run; `lost` and `unexpected_cancel` must both be 0."""
    counts = {name: sum(r.outcome == name for r in results) for name in OUTCOMES}
    return {
        "requests": len(results),
        **counts,
        "planned_cancellations": sum(p.cancels for p in plans),
        "planned_before_first_byte": sum(p.leave_after_s is not None for p in plans),
        "with_stop_strings": sum(bool(p.stop) for p in plans),
        "rejected_with_retry_after": sum(
            r.outcome == "rejected" and r.retry_after is not None for r in results
        ),
        "statuses": {
            str(code): sum(r.status == code for r in results)
            for code in sorted({r.status for r in results})
        },
        "errors_seen": sorted({r.error for r in results if r.error})[:5],
    }


def make_arrivals(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Arrival offsets in seconds: gamma-distributed gaps with mean 1/rate (Poisson at burstiness 1)."""
    if rate == float("inf"):
        return np.zeros(num)
    rng = np.random.default_rng(seed + 1)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    arr = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


GOODPUT_METRICS = ("ttft", "tpot", "e2e")


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """`--goodput ttft:200 tpot:50` as {"ttft": 0.2, "tpot": 0.05} (seconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        metric, _, ms = pair.partition(":")
        if metric not in GOODPUT_METRICS or not ms:
            raise SystemExit(
                f"--goodput: METRIC:MS with METRIC one of {GOODPUT_METRICS}, not {pair!r}"
            )
        slos[metric] = float(ms) / 1e3
    return slos


def _tpot(r: RequestResult) -> float | None:
    if r.ttft is None or r.output_tokens < 2:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": _tpot(r), "e2e": r.e2e}
    return all((v := values[m]) is None or v <= limit for m, limit in slos.items())


def summarize(
    results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """Throughput and latency figures of one load; with `slos` (`parse_goodput`), goodput:
    the completed requests per second that met every SLO (as `vllm bench serve` counts it)."""
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    tpots = [t for r in ok if (t := _tpot(r)) is not None]
    goodput = {"request_goodput": sum(_meets(r, slos) for r in ok) / duration_s} if slos else {}
    return {
        **goodput,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (output + prompt) / duration_s,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }


@dataclass(slots=True)
class Measured:
    """One side's load, over one round or several (`+`): its requests, the seconds the load
    ran, the machine's CPU meanwhile (/proc/stat jiffies, a `cpu_times` difference) and the
    engine's own figures as (seconds, count) sums, keyed by the summary key of their mean in
    ms (`engine_step_ms`, ...). With `plans`, the summary tallies the outcomes. `extra` goes
    into the summary as it is (the latest round's, where rounds are added)."""

    results: list[RequestResult] = field(default_factory=list)
    seconds: float = 0.0
    jiffies: list[int] | None = None
    sums: dict[str, tuple[float, int]] = field(default_factory=dict)
    plans: list[RequestPlan] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __add__(self, other: Measured) -> Measured:
        jiffies = None
        if self.jiffies is not None and other.jiffies is not None:
            jiffies = [a + b for a, b in zip(self.jiffies, other.jiffies, strict=True)]
        sums = dict(self.sums)
        for key, (seconds, count) in other.sums.items():
            before = sums.get(key, (0.0, 0))
            sums[key] = (before[0] + seconds, before[1] + count)
        plans = None if self.plans is None or other.plans is None else self.plans + other.plans
        return Measured(
            self.results + other.results,
            self.seconds + other.seconds,
            jiffies,
            sums,
            plans,
            self.extra | other.extra,
        )

    def summary(self, slos: dict[str, float] | None = None) -> dict[str, Any]:
        summary = summarize(self.results, self.seconds, slos)
        if self.jiffies is not None:
            summary.update(cpu_shares([0] * len(self.jiffies), self.jiffies))
        for key, (seconds, count) in self.sums.items():
            if count > 0:
                summary[key] = 1e3 * seconds / count
        summary.update(self.extra)
        if self.plans is not None:
            summary["outcomes"] = tally(self.results, self.plans)
        # in sample order, so two sides' lists pair request by request (`paired_lines`)
        summary["ttft_per_request_ms"] = [
            1e3 * r.ttft if r.ok and r.ttft is not None else None for r in self.results
        ]
        return summary


def _stat_cell(metric: str, stat: str) -> Callable[[dict[str, Any]], str]:
    return lambda summary: f"{summary[metric][stat]:.2f}"


def _optional_cell(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda s: f"{s[key]:.2f}" if key in s else "-"


def _busy_stolen_cell(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda s: f"{s[key]:.1f} / {s['cpu_steal_pct']:.2f}" if key in s else "-"


def cpu_times() -> list[int] | None:
    """This machine's CPU time so far, in jiffies, as /proc/stat's first line counts it: user,
    nice, system, idle, iowait, irq, softirq, steal (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def cpu_shares(before: list[int] | None, after: list[int] | None) -> dict[str, float]:
    """The machine's CPU between two `cpu_times`, in % of all its cores' time: busy (neither idle
    nor waiting on I/O nor stolen) and stolen by the hypervisor for other guests. On a VM, steal
    is time the engine wanted and did not get: a side measured with more of it ran on a slower
    machine."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return {}
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta)
    if total <= 0:
        return {}
    user, nice, system, _idle, _iowait, irq, softirq, steal = delta[:8]
    return {
        "cpu_busy_pct": 100 * (user + nice + system + irq + softirq) / total,
        "cpu_steal_pct": 100 * steal / total,
    }


def print_report(summaries: dict[str, dict[str, Any]], args: dict[str, Any]) -> None:
    keys = (
        "num_prompts",
        "input_len",
        "output_len",
        "prefix_len",
        "request_rate",
        "max_concurrency",
    )
    print("\n" + " ".join(f"{k}={args.get(k)}" for k in keys))
    names = list(summaries)
    width = max(24, *(len(n) for n in names))
    print(f"{'':26}" + "".join(f"{n:>{width + 2}}" for n in names))
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("completed / failed", lambda s: f"{s['completed']} / {s['failed']}"),
        ("duration (s)", lambda s: f"{s['duration_s']:.2f}"),
        ("requests/s", lambda s: f"{s['request_throughput']:.2f}"),
        ("output tokens/s", lambda s: f"{s['output_throughput']:.1f}"),
        ("total tokens/s", lambda s: f"{s['total_token_throughput']:.1f}"),
    ]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{metric[:-3].upper()} {stat} (ms)", _stat_cell(metric, stat)))
    optional = (  # rows only some runs have
        ("engine_step_ms", "engine step mean (ms)", _optional_cell),  # the engine's own mean step
        # the ingress's and the engine's own times, from a request's arrival there
        ("ingress_ttft_mean_ms", "ingress TTFT mean (ms)", _optional_cell),
        ("engine_ttft_mean_ms", "engine TTFT mean (ms)", _optional_cell),
        ("engine_queue_mean_ms", "engine queue mean (ms)", _optional_cell),
        ("request_goodput", "goodput (requests/s)", _optional_cell),
        # this machine's CPU during the load (/proc/stat): all of it busy, and stolen by the host
        ("cpu_busy_pct", "CPU busy / stolen (%)", _busy_stolen_cell),
    )
    for key, title, cell_of in optional:
        if any(key in summaries[n] for n in names):
            rows.append((title, cell_of(key)))
    for title, cell in rows:
        print(f"{title:26}" + "".join(f"{cell(summaries[n]):>{width + 2}}" for n in names))
    for line in comparisons(summaries):
        print(line)
    for name in names:
        for error in summaries[name]["errors"]:
            print(f"{name}: error: {error}")


def comparisons(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """The differences the report ends with: the Serve side (first) less the in-process
    engine (last, the reference)."""
    names = list(summaries)
    if len(names) < 2:
        return []
    serve, alone = summaries[names[0]], summaries[names[-1]]
    ttft = serve["ttft_ms"]["p50"] - alone["ttft_ms"]["p50"]
    itl = serve["itl_ms"]["p50"] - alone["itl_ms"]["p50"]
    ratios = (s["itl_ms"]["p99"] / s["itl_ms"]["p50"] for s in (serve, alone))
    return [
        "",
        f"serve - engine: TTFT p50 {ttft:+.2f} ms, ITL p50 {itl:+.2f} ms",
        "ITL p99 / p50: serve {:.2f}, engine {:.2f}".format(*ratios),
    ]


def round_lines(rounds: list[dict[str, dict[str, Any]]]) -> list[str]:
    """The differences of `comparisons`, round by round (`kvray bench serve --rounds`), each
    summary named as there; with their median. Where the machine's speed drifts between a
    run's phases, their spread is the difference's uncertainty."""
    if len(rounds) < 2 or len(rounds[0]) < 2:
        return []

    def ttft_p50(side: dict[str, Any]) -> float:
        return float(side["ttft_ms"]["p50"])

    lines = []
    for title, a, b in _compared(len(rounds[0])):
        diffs = []
        for sides in rounds:
            summaries = list(sides.values())
            diffs.append(ttft_p50(summaries[a]) - ttft_p50(summaries[b]))
        listed = ", ".join(f"{d:+.1f}" for d in diffs)
        lines.append(
            f"{title}, TTFT p50 by round (ms): {listed}; median {float(np.median(diffs)):+.1f}"
        )
    return lines


def _compared(num_sides: int) -> list[tuple[str, int, int]]:
    """`comparisons`' difference as (title, minuend, subtrahend) indices of the sides."""
    return [("serve - engine", 0, -1)] if num_sides >= 2 else []


def opening_lines(rounds: list[dict[str, dict[str, Any]]], opening: int) -> list[str]:
    """`paired_lines` for each round's first `opening` requests and for the rest, apart. A
    closed loop (`--max-concurrency`, no `--request-rate`) opens every round with a burst at an
    idle engine: in-process its requests arrive at one instant and share one prompt step;
    through Serve they arrive a few ms apart. The rest is the steady load."""
    if (
        not rounds
        or len(rounds[0]) < 2
        or any("ttft_per_request_ms" not in s for r in rounds for s in r.values())
    ):
        return []
    lines = []
    for title, a, b in _compared(len(rounds[0])):
        first: tuple[list[float | None], list[float | None]] = ([], [])
        rest: tuple[list[float | None], list[float | None]] = ([], [])
        for sides in rounds:
            summaries = list(sides.values())
            x, y = summaries[a]["ttft_per_request_ms"], summaries[b]["ttft_per_request_ms"]
            first[0].extend(x[:opening])
            first[1].extend(y[:opening])
            rest[0].extend(x[opening:])
            rest[1].extend(y[opening:])
        if (f := paired_difference(*first)) is not None and (
            r := paired_difference(*rest)
        ) is not None:
            lines.append(
                f"{title}, TTFT paired: each round's first {opening} median {f['median']:+.1f} ms "
                f"({f['pairs']} pairs), the rest {r['median']:+.1f} ms ({r['pairs']} pairs)"
            )
    return lines


def paired_difference(
    x: list[float | None], y: list[float | None], seed: int = 0
) -> dict[str, float] | None:
    """The median of x[i] - y[i] over the requests both sides completed, and a 95 % bootstrap
    interval for it (2,000 resamples); None with fewer than 8 pairs.

    Both sides sent the same prompts, so each pair shares its prompt length, which on its own
    moves a first token by hundreds of ms on a CPU; the difference of the two sides' p50s
    carries that spread, the paired median does not."""
    diffs = np.array([a - b for a, b in zip(x, y, strict=True) if a is not None and b is not None])
    if len(diffs) < 8:
        return None
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(diffs, size=(2000, len(diffs))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return {
        "median": float(np.median(diffs)),
        "low": float(low),
        "high": float(high),
        "pairs": len(diffs),
    }


def paired_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """`comparisons`' TTFT differences, paired by request (`paired_difference`)."""
    names = list(summaries)
    if len(names) < 2 or not all("ttft_per_request_ms" in summaries[n] for n in names):
        return []
    ttfts = [summaries[n]["ttft_per_request_ms"] for n in names]
    lines = []
    for title, a, b in _compared(len(names)):
        if (d := paired_difference(ttfts[a], ttfts[b])) is not None:
            lines.append(
                f"{title}, TTFT paired by request: median {d['median']:+.1f} ms "
                f"(95 % interval {d['low']:+.1f} to {d['high']:+.1f}, {d['pairs']} pairs)"
            )
    return lines
