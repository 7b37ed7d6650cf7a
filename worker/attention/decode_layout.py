"""Decode attention's layout for large batches, chosen by measurement at engine start.

Once a batch gives every SM a block, `auto` switches decode attention from the token-split
layout (variant 1: a block per (request, KV head, slice of the sequence)) to the head-major
one (variant 5: a block per request and four KV heads, over the whole sequence). Which is
faster depends on the GPU and the batch: head-major was 3-6 % faster at B=128 on an H200
(2026-11-29); on an H100 it is ~4 % faster at B=72 and ~4 % slower at B=256 (2026-12-07;
docs/performance.md). So before the decode graphs are captured, the engine times both on
its own KV cache at every batch bucket where `auto` goes head-major, and takes a layout at a
bucket where it wins by `MARGIN`; elsewhere `auto`'s rule stands. KVRAY_DECODE_LAYOUT, when
set, decides instead, in the kernels: `split` or `head` for every automatic launch, any other
value (`rule`) the rule unmeasured.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.attention import cuda_ops
from worker.cache_view import CacheView
from worker.workspace import InferenceWorkspace

log = logging.getLogger("kvray.attention")

AUTO, SPLIT, HEAD = 0, 1, 5  # decode.cu's automatic pick and its kAutoSplit / kAutoHead
MARGIN = 0.03  # a layout must be this much faster at a bucket to be kept there
CONTEXT = 1024  # tokens of KV a request, where the cache has room for them
MIN_CONTEXT = 256  # less, and the timing says little about serving lengths: keep the rule
REPS = 15


def pick(split_us: float, head_us: float, margin: float = MARGIN) -> int:
    """SPLIT or HEAD where it is `margin` faster than the other, else AUTO (the kernels' rule)."""
    if split_us < head_us * (1 - margin):
        return SPLIT
    if head_us < split_us * (1 - margin):
        return HEAD
    return AUTO


@dataclass(frozen=True)
class Choice:
    """The variant decode launches pass in each batch bucket (`variants[i]` for batches up to
    `batches[i]`, AUTO past the last), and the timings of the buckets where `auto` goes
    head-major (`measured`), `context` tokens a request."""

    batches: tuple[int, ...] = ()
    variants: tuple[int, ...] = ()
    measured: tuple[int, ...] = ()
    context: int = 0
    split_us: tuple[float, ...] = ()
    head_us: tuple[float, ...] = ()

    def summary(self) -> str:
        """The measured buckets: µs token-split / head-major, and the layout kept."""
        kept = dict(zip(self.batches, self.variants, strict=True))
        names = {AUTO: "rule", SPLIT: "split", HEAD: "head"}
        return ", ".join(
            f"B={b} {s:.1f} / {h:.1f} -> {names[kept[b]]}"
            for b, s, h in zip(self.measured, self.split_us, self.head_us, strict=True)
        )

    def table(self, max_batch: int) -> list[int]:
        """The variant of each batch size 0..max_batch: its bucket's, as its CUDA graph runs."""
        return [
            self.variants[i] if (i := bisect_left(self.batches, b)) < len(self.batches) else AUTO
            for b in range(max_batch + 1)
        ]


def choose(view: CacheView, ws: InferenceWorkspace, batches: Sequence[int]) -> Choice:
    """Each batch bucket's variant (ascending `batches`: the decode graphs' buckets), from
    timing both layouts over layer 0 of `view`'s cache at the buckets where `auto` would go
    head-major; AUTO at every other bucket, and at all of them with KVRAY_DECODE_LAYOUT set."""
    batches = tuple(batches)
    unmeasured = Choice(batches, (AUTO,) * len(batches))
    if os.environ.get("KVRAY_DECODE_LAYOUT"):
        return unmeasured
    num_heads, head_dim = ws.decode_out.shape[1:]
    num_kv_heads = view.k_cache.shape[2]
    kv_fp8 = view.k_scale is not None
    dtype, max_splits = ws.decode_out.dtype, ws.num_kv_splits
    head = tuple(
        b
        for b in batches
        if cuda_ops.decode_plan(
            b, num_heads, num_kv_heads, head_dim, dtype, max_splits, kv_fp8=kv_fp8
        )[0]
        == HEAD
    )
    page = view.page_size
    # every request its own slots, past the scratch page: the reads are HBM's, not L2's
    slots = view.k_cache.shape[1] - page
    context = min(CONTEXT, slots // head[-1] // page * page) if head else 0
    if context < MIN_CONTEXT:  # nothing to decide, or too little room to time it
        return unmeasured
    start = time.perf_counter()
    timed = [_time_layouts(view, ws, b, context) for b in head]
    picked = dict(zip(head, (pick(s, h) for s, h in timed), strict=True))
    choice = Choice(
        batches,
        tuple(picked.get(b, AUTO) for b in batches),
        head,
        context,
        tuple(t[0] for t in timed),
        tuple(t[1] for t in timed),
    )
    log.info(
        "decode layout, measured in %.2f s at %d tokens a request (µs token-split / "
        "head-major -> kept): %s",
        time.perf_counter() - start,
        context,
        choice.summary(),
    )
    return choice


def _time_layouts(
    view: CacheView, ws: InferenceWorkspace, batch: int, context: int
) -> tuple[float, float]:
    """Median µs of one decode launch of `batch` requests of `context` tokens, token-split
    then head-major, alternated so that clocks drifting meanwhile touch both alike."""
    device = view.k_cache.device
    num_heads, head_dim = ws.decode_out.shape[1:]
    q = torch.randn(batch, num_heads, head_dim, device=device).to(ws.decode_out.dtype)
    table = view.page_size + torch.arange(batch * context, dtype=torch.int32, device=device)
    table = table.view(batch, context)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    k_scale = view.k_scale[0] if view.k_scale is not None else None
    v_scale = view.v_scale[0] if view.v_scale is not None else None

    def launch(variant: int) -> None:
        cuda_ops.decode_attention(
            q, view.k_cache[0], view.v_cache[0], table, rows, lens, view.page_size,
            head_dim**-0.5, ws.decode_out[:batch], ws.decode_o_part, ws.decode_ml_part,
            variant=variant, k_scale=k_scale, v_scale=v_scale, counters=ws.decode_counters,
        )  # fmt: skip

    times: dict[int, list[float]] = {SPLIT: [], HEAD: []}
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for rep in range(REPS + 2):
        for variant in (SPLIT, HEAD):
            events[0].record()
            launch(variant)
            events[1].record()
            events[1].synchronize()
            if rep >= 2:  # the first two warm up
                times[variant].append(events[0].elapsed_time(events[1]) * 1e3)
    return statistics.median(times[SPLIT]), statistics.median(times[HEAD])
