"""The FP8 (e4m3) KV cache kernels (GPU only): store_kv quantizes to kv_quant's exact bytes
and scales, and decode over e4m3 + scales matches float32 attention over `dequantize`.

Rows get magnitudes spread over five decades (one scale per token and kv head must follow
them), pages are scattered as in test_kernels.py, and outputs start as NaN.

Decode is held to the error its bf16 MMAs allow, not to test_kernels.py's fixed tolerance:
like every bf16 attention kernel it rounds the softmax weights P (here with V's scale
folded in) to bf16, so an output element may be off by up to 2^-9 sum(p |v|) and its own
rounding, 2^-9 |out|. With V rows up to 100x apart that exceeds atol 0.02 where large
values cancel: an exact emulation of these numerics on CPU (float32 weights rounded to
bf16, exact e4m3 values) put 11 of 82,944 elements past check_close, at most 0.75 off, and
every one inside the bound. On the H200 (2026-12-04) every case holds that bound.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_kernels import DEV, LENS, Paged, attend, check_close, decode_buffers, make_paged
from worker.attention import cuda_ops
from worker.attention.kv_quant import FP8, dequantize, quantize_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    cuda_ops.load(verbose=False)


def spread_rows(x: torch.Tensor) -> torch.Tensor:
    """x with each row (last dim) scaled by 10^u, u uniform in [-3, 2]."""
    mag = 10 ** (torch.rand(x.shape[:-1], device=x.device) * 5 - 3)
    return (x.float() * mag.unsqueeze(-1)).to(x.dtype)


class Fp8Paged:
    """A Paged cache quantized: e4m3 K/V, their scales, and the float32 dequantized K/V."""

    def __init__(self, kv: Paged):
        self.kv = kv
        self.k, self.k_scale = quantize_rows(spread_rows(kv.k_cache))
        self.v, self.v_scale = quantize_rows(spread_rows(kv.v_cache))
        self.k_ref = dequantize(self.k, self.k_scale, torch.float32)
        self.v_ref = dequantize(self.v, self.v_scale, torch.float32)

    def decode(self, q: torch.Tensor, splits_cap: int, **kw) -> torch.Tensor:
        out, o_part, ml_part = decode_buffers(
            q.shape[0], q.shape[1], q.shape[2], q.dtype, splits_cap
        )
        kv = self.kv
        cuda_ops.decode_attention(
            q, self.k, self.v, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, kv.page_size,
            q.shape[2] ** -0.5, out, o_part, ml_part, k_scale=self.k_scale, v_scale=self.v_scale,
            **kw,
        )  # fmt: skip
        torch.cuda.synchronize()
        return out

    def reference(self, q: torch.Tensor) -> torch.Tensor:
        return self.reference_and_bound(q)[0]

    def reference_and_bound(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 attention over the dequantized K/V, and sum(p |v|) per output element."""
        outs, bounds = [], []
        for b, n in enumerate(self.kv.seq_lens.tolist()):
            if n == 0:
                outs.append(torch.zeros_like(q[b : b + 1], dtype=torch.float32))
                bounds.append(outs[-1])
                continue
            sl = self.kv.slots[b][:n]
            pos = torch.tensor([n - 1], device=DEV)
            k, v, scale = self.k_ref[sl], self.v_ref[sl], q.shape[2] ** -0.5
            outs.append(attend(q[b : b + 1], k, v, scale, pos))
            bounds.append(attend(q[b : b + 1], k, v.abs(), scale, pos))
        return torch.cat(outs), torch.cat(bounds)

    def check(self, out: torch.Tensor, q: torch.Tensor) -> None:
        """`out` within bf16 rounding of P and of itself (module docstring), with 2x margin:
        a wrong scale, token or page is off by about |v|, far past it."""
        ref, weighted = self.reference_and_bound(q)
        assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or broken)"
        err = (out.float() - ref).abs()
        allowed = 2**-8 * (weighted + ref.abs()) + 1e-6
        worst = (err - allowed).flatten().argmax()
        assert (err <= allowed).all(), (
            f"{int((err > allowed).sum())} of {err.numel()} elements past the bound; worst "
            f"{err.flatten()[worst].item():.3g} > {allowed.flatten()[worst].item():.3g}"
        )


