"""csrc kernels vs float32 torch references on fresh random paged caches (GPU only).

Every check draws new random inputs (never zeros), scatters pages randomly over a larger
cache, fills req_to_token only at page starts (other entries point at a wrong page, so
a kernel that reads them fails), and poisons every output with NaN before the call.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from worker.attention import cuda_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
TOL = {torch.bfloat16: (2e-2, 1e-2), torch.float16: (5e-3, 2e-3)}  # (atol=rtol, rel-norm)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    cuda_ops.load(verbose=False)


@dataclass
class Paged:
    """A paged KV cache of one layer with B requests placed on random pages."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    slots: list[torch.Tensor]  # per request, slot of every position
    page_size: int


def make_paged(
    lens: list[int],
    page_size: int,
    n_kv: int,
    d: int,
    dtype: torch.dtype,
    *,
    capacity: list[int] | None = None,
) -> Paged:
    """Random K/V on scattered pages; `capacity` (>= lens) sizes each request's pages."""
    cap = capacity or lens
    pages_per_req = [max(1, math.ceil(c / page_size)) for c in cap]
    n_pages = sum(pages_per_req) + 3
    n_slots = n_pages * page_size
    k_cache = torch.randn(n_slots, n_kv, d, device=DEV).to(dtype)
    v_cache = torch.randn(n_slots, n_kv, d, device=DEV).to(dtype)
    max_running = len(lens) + 5
    max_seq = max(pages_per_req) * page_size + page_size
    wrong_slot = (n_pages - 1) * page_size  # a spare page: wrong but in bounds
    req_to_token = torch.full((max_running, max_seq), wrong_slot, dtype=torch.int32)
    rows = torch.randperm(max_running)[: len(lens)]
    perm = torch.randperm(n_pages - 1)
    slots, next_page = [], 0
    for row, n_p in zip(rows.tolist(), pages_per_req, strict=True):
        pages = perm[next_page : next_page + n_p]
        next_page += n_p
        pos = torch.arange(n_p * page_size)
        s = pages[pos // page_size] * page_size + pos % page_size
        req_to_token[row, : n_p * page_size : page_size] = s[::page_size].to(torch.int32)
        slots.append(s.to(DEV))
    return Paged(
        k_cache, v_cache, req_to_token.to(DEV), rows.to(torch.int32).to(DEV),
        torch.tensor(lens, dtype=torch.int32, device=DEV), slots, page_size,
    )  # fmt: skip


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: torch.Tensor
) -> torch.Tensor:
    """float32 reference: q [n, Hq, D] at positions q_pos over k/v [L, Hkv, D], causal."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale
    keys = torch.arange(k.shape[0], device=q.device)
    s = s.masked_fill(keys[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), vf)


def ref_decode(q: torch.Tensor, kv: Paged, scale: float) -> torch.Tensor:
    outs = []
    for b, n in enumerate(kv.seq_lens.tolist()):
        if n == 0:
            outs.append(torch.zeros_like(q[b : b + 1], dtype=torch.float32))
            continue
        sl = kv.slots[b][:n]
        pos = torch.tensor([n - 1], device=DEV)
        outs.append(attend(q[b : b + 1], kv.k_cache[sl], kv.v_cache[sl], scale, pos))
    return torch.cat(outs)


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rel = TOL[dtype]
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or broken)"
    err = (out.float() - ref).norm() / ref.norm()
    assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=atol)


def decode_buffers(b: int, hq: int, d: int, dtype: torch.dtype, splits: int):
    out = torch.full((b, hq, d), float("nan"), device=DEV, dtype=dtype)
    o_part = torch.full((b + 2, hq, splits, d), float("nan"), device=DEV)
    ml_part = torch.full((b + 2, hq, splits, 2), float("nan"), device=DEV)
    return out, o_part, ml_part


def run_decode(q, kv: Paged, scale: float, splits_cap: int, **kw) -> torch.Tensor:
    out, o_part, ml_part = decode_buffers(q.shape[0], q.shape[1], q.shape[2], q.dtype, splits_cap)
    cuda_ops.decode_attention(
        q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
        kv.page_size, scale, out, o_part, ml_part, **kw,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out


LENS = [
    [1],
    [17, 300, 1],
    [5, 1000, 64, 129, 2049, 33, 16, 700],
    [4097, 3],
    [250] * 6,
]
GQA = [(8, 8), (12, 4), (32, 8), (16, 2), (32, 1)]  # group 1, 3, 4, 8, 32 (two head chunks)


def decode_cases() -> list[tuple]:
    cases = []
    for i, (dtype, d, (hq, hkv)) in enumerate(
        (dt, d, g) for dt in (torch.bfloat16, torch.float16) for d in (64, 128) for g in GQA
    ):
        page = (16, 1, 16, 8, 16)[i % 5]
        cases.append((dtype, d, hq, hkv, page, LENS[i % len(LENS)]))
    return cases


@pytest.mark.parametrize(("dtype", "d", "hq", "hkv", "page", "lens"), decode_cases())
def test_decode_matches_reference(dtype, d, hq, hkv, page, lens) -> None:
    kv = make_paged(lens, page, hkv, d, dtype)
    q = torch.randn(len(lens), hq, d, device=DEV).to(dtype)
    scale = d**-0.5
    out = run_decode(q, kv, scale, cuda_ops.recommended_max_splits(max(lens)))
    check_close(out, ref_decode(q, kv, scale), dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("variant", range(7))
def test_decode_forced_splits_and_variants(num_splits: int, variant: int) -> None:
    assert variant < cuda_ops.decode_variants()
    dtype, d, hq, hkv = torch.bfloat16, 128, 32, 8
    lens = [1, 63, 64, 65, 1500, 4000, 20]
    kv = make_paged(lens, 16, hkv, d, dtype)
    q = torch.randn(len(lens), hq, d, device=DEV).to(dtype)
    out = run_decode(q, kv, d**-0.5, 64, num_splits=num_splits, variant=variant)
    check_close(out, ref_decode(q, kv, d**-0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("d", "hq", "hkv"), [(128, 32, 8), (64, 9, 3)])
def test_decode_large_batch_head_major_path(dtype, d: int, hq: int, hkv: int) -> None:
    """Batches that fill every SM take the head-major layout; check it on ragged lengths."""
    batch = torch.cuda.get_device_properties(0).multi_processor_count + 8
    lens = torch.randint(1, 300, (batch,)).tolist()
    kv = make_paged(lens, 16, hkv, d, dtype)
    q = torch.randn(batch, hq, d, device=DEV).to(dtype)
    variant, _ = cuda_ops.decode_plan(batch, hq, hkv, d, dtype, 16)
    assert variant == 5
    out = run_decode(q, kv, d**-0.5, 16)
    check_close(out, ref_decode(q, kv, d**-0.5), dtype)


@pytest.mark.parametrize(("layout", "variant"), [("split", 1), ("head", 5)])
def test_decode_layout_setting_forces_the_automatic_pick(layout: str, variant: int) -> None:
    """KVRAY_DECODE_LAYOUT puts every automatic launch in one layout, a lone request's and an
    SM-filling batch's alike (read once a process: so in a fresh one)."""
    batches = (1, 2 * torch.cuda.get_device_properties(0).multi_processor_count)
    code = (
        "import torch; from worker.attention import cuda_ops; print([cuda_ops.decode_plan("
        f"b, 32, 8, 128, torch.bfloat16, 16)[0] for b in {batches}])"
    )
    env = {**os.environ, "KVRAY_DECODE_LAYOUT": layout}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == [f"[{variant},", f"{variant}]"]


