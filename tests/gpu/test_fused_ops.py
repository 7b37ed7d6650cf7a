"""csrc's fused layer ops vs HF transformers' torch op sequence on the GPU: bit for bit.

Each op must give exactly the tensor the torch sequence gives (torch.equal), on fresh
random inputs (never zeros), in bf16, fp16 and fp32, for row lengths that are and are not
multiples of the vector width, for batch sizes that change torch's own reduction layout,
and on strided q/k views of a fused qkv projection.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.attention import cuda_ops
from worker.model.layers import apply_rope, rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-5
# Row lengths: scalar reduction (< 128), unaligned rows (N % 4 != 0), the demo (576) and
# Llama-3-8B (4096) hidden sizes, 2050 (the one-row-per-block kernel on unaligned rows),
# and 8192, where torch splits a row across warps.
HIDDEN = [64, 100, 130, 576, 1000, 2050, 4096, 8192]
TOKENS = [1, 2, 3, 5, 8, 16, 33, 130, 1000]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    cuda_ops.load()


def _rand(*shape: int, dtype: torch.dtype, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want) & ~(got.isnan() & want.isnan())
    return f"{int(bad.sum())}/{want.numel()} elements differ"


def _check_all(failures: list[str]) -> None:
    assert not failures, "; ".join(failures[:12]) + f" ({len(failures)} cases)"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch_bit_for_bit(dtype):
    torch.manual_seed(0)
    failures = []
    for n in HIDDEN:
        w = _rand(n, dtype=dtype, scale=1.0)
        for t in TOKENS:
            x = _rand(t, n, dtype=dtype)
            want = rms_norm(x, w, EPS)
            out = torch.full_like(x, float("nan"))
            cuda_ops.rms_norm(x, w, EPS, out)
            if not torch.equal(out, want):
                failures.append(f"N={n} T={t}: {_diff(out, want)}")
    _check_all(failures)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_torch_bit_for_bit(dtype):
    torch.manual_seed(1)
    failures = []
    for n in HIDDEN:
        w = _rand(n, dtype=dtype, scale=1.0)
        for t in TOKENS:
            x, residual = _rand(t, n, dtype=dtype), _rand(t, n, dtype=dtype, scale=8.0)
            want_res = residual + x
            want = rms_norm(want_res, w, EPS)
            cuda_ops.fused_add_rms_norm(x, residual, w, EPS)
            if not (torch.equal(residual, want_res) and torch.equal(x, want)):
                failures.append(
                    f"N={n} T={t}: residual {_diff(residual, want_res)}, out {_diff(x, want)}"
                )
    _check_all(failures)


def _qkv(t: int, hq: int, hk: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A fused qkv projection output and its strided q, k, v views, as the model makes them."""
    return _split_qkv(_rand(t, (hq + 2 * hk) * d, dtype=dtype), hq, hk, d)


def _split_qkv(qkv: torch.Tensor, hq: int, hk: int, d: int) -> tuple[torch.Tensor, ...]:
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return qkv, q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_on_strided_qk_views_in_place(dtype):
    """Qwen3's per-head q/k norm: rows of head_dim inside the fused projection, out = x."""
    torch.manual_seed(2)
    failures = []
    for d, hq, hk in [(128, 32, 8), (64, 9, 3), (128, 16, 2)]:
        w = _rand(d, dtype=dtype, scale=1.0)
        for t in [1, 3, 8, 37, 512]:
            qkv, q, k, _ = _qkv(t, hq, hk, d, dtype)
            want_q, want_k = rms_norm(q, w, EPS), rms_norm(k, w, EPS)
            before = qkv.clone()
            cuda_ops.rms_norm(q, w, EPS, q)
            cuda_ops.rms_norm(k, w, EPS, k)
            v_cols = slice((hq + hk) * d, None)
            if not (
                torch.equal(q, want_q)
                and torch.equal(k, want_k)
                and torch.equal(qkv[:, v_cols], before[:, v_cols])
            ):
                failures.append(
                    f"D={d} Hq={hq} Hk={hk} T={t}: q {_diff(q, want_q)}, k {_diff(k, want_k)}"
                )
    _check_all(failures)