def fp8_paged(lens: list[int], page: int, hkv: int, d: int, **kw) -> Fp8Paged:
    return Fp8Paged(make_paged(lens, page, hkv, d, torch.bfloat16, **kw))


GQA = [(8, 8), (12, 4), (32, 8), (16, 2), (32, 1)]


def decode_cases() -> list[tuple]:
    return [
        (d, hq, hkv, (16, 1, 16, 8, 16)[i % 5], LENS[(i + j) % len(LENS)])
        for j, d in enumerate((64, 128))
        for i, (hq, hkv) in enumerate(GQA)
    ]


@pytest.mark.parametrize(("d", "hq", "hkv", "page", "lens"), decode_cases())
def test_fp8_decode_matches_attention_over_dequantize(d, hq, hkv, page, lens) -> None:
    cache = fp8_paged(lens, page, hkv, d)
    q = spread_rows(torch.randn(len(lens), hq, d, device=DEV).to(torch.bfloat16))
    cache.check(cache.decode(q, cuda_ops.recommended_max_splits(max(lens))), q)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("variant", [1, 5])
def test_fp8_decode_forced_splits_and_variants(num_splits: int, variant: int) -> None:
    lens = [1, 63, 64, 65, 1500, 4000, 20]
    cache = fp8_paged(lens, 16, 8, 128)
    q = torch.randn(len(lens), 32, 128, device=DEV).to(torch.bfloat16)
    cache.check(cache.decode(q, 64, num_splits=num_splits, variant=variant), q)


@pytest.mark.parametrize("variant", [1, 5])
def test_fp8_decode_merged_by_the_last_split_gives_the_combine_kernels_bits(variant: int):
    lens = [1, 0, 63, 1500, 4000, 20]
    cache = fp8_paged(lens, 16, 8, 128, capacity=[max(n, 1) for n in lens])
    q = torch.randn(len(lens), 32, 128, device=DEV).to(torch.bfloat16)
    counters = torch.zeros(len(lens) * 32, dtype=torch.int32, device=DEV)
    for splits in (2, 7, 64):
        want = cache.decode(q, 64, num_splits=splits, variant=variant)
        got = cache.decode(q, 64, num_splits=splits, variant=variant, counters=counters)
        assert torch.equal(got, want), f"splits={splits}: {int((got != want).sum())} differ"
        assert not counters.any()


@pytest.mark.parametrize(("d", "hq", "hkv"), [(128, 32, 8), (64, 9, 3)])
def test_fp8_decode_large_batch_head_major_path(d: int, hq: int, hkv: int) -> None:
    batch = torch.cuda.get_device_properties(0).multi_processor_count + 8
    lens = torch.randint(1, 300, (batch,)).tolist()
    cache = fp8_paged(lens, 16, hkv, d)
    q = torch.randn(batch, hq, d, device=DEV).to(torch.bfloat16)
    assert cuda_ops.decode_plan(batch, hq, hkv, d, torch.bfloat16, 16, kv_fp8=True)[0] == 5
    cache.check(cache.decode(q, 16), q)