def test_decode_layout_is_measured_where_auto_would_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's start-up choice times both layouts on its own cache at every bucket
    where `auto` goes head-major, and keeps at each the one `pick` names."""
    from types import SimpleNamespace

    from worker.attention import decode_layout
    from worker.graphs import graph_buckets
    from worker.workspace import InferenceWorkspace

    monkeypatch.delenv("KVRAY_DECODE_LAYOUT", raising=False)
    hq, hkv, d, page, dtype = 32, 8, 128, 16, torch.bfloat16
    ws = InferenceWorkspace(max_tokens=256, max_running=256, max_seq_len=2048, num_heads=hq,
                            head_dim=d, dtype=dtype, device=torch.device(DEV), split_kv=True)  # fmt: skip
    k = torch.randn(1, page + 256 * 1024, hkv, d, device=DEV).to(dtype)

    def view(slots: int) -> SimpleNamespace:
        return SimpleNamespace(k_cache=k[:, :slots], v_cache=k[:, :slots], k_scale=None,
                               v_scale=None, page_size=page)  # fmt: skip

    buckets = graph_buckets(256)
    head = tuple(
        b for b in buckets if cuda_ops.decode_plan(b, hq, hkv, d, dtype, ws.num_kv_splits)[0] == 5
    )
    choice = decode_layout.choose(view(k.shape[1]), ws, buckets)  # type: ignore[arg-type]
    assert head and choice.measured == head and choice.context == 1024
    assert all(t > 0 for t in choice.split_us + choice.head_us)
    kept = dict(zip(choice.batches, choice.variants, strict=True))
    for b, s, h in zip(head, choice.split_us, choice.head_us, strict=True):
        assert kept[b] == decode_layout.pick(s, h)
    assert all(kept[b] == decode_layout.AUTO for b in buckets if b not in head)
    # a cache with too few tokens a request to time anything: the rule stands
    small = decode_layout.choose(view(page + 256 * 128), ws, buckets)  # type: ignore[arg-type]
    assert small.measured == () and set(small.variants) == {decode_layout.AUTO}


def test_decode_strided_q_and_out() -> None:
    """q and out as views into wider rows (as from a fused QKV projection)."""
    dtype, d, hq, hkv = torch.bfloat16, 128, 32, 8
    lens = [77, 1025, 3]
    kv = make_paged(lens, 16, hkv, d, dtype)
    qkv = torch.randn(len(lens), hq + 2 * hkv, d, device=DEV).to(dtype)
    q = qkv[:, :hq]
    wide = torch.full((len(lens), hq + 4, d), float("nan"), device=DEV, dtype=dtype)
    out = wide[:, 2 : 2 + hq]
    _, o_part, ml_part = decode_buffers(len(lens), hq, d, dtype, 16)
    cuda_ops.decode_attention(
        q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
        16, d**-0.5, out, o_part, ml_part,
    )  # fmt: skip
    torch.cuda.synchronize()
    check_close(out, ref_decode(q, kv, d**-0.5), dtype)
    assert torch.isnan(wide[:, :2]).all() and torch.isnan(wide[:, 2 + hq :]).all()


def test_decode_is_deterministic() -> None:
    dtype, d = torch.bfloat16, 128
    lens = [3000, 17, 900, 4096]
    kv = make_paged(lens, 16, 8, d, dtype)
    q = torch.randn(len(lens), 32, d, device=DEV).to(dtype)
    a = run_decode(q, kv, d**-0.5, 64)
    b = run_decode(q, kv, d**-0.5, 64)
    assert torch.equal(a, b)


@pytest.mark.parametrize("merged", [False, True], ids=["combine-kernel", "last-split-merges"])
def test_decode_graph_replay_follows_live_lengths(merged: bool) -> None:
    """Captured once; replays after seq_lens change in place give the new lengths' result
    (with counters, the last split's merge leaves them at zero for the next replay)."""
    dtype, d, hq, hkv = torch.bfloat16, 128, 32, 8
    cap = [2000, 700, 64, 1300]
    kv = make_paged([10, 10, 10, 10], 16, hkv, d, dtype, capacity=cap)
    q = torch.randn(len(cap), hq, d, device=DEV).to(dtype)
    out, o_part, ml_part = decode_buffers(len(cap), hq, d, dtype, 32)
    args = (
        q,
        kv.k_cache,
        kv.v_cache,
        kv.req_to_token,
        kv.req_pool_indices,
        kv.seq_lens,
        16,
        d**-0.5,
    )
    counters = torch.zeros(len(cap) * hq, dtype=torch.int32, device=DEV) if merged else None
    cuda_ops.decode_attention(*args, out, o_part, ml_part, counters=counters)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_ops.decode_attention(*args, out, o_part, ml_part, counters=counters)
    for lens in ([1, 1, 1, 1], [2000, 5, 64, 1299], [33, 700, 17, 1300]):
        kv.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close(out, ref_decode(q, kv, d**-0.5), dtype)
        assert counters is None or not counters.any()


@pytest.mark.parametrize("variant", [1, 5], ids=["token-split", "head-major"])
def test_decode_attends_the_token_stored_by_the_kernel_before(variant: int) -> None:
    """store_kv then decode_attention, the engine's order, replayed in a graph with new
    K/V each time: the attention kernel loads older tokens before it waits for store_kv,
    and must still see every sequence's newest token as store_kv left it."""
    dtype, d, hq, hkv = torch.bfloat16, 128, 32, 8
    lens = [1, 16, 17, 48, 300, 1000, 2049, 4096]
    kv = make_paged(lens, 16, hkv, d, dtype)
    q = torch.randn(len(lens), hq, d, device=DEV).to(dtype)
    loc = torch.stack([s[n - 1] for s, n in zip(kv.slots, lens, strict=True)])
    k_new = torch.zeros(len(lens), hkv, d, device=DEV, dtype=dtype)
    v_new = torch.zeros_like(k_new)
    out, o_part, ml_part = decode_buffers(len(lens), hq, d, dtype, 32)
    counters = torch.zeros(len(lens) * hq, dtype=torch.int32, device=DEV)

    def step() -> None:
        cuda_ops.store_kv(k_new, v_new, kv.k_cache, kv.v_cache, loc)
        cuda_ops.decode_attention(
            q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
            16, d**-0.5, out, o_part, ml_part, variant=variant, counters=counters,
        )  # fmt: skip

    step()  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for scale in (4.0, -4.0, 8.0):  # the newest token dominates: a stale one shows
        k_new.copy_(q.view(len(lens), hkv, hq // hkv, d).float().mean(2) * scale)
        v_new.normal_(std=10.0)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kv.k_cache[loc], k_new)
        check_close(out, ref_decode(q, kv, d**-0.5), dtype)


def test_decode_empty_sequence_gives_zeros() -> None:
    dtype, d = torch.float16, 64
    kv = make_paged([0, 40], 16, 2, d, dtype, capacity=[16, 40])
    q = torch.randn(2, 4, d, device=DEV).to(dtype)
    for splits in (1, 8):
        out = run_decode(q, kv, 0.125, 8, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        check_close(out[1:], ref_decode(q, kv, 0.125)[1:], dtype)


@pytest.mark.parametrize("variant", range(7))
def test_decode_merged_by_the_last_split_gives_the_combine_kernels_bits(variant: int) -> None:
    """With counters the split that finishes last merges the partials: the same output as the
    combine kernel, bit for bit, on every tiling and split count, launch after launch (the
    counters come back to zero), an empty sequence included."""
    failures = []
    for dtype, d, hq, hkv in [(torch.bfloat16, 128, 32, 8), (torch.float16, 64, 9, 3)]:
        if variant not in (0, 1, 5) and (dtype, d) != (torch.bfloat16, 128):
            continue  # the sweep variants are compiled for bf16, head_dim 128 only
        lens = [1, 0, 63, 300, 1500, 4000, 20]
        kv = make_paged(lens, 16, hkv, d, dtype, capacity=[max(n, 1) for n in lens])
        q = torch.randn(len(lens), hq, d, device=DEV).to(dtype)
        counters = torch.zeros(len(lens) * hq, dtype=torch.int32, device=DEV)
        for splits in (2, 7, 64):
            kw = {"num_splits": splits, "variant": variant}
            want = run_decode(q, kv, d**-0.5, 64, **kw)
            for launch in range(3):
                got = run_decode(q, kv, d**-0.5, 64, counters=counters, **kw)
                if not torch.equal(got, want) or counters.any():
                    bad = int((got != want).sum())
                    failures.append(f"{dtype} D={d} splits={splits} launch {launch}: {bad} differ, "
                                    f"{int(counters.count_nonzero())} counters left")  # fmt: skip
    assert not failures, "; ".join(failures)


def ref_prefill(q: torch.Tensor, kv: Paged, qo_indptr: list[int], scale: float) -> torch.Tensor:
    outs = []
    for b, n in enumerate(kv.seq_lens.tolist()):
        q_b = q[qo_indptr[b] : qo_indptr[b + 1]]
        sl = kv.slots[b][:n]
        pos = torch.arange(n - q_b.shape[0], n, device=DEV)
        outs.append(attend(q_b, kv.k_cache[sl], kv.v_cache[sl], scale, pos))
    return torch.cat(outs)


SEQS = [  # (q_len, kv_len): whole prompts, prefix hits and chunks (kv_len > q_len)
    [(1, 1), (17, 17), (64, 64), (100, 100)],
    [(5, 1000), (130, 300), (1, 50), (64, 200)],
    [(257, 257), (3, 3)],
    [(70, 403), (1, 1), (129, 129)],
    [(300, 1000), (2, 2), (200, 200)],
]


def prefill_cases() -> list[tuple]:
    cases = []
    for i, (dtype, d, (hq, hkv)) in enumerate(
        (dt, d, g) for dt in (torch.bfloat16, torch.float16) for d in (64, 128) for g in GQA[:4]
    ):
        cases.append((dtype, d, hq, hkv, (16, 1, 16, 32)[i % 4], SEQS[i % len(SEQS)]))
    return cases


@pytest.mark.parametrize("variant", range(4))
@pytest.mark.parametrize(("dtype", "d", "hq", "hkv", "page", "seqs"), prefill_cases())
def test_prefill_matches_reference(dtype, d, hq, hkv, page, seqs, variant: int) -> None:
    assert variant < cuda_ops.prefill_variants()
    kv = make_paged([kv for _, kv in seqs], page, hkv, d, dtype)
    qo = [0]
    for q_len, _ in seqs:
        qo.append(qo[-1] + q_len)
    qkv = torch.randn(qo[-1], hq + 2 * hkv, d, device=DEV).to(dtype)
    q = qkv[:, :hq]  # strided rows, as from a fused projection
    out = torch.full((qo[-1], hq, d), float("nan"), device=DEV, dtype=dtype)
    qo_indptr = torch.tensor(qo, dtype=torch.int32, device=DEV)
    cuda_ops.prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
        qo_indptr, page, d**-0.5, out, variant=variant,
    )  # fmt: skip
    torch.cuda.synchronize()
    check_close(out, ref_prefill(q, kv, qo, d**-0.5), dtype)


def test_prefill_tiling_choice_and_residency() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    resident = sms * cuda_ops.prefill_kernel_info(128, torch.bfloat16, 2)["blocks_per_sm"]
    choose = partial(cuda_ops.prefill_variant, num_q_heads=32, head_dim=128, dtype=torch.bfloat16)
    long_prompt = 128 * math.ceil(1.5 * resident / 32)  # its 128-query tiles fill the GPU 1.5 times
    assert choose(1, long_prompt) == 2
    assert choose(1, long_prompt - 256) == 3  # 128-query tiles, 8 warps of 16 rows
    assert choose(4, 4 * 100) == 3
    assert choose(64, 64 * 32) == 1  # prompt chunks next to decodes: 64-query tiles
    for d in (64, 128):
        for v in range(1, cuda_ops.prefill_variants()):
            info = cuda_ops.prefill_kernel_info(d, torch.bfloat16, v)
            assert info["blocks_per_sm"] >= 1 and info["tile_m"] in (64, 128), (d, v, info)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "d"), [(1, 128), (7, 64), (300, 128)])
