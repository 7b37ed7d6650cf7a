"""FP8 (e4m3) KV rows: the quantizer's error bounds, and the cache that stores them."""

import pytest
import torch

from worker.attention.kv_quant import (
    FP8,
    FP8_MAX,
    SCALE_FLOOR,
    dequantize,
    dequantize_gather,
    quantize_rows,
    store_rows,
)
from worker.cache import KVStorage
from worker.config import EngineConfig
from worker.kv_sizing import auto_num_pages
from worker.model.config import ModelConfig


def _rows(n: int, d: int, seed: int = 0, decades: tuple[int, int] = (-8, 4)) -> torch.Tensor:
    """Rows of normal values, each scaled by 10^u, u uniform in `decades`."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = decades
    mag = 10 ** (torch.rand(n, 1, generator=g) * (hi - lo) + lo)
    return torch.randn(n, d, generator=g) * mag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_half_an_e4m3_step_of_each_rows_max(dtype):
    x = _rows(500, 128, decades=(-3, 3) if dtype == torch.float16 else (-8, 4)).to(dtype)
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (500,)
    back = dequantize(q, scale, torch.float32)
    amax = x.float().abs().amax(-1, keepdim=True)
    assert ((back - x.float()).abs() <= 2**-4 * amax).all()
    # each element to within half a step of its own binade (3 mantissa bits), above subnormals
    big = x.float().abs() >= 2**-6 * scale.unsqueeze(-1)
    assert ((back - x.float()).abs()[big] <= 2**-4 * x.float().abs()[big]).all()
    assert torch.equal(q.float().abs().amax(-1), torch.full((500,), FP8_MAX))  # the full range


def test_zero_rows_stay_zero_with_a_finite_scale():
    x = torch.zeros(3, 64)
    x[1, 5] = -3.0
    q, scale = quantize_rows(x)
    assert scale[0] == scale[2] == torch.tensor(SCALE_FLOOR) * (1.0 / FP8_MAX)
    back = dequantize(q, scale, torch.float32)
    assert torch.equal(back[0], torch.zeros(64)) and torch.equal(back[2], torch.zeros(64))
    assert torch.isclose(back[1, 5], torch.tensor(-3.0)) and back[1].count_nonzero() == 1


def test_the_sign_is_symmetric_and_the_row_max_is_exact():
    x = _rows(64, 64, seed=1)
    q, scale = quantize_rows(x)
    qn, scale_n = quantize_rows(-x)
    assert torch.equal(scale, scale_n) and torch.equal(qn.float(), -q.float())
    back = dequantize(q, scale, torch.float32)
    at = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, at), x.gather(-1, at), rtol=1e-6, atol=0)


def test_the_row_max_maps_to_448_and_nothing_past_it():
    """Saturating: x / scale lands on 448 (within an ulp, clamped) even at bf16's largest values."""
    x = torch.tensor([[3.3e38, -3.3e38, 1.0, 0.0], [1e-6, 5e-7, -1e-6, 0.0]]).to(torch.bfloat16)
    q, scale = quantize_rows(x)
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()
    assert q.float()[:, 0].tolist() == [FP8_MAX, FP8_MAX] and q.float()[0, 1] == -FP8_MAX


def test_dequantize_gather_and_store_rows_index_one_layer():
    cache = torch.zeros(10, 2, 16, dtype=FP8)
    scales = torch.zeros(10, 2)
    x = _rows(8, 16, seed=2).view(4, 2, 16)
    slots = torch.tensor([7, 1, 4, 9])
    store_rows(cache, scales, slots, x)
    q, s = quantize_rows(x)
    assert torch.equal(cache[slots].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales[slots], s)
    got = dequantize_gather(cache, scales, torch.tensor([4, 7]), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 2, 16)
    assert torch.equal(got, dequantize(q[[2, 0]], s[[2, 0]], torch.bfloat16))


def test_fp8_storage_has_scales_and_about_half_the_bytes_of_bf16():
    fp8 = KVStorage(2, 32, 4, 128, FP8, torch.device("cpu"))
    bf16 = KVStorage(2, 32, 4, 128, torch.bfloat16, torch.device("cpu"))
    assert fp8.k_scale is not None and fp8.k_scale.shape == (2, 32, 4) and bf16.k_scale is None
    assert fp8.nbytes == 2 * 2 * 32 * 4 * (128 + 4)
    per_token = {
        d: KVStorage.bytes_per_token(32, 8, d, torch.bfloat16)
        / KVStorage.bytes_per_token(32, 8, d, FP8)
        for d in (64, 128)
    }
    assert per_token[128] == pytest.approx(256 / 132) and per_token[64] == pytest.approx(128 / 68)


def test_the_same_kv_budget_gives_about_twice_the_pages_in_fp8(tiny_model):
    path, _ = tiny_model("llama")
    model = ModelConfig.from_dir(path)
    pages = {}
    for kv in ("auto", "fp8"):
        cfg = EngineConfig(
            model=str(path),
            device="cpu",
            dtype="bfloat16",
            max_running=4096,
            kv_cache_dtype=kv,
            advanced={"max_kv_cpu_gib": 0.01},
        ).resolve(model_max_len=512)
        per_token = KVStorage.bytes_per_token(
            model.num_layers, model.num_kv_heads, model.head_dim, cfg.kv_torch_dtype
        )
        pages[kv] = auto_num_pages(cfg, model, per_token)
    # head_dim 16: 32 bytes of bf16 per row against 16 of e4m3 plus a 4-byte scale
    assert pages["fp8"] / pages["auto"] == pytest.approx(32 / 20, rel=1e-3)


def test_fp8_with_the_cuda_backend_needs_bf16_activations():
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(device="cuda", dtype="float16", kv_cache_dtype="fp8").resolve()
    cfg = EngineConfig(device="cuda", kv_cache_dtype="fp8").resolve()
    assert cfg.dtype == "bfloat16" and cfg.kv_torch_dtype == FP8
    assert EngineConfig(device="cpu", kv_cache_dtype="fp8").resolve().kv_torch_dtype == FP8
    assert EngineConfig(device="cpu").resolve().kv_torch_dtype == torch.float32
