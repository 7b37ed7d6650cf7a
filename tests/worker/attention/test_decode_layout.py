"""The decode layout chosen by measurement (worker/attention/decode_layout.py): timings to
layouts, layouts to the variant each batch size passes, and the setting that overrides
them. Here the kernels' plan and the timings are stand-ins; tests/gpu/test_kernels.py
times the real kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from worker.attention import decode_layout
from worker.attention.decode_layout import AUTO, HEAD, SPLIT, Choice, choose, pick
from worker.graphs import graph_buckets


def test_a_layout_is_kept_only_where_it_wins_by_the_margin() -> None:
    assert pick(176.9, 196.8) == SPLIT  # ~10 % faster
    assert pick(196.8, 176.9) == HEAD
    assert pick(100.0, 102.0) == AUTO  # 2 %: inside the margin, the rule stands
    assert pick(100.0, 104.0, margin=0.05) == AUTO


def test_each_batch_size_passes_its_buckets_variant() -> None:
    choice = Choice(batches=(8, 16, 24), variants=(AUTO, HEAD, SPLIT))
    assert choice.table(26) == [AUTO] * 9 + [HEAD] * 8 + [SPLIT] * 8 + [AUTO] * 2


def _view_and_workspace(slots: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    meta = torch.device("meta")  # shapes only: nothing here touches the values
    view = SimpleNamespace(k_cache=torch.empty(1, slots, 8, 128, device=meta), k_scale=None,
                           page_size=16)  # fmt: skip
    ws = SimpleNamespace(decode_out=torch.empty(256, 32, 128, dtype=torch.bfloat16, device=meta),
                         num_kv_splits=16)  # fmt: skip
    return view, ws


def test_the_buckets_where_auto_goes_head_major_are_timed_and_each_keeps_its_winner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As an H100 measured: head-major ahead at the smallest such buckets, token-split at
    the largest, a tie between them."""
    monkeypatch.delenv("KVRAY_DECODE_LAYOUT", raising=False)
    monkeypatch.setattr(
        decode_layout.cuda_ops, "decode_plan", lambda b, *a, **k: (HEAD if b >= 66 else SPLIT, 1)
    )
    timed: list[tuple[int, int]] = []

    def fake_time(view, ws, batch: int, context: int) -> tuple[float, float]:
        timed.append((batch, context))
        split = 2.0 * batch
        return split, split * (0.95 if batch < 100 else 1.0 if batch < 130 else 1.05)

    monkeypatch.setattr(decode_layout, "_time_layouts", fake_time)
    buckets = graph_buckets(256)
    choice = choose(*_view_and_workspace(16 + 256 * 4096), buckets)
    head = [b for b in buckets if b >= 66]
    assert timed == [(b, 1024) for b in head]  # every such bucket, 1,024 tokens a request
    assert choice.measured == tuple(head) and choice.context == 1024
    kept = dict(zip(choice.batches, choice.variants, strict=True))
    assert [kept[b] for b in buckets if b < 66] == [AUTO] * len([b for b in buckets if b < 66])
    assert [kept[b] for b in (72, 96, 104, 128, 136, 256)] == [HEAD, HEAD, AUTO, AUTO, SPLIT, SPLIT]
    table = choice.table(256)
    assert table[65] == HEAD and table[97] == AUTO and table[130] == SPLIT and table[64] == AUTO
    assert "B=72 144.0 / 136.8 -> head" in choice.summary()


def test_a_cache_too_small_to_time_keeps_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVRAY_DECODE_LAYOUT", raising=False)
    monkeypatch.setattr(decode_layout.cuda_ops, "decode_plan", lambda b, *a, **k: (HEAD, 1))
    monkeypatch.setattr(decode_layout, "_time_layouts", lambda *a: pytest.fail("timed"))
    choice = choose(*_view_and_workspace(16 + 256 * 128), [128, 256])  # 128 tokens a request
    assert choice == Choice((128, 256), (AUTO, AUTO)) and choice.summary() == ""


def test_the_layout_setting_overrides_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """With KVRAY_DECODE_LAYOUT set the kernels decide: no timing runs (none could here)."""
    monkeypatch.setenv("KVRAY_DECODE_LAYOUT", "split")
    nothing = SimpleNamespace()  # any attribute read would fail
    choice = choose(nothing, nothing, [1, 128, 256])  # type: ignore[arg-type]
    assert choice.variants == (AUTO, AUTO, AUTO) and choice.measured == ()


def test_a_decode_launch_passes_the_variant_of_its_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CudaBackend's launches read `decode_variants` at their row count (a graph's bucket, or
    an eager batch's own size), 0 past its end. No kernel runs: the call is recorded."""
    from worker.attention import cuda
    from worker.attention.cuda import CudaBackend

    passed: list[int] = []
    monkeypatch.setattr(
        cuda.cuda_ops, "decode_attention", lambda *a, variant, **k: passed.append(variant)
    )
    backend = object.__new__(CudaBackend)  # no kernels to build here
    backend.scale = 1.0
    backend.ws = SimpleNamespace(decode_o_part=None, decode_ml_part=None, decode_counters=None)
    backend.decode_variants = Choice((8, 16), (HEAD, SPLIT)).table(16)
    view = SimpleNamespace(k_cache=[None], v_cache=[None], req_to_token=None, page_size=16,
                           k_scale=None, v_scale=None)  # fmt: skip
    for rows in (3, 8, 9, 16, 17):
        backend._decode_rows(0, torch.zeros(rows, 1), view, None, None, None)  # type: ignore[arg-type]
    assert passed == [HEAD, HEAD, SPLIT, SPLIT, AUTO]