def test_store_kv_matches_index_put(dtype, t: int, d: int) -> None:
    hkv, n_slots = 4, 1024
    k_cache = torch.randn(n_slots, hkv, d, device=DEV).to(dtype)
    v_cache = torch.randn(n_slots, hkv, d, device=DEV).to(dtype)
    qkv = torch.randn(t, 8 + 2 * hkv, d, device=DEV).to(dtype)
    k, v = qkv[:, 8 : 8 + hkv], qkv[:, 8 + hkv :]
    loc = torch.randperm(n_slots, device=DEV)[:t]
    if t > 1:
        loc[t // 2] = -1  # skipped (padding)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = loc >= 0
    k_ref[loc[keep]] = k[keep]
    v_ref[loc[keep]] = v[keep]
    cuda_ops.store_kv(k, v, k_cache, v_cache, loc)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_bad_arguments_raise() -> None:
    kv = make_paged([5], 16, 2, 64, torch.bfloat16)
    q = torch.randn(1, 4, 64, device=DEV).to(torch.float16)  # dtype differs from the cache
    out, o_part, ml_part = decode_buffers(1, 4, 64, torch.float16, 4)
    with pytest.raises(RuntimeError, match="dtype"):
        cuda_ops.decode_attention(
            q, kv.k_cache, kv.v_cache, kv.req_to_token, kv.req_pool_indices, kv.seq_lens,
            16, 0.125, out, o_part, ml_part,
        )  # fmt: skip


def _ragged_prompts(dtype, d, hq, hkv, page, seqs) -> tuple[Paged, torch.Tensor, list[int]]:
    """A paged cache holding `seqs` ((q_len, kv_len) each) with every position in its
    table, as the engine's, their queries as strided rows of a fused projection, and the
    queries' offsets."""
    kv = make_paged([kv for _, kv in seqs], page, hkv, d, dtype)
    for row, s in zip(kv.req_pool_indices.tolist(), kv.slots, strict=True):
        kv.req_to_token[row, : s.numel()] = s.to(torch.int32)
    qo = [0]
    for q_len, _ in seqs:
        qo.append(qo[-1] + q_len)
    qkv = torch.randn(qo[-1], hq + 2 * hkv, d, device=DEV).to(dtype)
    return kv, qkv[:, :hq], qo


@pytest.mark.parametrize(("dtype", "d", "hq", "hkv", "page", "seqs"), prefill_cases())
def test_flash_prefill_matches_reference(dtype, d, hq, hkv, page, seqs) -> None:
    """torch's FlashAttention-2 over K/V gathered by a GatherPlan: the same causal
    semantics as kvray's kernel (bottom-right: chunks and prefix hits see their prefix)."""
    from worker.attention import flash

    if not flash.available(dtype, d):
        pytest.skip("torch's FlashAttention-2 does not run here")
    kv, q, qo = _ragged_prompts(dtype, d, hq, hkv, page, seqs)
    q_lens, kv_lens = [n for n, _ in seqs], [k for _, k in seqs]
    cu_q = torch.tensor(qo, dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, *kv_lens], device=DEV).cumsum(0).to(torch.int32)
    table, rows = kv.req_to_token.cpu().numpy(), kv.req_pool_indices.tolist()
    plan = flash.GatherPlan.build(table, rows, cu_q, cu_k, q_lens, kv_lens)
    out = flash.prefill(q, kv.k_cache, kv.v_cache, plan, d**-0.5)
    torch.cuda.synchronize()
    check_close(out, ref_prefill(q, kv, qo, d**-0.5), dtype)


