"""Decode attention's layout for large batches, chosen by measurement at engine start.

Once a batch gives every SM a block, `auto` switches decode attention from the token-split
layout (variant 1: a block per (request, KV head, slice of the sequence)) to the head-major
one (variant 5: a block per request and four KV heads, over the whole sequence). Which is
faster depends on the GPU and the batch: head-major was 3-6 % faster at B=128 on an H200
(2026-11-29); on an H100 it is ~4 % faster at B=72 and ~4 % slower at B=256 (2026-12-07;
docs/performance.md). So before the decode graphs are captured, the engine times both on
its own KV cache, at the first batch where `auto` switches and at the largest, and takes a
layout only where it wins at both by `MARGIN`; otherwise `auto`'s rule stands.
KVRAY_DECODE_LAYOUT, when set, decides instead (in the kernels, for every automatic launch).
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.attention import cuda_ops
from worker.cache_view import CacheView
from worker.workspace import InferenceWorkspace

log = logging.getLogger("kvray.attention")

AUTO, SPLIT, HEAD = 0, 1, 5  # decode.cu's automatic pick and its kAutoSplit / kAutoHead
MARGIN = 0.03  # a layout must be this much faster at every measured batch to be kept
CONTEXT = 1024  # tokens of KV a request, where the cache has room for them
MIN_CONTEXT = 256  # less, and the timing says little about serving lengths: keep the rule
REPS = 15


def pick(split_us: Sequence[float], head_us: Sequence[float], margin: float = MARGIN) -> int:
    """SPLIT or HEAD where it is `margin` faster than the other at every measured batch, else
    AUTO (the kernels' rule)."""
    pairs = list(zip(split_us, head_us, strict=True))
    if pairs and all(s < h * (1 - margin) for s, h in pairs):
        return SPLIT
    if pairs and all(h < s * (1 - margin) for s, h in pairs):
        return HEAD
    return AUTO


@dataclass(frozen=True)
class Choice:
    """The variant decode launches pass, and the timings it came from (none: not measured)."""

    variant: int
    batches: tuple[int, ...] = ()
    context: int = 0
    split_us: tuple[float, ...] = ()
    head_us: tuple[float, ...] = ()


def choose(view: CacheView, ws: InferenceWorkspace, batches: Sequence[int]) -> Choice:
    """The variant the engine's decode launches pass (AUTO, SPLIT or HEAD), from timing
    both layouts over layer 0 of `view`'s cache at the batches where `auto` would switch."""
    if os.environ.get("KVRAY_DECODE_LAYOUT"):
        return Choice(AUTO)
    num_heads, head_dim = ws.decode_out.shape[1:]
    num_kv_heads = view.k_cache.shape[2]
    kv_fp8 = view.k_scale is not None
    max_splits = ws.num_kv_splits
    head = [
        b
        for b in batches
        if cuda_ops.decode_plan(
            b, num_heads, num_kv_heads, head_dim, ws.decode_out.dtype, max_splits, kv_fp8=kv_fp8
        )[0]
        == HEAD
    ]
    if not head:
        return Choice(AUTO)  # auto never leaves the token-split layout at these batches
    measured = tuple(sorted({head[0], head[-1]}))
    page = view.page_size
    # every request its own slots, past the scratch page: the reads are HBM's, not L2's
    slots = view.k_cache.shape[1] - page
    context = min(CONTEXT, slots // measured[-1] // page * page)
    if context < MIN_CONTEXT:
        return Choice(AUTO)
    timed = [_time_layouts(view, ws, b, context) for b in measured]
    split_us, head_us = tuple(t[0] for t in timed), tuple(t[1] for t in timed)
    choice = Choice(pick(split_us, head_us), measured, context, split_us, head_us)
    log.info(
        "decode layout: %s (µs at B=%s, %d tokens each: token-split %s, head-major %s)",
        {AUTO: "auto's rule", SPLIT: "token-split", HEAD: "head-major"}[choice.variant],
        "/".join(map(str, measured)),
        context,
        " / ".join(f"{t:.1f}" for t in split_us),
        " / ".join(f"{t:.1f}" for t in head_us),
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