def test_fp8_decode_zero_rows_and_empty_sequences() -> None:
    """All-zero K/V rows (scale at its floor) stay zero; an empty sequence gives zeros."""
    cache = fp8_paged([0, 40, 300], 16, 2, 64, capacity=[16, 40, 300])
    zero = cache.kv.slots[2][100:200]
    for t, s in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        t.view(torch.uint8)[zero] = 0
        s[zero] = 1e-12 / 448
    cache.k_ref[zero], cache.v_ref[zero] = 0.0, 0.0
    q = torch.randn(3, 4, 64, device=DEV).to(torch.bfloat16)
    for splits in (1, 8):
        out = cache.decode(q, 8, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        check_close(out[1:], cache.reference(q)[1:], torch.bfloat16)


def test_fp8_decode_graph_replay_follows_live_lengths_and_is_deterministic() -> None:
    cap = [2000, 700, 64, 1300]
    cache = fp8_paged([10, 10, 10, 10], 16, 8, 128, capacity=cap)
    kv = cache.kv
    q = torch.randn(len(cap), 32, 128, device=DEV).to(torch.bfloat16)
    out, o_part, ml_part = decode_buffers(len(cap), 32, 128, torch.bfloat16, 32)

    def call() -> None:
        cuda_ops.decode_attention(
            q, cache.k, cache.v, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, 16,
            128**-0.5, out, o_part, ml_part, k_scale=cache.k_scale, v_scale=cache.v_scale,
        )  # fmt: skip

    call()  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in ([1, 1, 1, 1], [2000, 5, 64, 1299], [33, 700, 17, 1300]):
        kv.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        cache.check(out, q)
        first = out.clone()
        call()
        torch.cuda.synchronize()
        assert torch.equal(out, first)  # eager equals the graph, bit for bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "d"), [(1, 128), (7, 64), (300, 128), (1000, 64)])
def test_fp8_store_kv_writes_quantize_rows_bytes_and_scales(dtype, t: int, d: int) -> None:
    hkv, n_slots = 4, 2048
    k_cache = torch.randn(n_slots, hkv, d, device=DEV).to(FP8)
    v_cache = torch.randn(n_slots, hkv, d, device=DEV).to(FP8)
    k_scale = torch.rand(n_slots, hkv, device=DEV)
    v_scale = torch.rand(n_slots, hkv, device=DEV)
    qkv = spread_rows(torch.randn(t, 8 + 2 * hkv, d, device=DEV).to(dtype))
    qkv[0, 8] = 0  # an all-zero K row: scale at the floor, bytes zero
    k, v = qkv[:, 8 : 8 + hkv], qkv[:, 8 + hkv :]  # strided, as from a fused projection
    loc = torch.randperm(n_slots, device=DEV)[:t]
    if t > 1:
        loc[t // 2] = -1  # skipped (padding)
    refs = [x.clone() for x in (k_cache, v_cache, k_scale, v_scale)]
    keep = loc >= 0
    for x, cache, scale in ((k, refs[0], refs[2]), (v, refs[1], refs[3])):
        qx, sx = quantize_rows(x[keep])
        cache.view(torch.uint8)[loc[keep]] = qx.view(torch.uint8)
        scale[loc[keep]] = sx
    cuda_ops.store_kv(k, v, k_cache, v_cache, loc, k_scale, v_scale)
    torch.cuda.synchronize()
    for got, want in zip((k_cache, v_cache, k_scale, v_scale), refs, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_fp8_bad_arguments_raise() -> None:
    cache = fp8_paged([5], 16, 2, 64)
    kv = cache.kv
    q = torch.randn(1, 4, 64, device=DEV).to(torch.bfloat16)
    out, o_part, ml_part = decode_buffers(1, 4, 64, torch.bfloat16, 4)
    args = (q, cache.k, cache.v, kv.req_to_token, kv.req_pool_indices, kv.seq_lens, 16, 0.125)
    with pytest.raises(RuntimeError, match="k_scale"):
        cuda_ops.decode_attention(*args, out, o_part, ml_part)
    with pytest.raises(RuntimeError, match="float32"):
        cuda_ops.decode_attention(
            *args, out, o_part, ml_part, k_scale=cache.k_scale.half(), v_scale=cache.v_scale
        )
    with pytest.raises(RuntimeError, match="FP8"):
        qo = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
        cuda_ops.prefill_attention(*args[:6], qo, 16, 0.125, out)