@pytest.mark.parametrize(("dtype", "d", "hq", "hkv", "page", "seqs"), prefill_cases())
def test_fa3_prefill_matches_reference(dtype, d, hq, hkv, page, seqs) -> None:
    """FlashInfer's FA3 over the cache in place, each sequence's slots as pages of one token:
    kvray's causal semantics (bottom-right), on strided q, into a given `out`."""
    from worker.attention import fa3, flash

    if not fa3.available(dtype, d):
        pytest.skip("FlashInfer's FA3 prefill does not run here")
    kv, q, qo = _ragged_prompts(dtype, d, hq, hkv, page, seqs)
    q_lens, kv_lens = [n for n, _ in seqs], [k for _, k in seqs]
    table, rows = kv.req_to_token.cpu().numpy(), kv.req_pool_indices.tolist()
    slots = flash.context_slots(table, rows, kv_lens, q.device)
    runner = fa3.Fa3Prefill(q.device)
    out = torch.full((qo[-1], hq, d), float("nan"), device=DEV, dtype=dtype)
    for _ in range(2):  # the second plan goes to the other wrapper
        runner.plan(slots, q_lens, kv_lens, hq, hkv, d, dtype, d**-0.5)
        runner.run(q, kv.k_cache, kv.v_cache, out)
        torch.cuda.synchronize()
        check_close(out, ref_prefill(q, kv, qo, d**-0.5), dtype)