def _rope_tables(
    max_len: int, d: int, theta: float = 500000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEV), emb.sin().to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_qk_views_matches_torch(dtype):
    torch.manual_seed(3)
    cos, sin = _rope_tables(4096, 128)
    cos64, sin64 = _rope_tables(4096, 64, theta=100000.0)
    failures = []
    for d, hq, hk in [(128, 32, 8), (64, 9, 3), (128, 4, 4)]:
        c_tab, s_tab = (cos, sin) if d == 128 else (cos64, sin64)
        for t in [1, 2, 7, 64, 300]:
            qkv, q, k, v = _qkv(t, hq, hk, d, dtype)
            positions = torch.randint(0, 4096, (t,), device=DEV)
            c, s = c_tab[positions].to(dtype).unsqueeze(1), s_tab[positions].to(dtype).unsqueeze(1)
            want_q, want_k, want_v = apply_rope(q, c, s), apply_rope(k, c, s), v.clone()
            cuda_ops.rotary(q, k, positions, c_tab, s_tab)
            if not (torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)):
                failures.append(
                    f"D={d} Hq={hq} Hk={hk} T={t}: q {_diff(q, want_q)}, k {_diff(k, want_k)}"
                )
    _check_all(failures)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_views_off_16_byte_alignment_matches_torch(dtype):
    """q and k one element into their buffer (and D = 36, whose halves are not whole 16-byte
    groups): the kernel's one-pair-a-thread path, the same bits."""
    torch.manual_seed(6)
    failures = []
    for d, offset in [(128, 1), (36, 0)]:
        c_tab, s_tab = _rope_tables(1024, d)
        for t in [1, 7, 64]:
            buf = _rand(t * (8 + 2 * 2) * d + offset, dtype=dtype)
            _, q, k, v = _split_qkv(buf[offset:].view(t, -1), 8, 2, d)
            positions = torch.randint(0, 1024, (t,), device=DEV)
            c, s = c_tab[positions].to(dtype).unsqueeze(1), s_tab[positions].to(dtype).unsqueeze(1)
            want_q, want_k = apply_rope(q, c, s), apply_rope(k, c, s)
            cuda_ops.rotary(q, k, positions, c_tab, s_tab)
            if not (torch.equal(q, want_q) and torch.equal(k, want_k)):
                failures.append(
                    f"D={d} offset={offset} T={t}: q {_diff(q, want_q)}, k {_diff(k, want_k)}"
                )
    _check_all(failures)


