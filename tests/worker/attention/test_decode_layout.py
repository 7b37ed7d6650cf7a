"""The decode layout chosen by measurement (worker/attention/decode_layout.py): the rule
that turns timings into a layout, and the setting that overrides it. The timing itself
runs on a GPU (tests/gpu/test_kernels.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker.attention.decode_layout import AUTO, HEAD, SPLIT, choose, pick


def test_a_layout_is_kept_only_where_it_wins_every_measured_batch_by_the_margin() -> None:
    assert pick([176.9, 350.0], [196.8, 389.3]) == SPLIT  # ~10 % faster at both
    assert pick([196.8, 389.3], [176.9, 350.0]) == HEAD
    assert pick([176.9, 389.3], [196.8, 350.0]) == AUTO  # each wins one batch
    assert pick([100.0, 200.0], [102.0, 204.0]) == AUTO  # 2 %: inside the margin
    assert pick([100.0], [104.0], margin=0.05) == AUTO
    assert pick([], []) == AUTO


def test_the_layout_setting_overrides_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """With KVRAY_DECODE_LAYOUT set the kernels decide: no timing runs (none could here)."""
    monkeypatch.setenv("KVRAY_DECODE_LAYOUT", "split")
    nothing = SimpleNamespace()  # any attribute read would fail
    assert choose(nothing, nothing, [1, 128, 256]).variant == AUTO  # type: ignore[arg-type]