@pytest.mark.parametrize(("dtype", "d", "hq", "hkv", "page", "seqs"), prefill_cases())
def test_fa3_ragged_prefill_matches_reference(dtype, d, hq, hkv, page, seqs) -> None:
    """Prompts with no cached context: FA3's ragged kernel over the new K/V, strided rows of a
    fused projection holding the tokens the cache holds, planned in turn with paged plans (the
    two wrapper sets and their plan buffers)."""
    from worker.attention import fa3, flash

    if not fa3.available(dtype, d):
        pytest.skip("FlashInfer's FA3 prefill does not run here")
    fresh = [(n, n) for n, _ in seqs]
    kv, q, qo = _ragged_prompts(dtype, d, hq, hkv, page, fresh)
    lens = [n for n, _ in fresh]
    new_slots = torch.cat([s[:n] for s, n in zip(kv.slots, lens, strict=True)])  # of whole pages
    fused = torch.empty(qo[-1], hq + 2 * hkv, d, device=DEV, dtype=dtype)
    fused[:, hq : hq + hkv] = kv.k_cache[new_slots]
    fused[:, hq + hkv :] = kv.v_cache[new_slots]
    k, v = fused[:, hq : hq + hkv], fused[:, hq + hkv :]
    table, rows = kv.req_to_token.cpu().numpy(), kv.req_pool_indices.tolist()
    paged = flash.context_slots(table, rows, lens, q.device)
    ref = ref_prefill(q, kv, qo, d**-0.5)
    runner = fa3.Fa3Prefill(q.device)
    for slots in (None, paged, None, None):
        out = torch.full((qo[-1], hq, d), float("nan"), device=DEV, dtype=dtype)
        runner.plan(slots, lens, lens, hq, hkv, d, dtype, d**-0.5)
        assert runner.ragged == (slots is None)
        if runner.ragged:
            runner.run(q, k, v, out)
        else:
            runner.run(q, kv.k_cache, kv.v_cache, out)
        torch.cuda.synchronize()
        check_close(out, ref, dtype)


