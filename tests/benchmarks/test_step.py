"""`kvray bench step`'s kernel tables (its timings need a GPU)."""

from types import SimpleNamespace

from benchmarks.step import category, device_intervals, idle_spans, kernel_label


def test_kernels_are_labelled_by_bare_name_and_filed_by_kind() -> None:
    names = {
        "void kvray::(anonymous namespace)::gemv_kernel<__nv_bfloat16, 1, false>(kvray::GemvParams)": (
            "gemv_kernel",
            "gemm",
        ),
        "void kvray::(anonymous namespace)::store_kv_kernel(kvray::StoreParams)": (
            "store_kv_kernel",
            "kv store",
        ),
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN": (
            "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN",
            "gemm",
        ),
        "Memcpy DtoD (Device -> Device)": ("Memcpy DtoD", "copy"),
    }
    for name, (label, kind) in names.items():
        assert (kernel_label(name), category(name)) == (label, kind), name


def test_idle_spans_merge_overlapping_kernels_and_rank_the_gaps() -> None:
    # kernels at 10-20 and 15-30 overlap (one busy span), then 40-50 and 52-60; span 0-70
    idle = idle_spans([(52, 60), (10, 20), (40, 50), (15, 30)], 0, 70)
    assert idle["busy_us"] == 20 + 10 + 8
    assert (idle["before_us"], idle["between_us"], idle["after_us"]) == (10, 10 + 2, 10)
    assert idle["longest"] == [[30, 10], [50, 2]]  # (offset, length), longest first
    assert idle["wall_us"] == idle["busy_us"] + 10 + 12 + 10
    assert idle_spans([], 5, 9)["before_us"] == 4  # no kernel: all of it idle


def test_device_intervals_leave_out_the_span_that_covers_every_kernel() -> None:
    """The GPU side of the traced run's own record_function span would merge every kernel
    into one busy interval: no gap would show."""
    from torch.autograd import DeviceType

    def event(start: float, end: float, device: DeviceType, annotation: bool = False):
        return SimpleNamespace(
            time_range=SimpleNamespace(start=start, end=end),
            device_type=device,
            is_user_annotation=annotation,
        )

    events = [
        event(0, 100, DeviceType.CPU),
        event(5, 95, DeviceType.CUDA, annotation=True),
        event(5, 20, DeviceType.CUDA),
        event(60, 95, DeviceType.CUDA),
    ]
    kernels = device_intervals(events)
    assert kernels == [(5, 20), (60, 95)]
    assert idle_spans(kernels, 0, 100)["between_us"] == 40


def test_idle_spans_count_only_what_lies_inside_the_span() -> None:
    """The profiler's warm-up kernel runs before the traced span starts."""
    idle = idle_spans([(-30, -20), (5, 20), (90, 120)], 0, 100)
    assert idle["before_us"] == 5 and idle["after_us"] == 0
    assert idle["busy_us"] == 25 and idle["between_us"] == 70