def _check_qkv_and_caches(failures, case, qkv, want_qkv, caches, want_caches) -> None:
    """Adds to `failures` each of the projection and the two caches that differs."""
    pairs = [("qkv", qkv, want_qkv), ("k_cache", caches[0], want_caches[0]),
             ("v_cache", caches[1], want_caches[1])]  # fmt: skip
    failures += [f"{case}: {name} {_diff(g, w)}" for name, g, w in pairs if not torch.equal(g, w)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_store_kv_gives_the_bits_of_rotary_then_store_kv(dtype):
    """The decode step's fused launch: q and k rotated in place and the rotated k and v
    written to their slots, exactly as the two kernels do (a negative slot is skipped)."""
    torch.manual_seed(5)
    failures = []
    for d, hq, hk in [(128, 32, 8), (64, 9, 3)]:
        c_tab, s_tab = _rope_tables(4096, d)
        for t in [1, 2, 7, 64, 300]:
            qkv, q, k, v = _qkv(t, hq, hk, d, dtype)
            positions = torch.randint(0, 4096, (t,), device=DEV)
            loc = torch.randperm(2048, device=DEV)[:t]
            if t > 1:
                loc[t // 2] = -1
            caches = [_rand(2048, hk, d, dtype=dtype) for _ in range(2)]
            want_qkv, want_caches = qkv.clone(), [c.clone() for c in caches]
            _, wq, wk, wv = _split_qkv(want_qkv, hq, hk, d)
            cuda_ops.rotary(wq, wk, positions, c_tab, s_tab)
            cuda_ops.store_kv(wk, wv, *want_caches, loc)
            cuda_ops.rotary_store_kv(q, k, v, positions, c_tab, s_tab, *caches, loc)
            case = f"D={d} Hq={hq} Hk={hk} T={t}"
            _check_qkv_and_caches(failures, case, qkv, want_qkv, caches, want_caches)
    _check_all(failures)


def test_rotary_store_kv_refuses_an_fp8_cache_and_mismatched_v():
    c_tab, s_tab = _rope_tables(64, 64)
    _, q, k, v = _qkv(2, 4, 2, 64, torch.bfloat16)
    positions, loc = torch.arange(2, device=DEV), torch.arange(2, device=DEV)
    cache = _rand(16, 2, 64, dtype=torch.bfloat16)
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="dtype"):
        cuda_ops.rotary_store_kv(q, k, v, positions, c_tab, s_tab, fp8, fp8, loc)
    with pytest.raises(RuntimeError, match="like k"):
        cuda_ops.rotary_store_kv(q, k, v[:, :1], positions, c_tab, s_tab, cache, cache.clone(), loc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("d", "hq", "hk", "k"), [(64, 9, 3, 576), (128, 32, 8, 4096)])
def test_qkv_projection_with_rope_gives_the_bits_of_it_then_rotary_store_kv(dtype, d, hq, hk, k):
    """The decode step's qkv projection on the skinny GEMM doing RoPE and the KV write in its
    epilogue: the projection, the caches and the skipped slot exactly as the plain projection
    then rotary_store_kv leave them, with and without bias, on a row-strided x."""
    torch.manual_seed(11)
    plain, fused = cuda_ops.skinny_gemm, cuda_ops.skinny_rope_store_kv
    tokens, splits = (5, 16, 17, 64), (0, 8)
    n = (hq + 2 * hk) * d
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    c_tab, s_tab = _rope_tables(4096, d)
    failures = []
    for m, split in [(m, split) for m in tokens for split in splits]:
        x = _rand(m, k + 8, dtype=dtype)[:, :k]
        positions = torch.randint(0, 4096, (m,), device=DEV)
        loc = torch.randperm(512, device=DEV)[:m]
        if m > 1:
            loc[1] = -1
        for b in (None, _rand(n, dtype=dtype)):
            caches = [_rand(512, hk, d, dtype=dtype) for _ in range(2)]
            want_caches = [c.clone() for c in caches]
            want = torch.empty(m, n, device=DEV, dtype=dtype)
            plain(x, w, b, want, split=split)
            _, q, kk, v = _split_qkv(want, hq, hk, d)
            cuda_ops.rotary_store_kv(q, kk, v, positions, c_tab, s_tab, *want_caches, loc)
            got = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
            fused(x, w, b, got, positions, c_tab, s_tab, hq, *caches, loc, split=split)
            case = f"M={m} split={split} bias={b is not None}"
            _check_qkv_and_caches(failures, case, got, want, caches, want_caches)
    _check_all(failures)


def test_qkv_projection_with_rope_refuses_what_it_cannot_run():
    c_tab, s_tab = _rope_tables(64, 64)
    x = _rand(65, 64, dtype=torch.bfloat16)
    w = _rand((4 + 2 * 2) * 64, 64, dtype=torch.bfloat16)
    caches = [_rand(16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    positions, loc = torch.arange(65, device=DEV), torch.arange(65, device=DEV)
    out = torch.empty(65, w.shape[0], device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        cuda_ops.skinny_rope_store_kv(x, w, None, out, positions, c_tab, s_tab, 4, *caches, loc)
    x, out, positions, loc = x[:5], out[:5], positions[:5], loc[:5]
    with pytest.raises(RuntimeError, match="Hq"):  # 3 q heads do not fill w's rows
        cuda_ops.skinny_rope_store_kv(
            x[:2], w, None, out[:2], positions[:2], c_tab, s_tab, 3, *caches, loc[:2]
        )
    with pytest.raises(RuntimeError, match="multiple of 16"):
        odd = [_rand(16, 2, 40, dtype=torch.bfloat16) for _ in range(2)]
        w40 = _rand((4 + 2 * 2) * 40, 64, dtype=torch.bfloat16)
        out40 = torch.empty(5, w40.shape[0], device=DEV, dtype=torch.bfloat16)
        c40, s40 = _rope_tables(64, 40)
        cuda_ops.skinny_rope_store_kv(x, w40, None, out40, positions, c40, s40, 4, *odd, loc)
    fp8 = [c.to(torch.float8_e4m3fn) for c in caches]
    with pytest.raises(RuntimeError, match="dtype"):
        cuda_ops.skinny_rope_store_kv(
            x[:2], w, None, out[:2], positions[:2], c_tab, s_tab, 4, *fp8, loc[:2]
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch_bit_for_bit(dtype):
    torch.manual_seed(4)
    failures = []
    for inter in [1, 7, 64, 1536, 1000, 14336]:
        for t in [1, 3, 8, 129]:
            gate_up = _rand(t, 2 * inter, dtype=dtype, scale=4.0)
            gate, up = gate_up.split(inter, dim=-1)
            want = F.silu(gate) * up
            out = torch.full((t, inter), float("nan"), dtype=dtype, device=DEV)
            cuda_ops.silu_and_mul(gate_up, out)
            strided = _rand(t, 2 * inter + 8, dtype=dtype)[:, : 2 * inter]  # rows 8 elements apart
            strided.copy_(gate_up)
            out2 = torch.full((t, inter), float("nan"), dtype=dtype, device=DEV)
            cuda_ops.silu_and_mul(strided, out2)
            if not (torch.equal(out, want) and torch.equal(out2, want)):
                failures.append(f"I={inter} T={t}: {_diff(out, want)}, strided {_diff(out2, want)}")
    _check_all(failures)


def test_zero_tokens_launch_nothing_and_touch_nothing():
    w = _rand(256, dtype=torch.bfloat16)
    x, res = _rand(0, 256, dtype=torch.bfloat16), _rand(0, 256, dtype=torch.bfloat16)
    cuda_ops.fused_add_rms_norm(x, res, w, EPS)
    cuda_ops.rms_norm(x, w, EPS, x)
    cos, sin = _rope_tables(16, 64)
    _, q, k, _ = _qkv(0, 4, 2, 64, torch.bfloat16)
    cuda_ops.rotary(q, k, torch.zeros(0, dtype=torch.int64, device=DEV), cos, sin)
    cuda_ops.silu_and_mul(_rand(0, 128, dtype=torch.bfloat16), _rand(0, 64, dtype=torch.bfloat16))
    torch.cuda.synchronize()


def test_ops_replay_in_a_cuda_graph_without_allocating():
    """One layer's worth of the fused ops captured once, replayed on new inputs: same bits
    as the torch sequence, and no allocation during replay."""
    torch.manual_seed(5)
    t, n, hq, hk, d, inter, dt = 8, 576, 9, 3, 64, 1536, torch.bfloat16
    w, cos, sin = _rand(n, dtype=dt, scale=1.0), *_rope_tables(512, d, theta=100000.0)
    x, res = _rand(t, n, dtype=dt), _rand(t, n, dtype=dt)
    qkv, q, k, _ = _qkv(t, hq, hk, d, dt)
    positions = torch.randint(0, 512, (t,), device=DEV)
    gate_up, act = _rand(t, 2 * inter, dtype=dt), torch.empty(t, inter, dtype=dt, device=DEV)

    def step() -> None:
        cuda_ops.fused_add_rms_norm(x, res, w, EPS)
        cuda_ops.rotary(q, k, positions, cos, sin)
        cuda_ops.silu_and_mul(gate_up, act)

    step()  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        x.copy_(_rand(t, n, dtype=dt))
        res.copy_(_rand(t, n, dtype=dt))
        qkv.copy_(_rand(*qkv.shape, dtype=dt))
        positions.copy_(torch.randint(0, 512, (t,), device=DEV))
        gate_up.copy_(_rand(t, 2 * inter, dtype=dt))
        want_res = res + x
        want_x = rms_norm(want_res, w, EPS)
        c, s = cos[positions].to(dt).unsqueeze(1), sin[positions].to(dt).unsqueeze(1)
        want_q, want_k = apply_rope(q, c, s), apply_rope(k, c, s)
        gate, up = gate_up.split(inter, dim=-1)
        want_act = F.silu(gate) * up
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
        assert torch.equal(res, want_res) and torch.equal(x, want_x)
        assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(act, want_act)


def test_bad_arguments_are_refused_with_a_message():
    x = _rand(4, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        cuda_ops.rms_norm(x, _rand(128, dtype=torch.bfloat16), EPS, x)
    with pytest.raises(RuntimeError, match="dtype"):
        cuda_ops.fused_add_rms_norm(
            x, _rand(4, 256, dtype=torch.float16), _rand(256, dtype=torch.bfloat16), EPS
        )
    with pytest.raises(RuntimeError, match="out must be"):
        cuda_ops.silu_and_mul(
            _rand(4, 256, dtype=torch.bfloat16), _rand(4, 64, dtype=torch.bfloat16)
        )