GEMV_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (4096, 6144), (14336, 4096),
               (264, 40), (4096, 1)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), GEMV_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("split", [0, 2, 4])
def test_gemv_matches_a_float32_matmul(dtype, k: int, n: int, m: int, split: int) -> None:
    """kvray's GEMV against float32 x @ w.T: within one rounding of the output dtype plus
    float32 accumulation error; with and without bias, on a row-strided x, with K whole or
    shared by 2 or 4 warps (264 / 8 chunks leave the last warp of 4 a shorter part)."""
    check_linear_against_float32(cuda_ops.gemv, dtype, k, n, m, split)


def check_linear_against_float32(linear, dtype, k: int, n: int, m: int, split: int) -> None:
    """`linear` (gemv or skinny_gemm) against float32 x @ w.T (+ bias), with and without bias,
    on an x whose rows are k + 8 apart, as a slice of a wider activation would be."""
    x = torch.randn(m, k + 8, device=DEV).to(dtype)[:, :k]
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype)
    for b in (None, bias):
        out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
        linear(x, w, b, out, split=split)
        ref = x.float() @ w.float().T + (0 if b is None else b.float())
        check_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), [(576, 3072), (4096, 28672), (264, 40)])
@pytest.mark.parametrize(
    ("op", "m"),
    [("gemv", 1), ("gemv", 2), ("gemv", 3), ("gemv", 8), ("skinny_gemm", 5),
     ("skinny_gemm", 33), ("skinny_gemm", 64), ("tiled_gemm", 5), ("tiled_gemm", 33),
     ("tiled_gemm", 64)],
)  # fmt: skip
@pytest.mark.parametrize("split", [0, 4])
def test_gated_linear_gives_the_bits_of_the_plain_one_then_silu_and_mul(
    dtype, k: int, n: int, op: str, m: int, split: int
):
    """The MLP's gate_up GEMV (or skinny GEMM) taking silu(gate) * up itself: exactly the
    two kernels' output."""
    linear = getattr(cuda_ops, op)
    x = torch.randn(m, k + 8, device=DEV).to(dtype)[:, :k]
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    for b in (None, torch.randn(n, device=DEV).to(dtype)):
        gate_up = torch.empty(m, n, device=DEV, dtype=dtype)
        want = torch.empty(m, n // 2, device=DEV, dtype=dtype)
        linear(x, w, b, gate_up, split=split)
        cuda_ops.silu_and_mul(gate_up, want)
        got = torch.full((m, n // 2), float("nan"), device=DEV, dtype=dtype)
        linear(x, w, b, got, gated=True, split=split)
        assert torch.equal(got, want), f"{int((got != want).sum())} of {want.numel()} differ"


SKINNY_SHAPES = [(576, 960), (576, 576), (4096, 6144), (14336, 4096), (264, 40), (4096, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), SKINNY_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 17, 40, 64])
@pytest.mark.parametrize("split", [0, 2, 8])
def test_skinny_gemm_matches_a_float32_matmul(dtype, k: int, n: int, m: int, split: int) -> None:
    """The tensor-core skinny GEMM against float32 x @ w.T, as the GEMV's test: every count of
    16-row x tiles, partial tiles, N not a multiple of 16, K split over up to 8 warps (264 / 8
    chunks leave most of 8 parts empty), a row-strided x."""
    check_linear_against_float32(cuda_ops.skinny_gemm, dtype, k, n, m, split)


@pytest.mark.parametrize("op", ["skinny_gemm", "tiled_gemm"])
def test_skinny_gemm_replays_in_a_cuda_graph(op: str) -> None:
    """Captured, it reads the x of each replay and gives the eager call's bits."""
    linear = getattr(cuda_ops, op)
    k, n, m = 4096, 6144, 32
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    linear(x, w, None, out)  # the build and first launch outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear(x, w, None, out)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        want = torch.empty_like(out)
        linear(x, w, None, want)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


TILED_SHAPES = [(4096, 6144), (14336, 4096), (576, 960), (264, 40), (4104, 200), (64, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), TILED_SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 17, 40, 64])
@pytest.mark.parametrize("split", [0, 1, 3, 8])
def test_tiled_gemm_matches_a_float32_matmul(dtype, k: int, n: int, m: int, split: int) -> None:
    """The shared-memory tiled GEMM against float32 x @ w.T: every count of 16-row x tiles,
    N not a multiple of the 128-row tile, K not a multiple of the 64-K stage (4104, 264),
    fewer stages than splits (264 over 8 blocks leaves most empty), K split over a cluster of
    1 to 8 blocks, a row-strided x."""
    check_linear_against_float32(cuda_ops.tiled_gemm, dtype, k, n, m, split)


def test_tiled_gemm_adds_the_splits_in_one_order() -> None:
    """K split over a cluster gives the same bits every call (the ranks add in order, not as
    they finish), and each split count is as close to float32 as one block's sums."""
    k, n, m = 14336, 4096, 32
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    for split in (1, 2, 5, 8):
        first = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        cuda_ops.tiled_gemm(x, w, None, first, split=split)
        check_close(first, ref, torch.bfloat16)
        for _ in range(3):
            again = torch.empty_like(first)
            cuda_ops.tiled_gemm(x, w, None, again, split=split)
            assert torch.equal(again, first), f"split {split} changed between calls"


@pytest.mark.parametrize(("op", "bad_split"), [("skinny_gemm", 3), ("tiled_gemm", 9)])
def test_skinny_gemm_refuses_what_it_cannot_run(op: str, bad_split: int) -> None:
    linear = getattr(cuda_ops, op)
    w = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        linear(torch.randn(65, 64, device=DEV, dtype=torch.bfloat16), w, None,
               torch.empty(65, 16, device=DEV, dtype=torch.bfloat16))  # fmt: skip
    with pytest.raises(RuntimeError, match="split must be"):
        linear(torch.randn(2, 64, device=DEV, dtype=torch.bfloat16), w, None,
               torch.empty(2, 16, device=DEV, dtype=torch.bfloat16), split=bad_split)  # fmt: skip


def test_gemv_refuses_what_it_cannot_run() -> None:
    w = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        cuda_ops.gemv(torch.randn(9, 64, device=DEV, dtype=torch.bfloat16), w, None,
                      torch.empty(9, 16, device=DEV, dtype=torch.bfloat16))  # fmt: skip
    with pytest.raises(ValueError, match="K % 8"):
        cuda_ops.gemv(torch.randn(1, 60, device=DEV, dtype=torch.bfloat16), w[:, :60], None,
                      torch.empty(1, 16, device=DEV, dtype=torch.bfloat16))  # fmt: skip
