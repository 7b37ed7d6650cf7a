"""`kvray bench step`'s kernel tables (its timings need a GPU)."""

from benchmarks.step import category, kernel_label


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
