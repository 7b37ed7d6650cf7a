"""`kvray bench kernels` (GPU): kvray paged decode vs FlashInfer and torch SDPA, plus the KV write
and prefill (kvray's kernel, torch's FlashAttention-2 over gathered K/V as the engine runs it,
and SDPA on contiguous K/V), and the decode-batch GEMV against cuBLAS, on Llama-3-8B attention shapes (32 q / 8 kv heads, head_dim 128, bf16, page 16);
and (`--only mla`) the absorbed MLA decode over DeepSeek's 576-wide latent rows.

Every figure is the median per-call time over CUDA-graph replays (each graph holds many
calls, cycling over several page sets so that small cases do not run out of L2), and is
reported against the copy ceiling: bytes moved / 4.19 TB/s (the measured H200
device-to-device copy). Writes JSON (--result-json) and prints a table last.

The decode cases also run over an FP8 (e4m3) cache (`--kv-dtype`): the same page sets
quantized, bandwidth counted over the e4m3 bytes plus the float32 scales read.

    kvray bench kernels --result-json kernels.json [--flashinfer off] [--quick] [--only prefill]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import BF16_TFLOPS, COPY_TBPS, write_result
from worker.attention import cuda_ops, fa3, flash
from worker.attention.kv_quant import dequantize, quantize_rows

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
CASES = [(1, 1024), (1, 4096), (8, 1024), (8, 4096), (32, 1024), (32, 4096)]
CASES += [(128, 1024), (128, 2048), (128, 4096)]
ROTATE_BYTES = 512 << 20  # each graph touches at least this much KV (L2 is 60 MB)
MAX_SETS = 32
SPLIT_CAP = cuda_ops.recommended_max_splits(4096)
DEV = "cuda"


def graph_time_us(calls: list[Callable[[], Any]], replays: int = 25, min_calls: int = 24) -> float:
    """Median per-call time of `calls` (repeated to >= min_calls) captured in one graph."""
    seq = calls * max(1, math.ceil(min_calls / len(calls)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up outside capture (lazy init, JIT, workspace growth)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in seq:
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(seq))
    del graph
    return statistics.median(times)


def eager_time_us(fn: Callable[[], Any], n: int = 200) -> float:
    """Host-inclusive time per call when launched eagerly back to back."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


class Pool:
    """One big paged K/V pool; each case draws disjoint random page sets from it. With
    `fp8`, the pool quantized too (e4m3 K/V and their scales)."""

    def __init__(self, n_pages: int, fp8: bool = False) -> None:
        self.n_pages = n_pages
        self.k = torch.randn(n_pages * PAGE, HKV, D, device=DEV, dtype=DTYPE)
        self.v = torch.randn(n_pages * PAGE, HKV, D, device=DEV, dtype=DTYPE)
        self.fp8: tuple[torch.Tensor, ...] | None = None
        if fp8:
            k8, ks = quantize_rows(self.k)
            v8, vs = quantize_rows(self.v)
            self.fp8 = (k8, v8, ks, vs)

    def page_sets(self, n_sets: int, pages: int) -> torch.Tensor:
        perm = torch.randperm(self.n_pages, device=DEV)[: n_sets * pages]
        return perm.view(n_sets, pages).to(torch.int32)


class DecodeCase:
    """Inputs of one (B, L) case: per page set a page table and, for SDPA, contiguous K/V."""

    def __init__(self, pool: Pool, batch: int, seq_len: int) -> None:
        self.batch, self.seq_len = batch, seq_len
        self.kv_bytes = batch * seq_len * HKV * D * 2 * 2
        self.fp8_bytes = batch * seq_len * HKV * (D + 4) * 2  # e4m3 rows and their scales
        self.n_sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / self.kv_bytes)))
        self.pages_per_seq = math.ceil(seq_len / PAGE)
        sets = pool.page_sets(self.n_sets, batch * self.pages_per_seq)
        self.indices = [s.contiguous() for s in sets]  # [B * pages_per_seq] per set
        pos = torch.arange(self.pages_per_seq * PAGE, device=DEV, dtype=torch.int32)
        self.req_to_token = [
            (s.view(batch, -1)[:, pos // PAGE] * PAGE + pos % PAGE).contiguous() for s in sets
        ]
        self.pool = pool
        self.q = torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE)
        self.rows = torch.arange(batch, device=DEV, dtype=torch.int32)
        self.lens = torch.full((batch,), seq_len, device=DEV, dtype=torch.int32)
        self.out = torch.empty(batch, HQ, D, device=DEV, dtype=DTYPE)
        self.o_part = torch.empty(batch, HQ, SPLIT_CAP, D, device=DEV)
        self.ml_part = torch.empty(batch, HQ, SPLIT_CAP, 2, device=DEV)
        # as the engine runs it: the last split merges the partials (no combine kernel)
        self.counters = torch.zeros(batch * HQ, device=DEV, dtype=torch.int32)
        self.scale = D**-0.5

    def kvray_call(self, s: int, num_splits: int = 0, variant: int = 0) -> Callable[[], None]:
        def call() -> None:
            cuda_ops.decode_attention(
                self.q, self.pool.k, self.pool.v, self.req_to_token[s], self.rows, self.lens,
                PAGE, self.scale, self.out, self.o_part, self.ml_part,
                num_splits=num_splits, variant=variant, counters=self.counters,
            )  # fmt: skip

        return call

    def fp8_call(self, s: int, variant: int = 0) -> Callable[[], None]:
        assert self.pool.fp8 is not None
        k8, v8, ks, vs = self.pool.fp8

        def call() -> None:
            cuda_ops.decode_attention(
                self.q, k8, v8, self.req_to_token[s], self.rows, self.lens, PAGE, self.scale,
                self.out, self.o_part, self.ml_part, variant=variant, k_scale=ks, v_scale=vs,
                counters=self.counters,
            )  # fmt: skip

        return call

    def fp8_reference(self) -> torch.Tensor:
        """float32 SDPA over the dequantized FP8 rows of set 0."""
        assert self.pool.fp8 is not None
        k8, v8, ks, vs = self.pool.fp8
        slots = self.req_to_token[0][:, : self.seq_len].long()
        k = dequantize(k8[slots], ks[slots], torch.float32).permute(0, 2, 1, 3)
        v = dequantize(v8[slots], vs[slots], torch.float32).permute(0, 2, 1, 3)
        q = self.q.float().unsqueeze(2)
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True).squeeze(2)

    def contiguous_kv(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.req_to_token[s][:, : self.seq_len].long()
        k = self.pool.k[slots].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, L, D]
        v = self.pool.v[slots].permute(0, 2, 1, 3).contiguous()
        return k, v

    def reference(self) -> torch.Tensor:
        """float32 SDPA on set 0 for the correctness cross-check."""
        k, v = self.contiguous_kv(0)
        q = self.q.float().unsqueeze(2)
        o = F.scaled_dot_product_attention(
            q, k.float(), v.float(), scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)


def tbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


ROUNDS = 3  # kvray, FlashInfer and SDPA are timed in turn, ROUNDS times, against drift


def sweep_kvray(case: DecodeCase) -> dict[str, Any]:
    """Every tiling variant at its own split choice, and the default at forced split counts."""
    variants = {}
    for var in range(1, cuda_ops.decode_variants()):
        variants[str(var)] = graph_time_us([case.kvray_call(s, 0, var) for s in range(case.n_sets)])
    splits = {}
    for n in (1, 2, 4, 8, 16):
        splits[str(n)] = graph_time_us([case.kvray_call(s, n, 0) for s in range(case.n_sets)])
    return {"variant_us": variants, "forced_splits_us": splits}


def sdpa_calls(case: DecodeCase) -> list[Callable[[], Any]]:
    q = case.q.unsqueeze(2)
    calls: list[Callable[[], Any]] = []
    for s in range(case.n_sets):
        k, v = case.contiguous_kv(s)
        calls.append(
            partial(F.scaled_dot_product_attention, q, k, v, scale=case.scale, enable_gqa=True)
        )
    return calls


def flashinfer_calls(
    case: DecodeCase, fi: Any, workspace: torch.Tensor, tc: bool
) -> tuple[list, torch.Tensor]:
    """FlashInfer's paged decode (CUDA-graph mode, one planned wrapper per page set)."""
    kv = (case.pool.k.view(-1, PAGE, HKV, D), case.pool.v.view(-1, PAGE, HKV, D))
    indptr = torch.arange(case.batch + 1, device=DEV, dtype=torch.int32) * case.pages_per_seq
    last_len = case.seq_len - (case.pages_per_seq - 1) * PAGE
    last = torch.full((case.batch,), last_len, device=DEV, dtype=torch.int32)
    calls, out0 = [], torch.empty_like(case.q)
    for s in range(case.n_sets):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
            paged_kv_indptr_buffer=indptr.clone(),
            paged_kv_indices_buffer=case.indices[s].clone(),
            paged_kv_last_page_len_buffer=last.clone(),
        )  # fmt: skip
        w.plan(
            indptr, case.indices[s], last, HQ, HKV, D, PAGE,
            q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=case.scale,
        )  # fmt: skip
        out = out0 if s == 0 else torch.empty_like(case.q)
        calls.append(partial(w.run, case.q, kv, out=out))
    return calls, out0


def bench_case(case: DecodeCase, fi: Any, workspace: torch.Tensor, sweep: bool) -> dict[str, Any]:
    contenders: dict[str, list[Callable[[], Any]]] = {
        "kvray": [case.kvray_call(s) for s in range(case.n_sets)],
        "sdpa_contiguous": sdpa_calls(case),
    }
    res: dict[str, Any] = {}
    fi_outs = {}
    if fi is not None:
        for name, tc in (("fi_tc", True), ("fi_cuda_cores", False)):
            try:
                contenders[name], fi_outs[name] = flashinfer_calls(case, fi, workspace, tc)
            except Exception as exc:  # a FlashInfer failure must not lose the other figures
                res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
    rounds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(ROUNDS):
        for name, calls in contenders.items():
            try:
                rounds[name].append(graph_time_us(calls))
            except Exception as exc:
                res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
    for name, times in rounds.items():
        if times:
            res[f"{name}_us"] = statistics.median(times)
            res[f"{name}_rounds_us"] = times
            res[f"{name}_tbps"] = tbps(case.kv_bytes, res[f"{name}_us"])

    contenders["kvray"][0]()
    torch.cuda.synchronize()
    res["kvray_max_abs_err_vs_fp32"] = (case.out.float() - case.reference()).abs().max().item()
    res["kvray_variant"], res["kvray_splits"] = cuda_ops.decode_plan(
        case.batch, HQ, HKV, D, DTYPE, SPLIT_CAP
    )
    res["kvray_eager_us"] = eager_time_us(contenders["kvray"][0])
    for name, out in fi_outs.items():
        if f"{name}_us" in res:
            contenders[name][0]()
            torch.cuda.synchronize()
            res[f"{name}_max_abs_diff_vs_kvray"] = (
                (out.float() - case.out.float()).abs().max().item()
            )
            res[f"{name}_eager_us"] = eager_time_us(contenders[name][0], n=50)
    fi_times = [res[k] for k in ("fi_tc_us", "fi_cuda_cores_us") if k in res]
    if fi_times:
        res["fi_best_us"] = min(fi_times)
    if sweep:
        res.update(sweep_kvray(case))
    return res


def bench_fp8_case(case: DecodeCase) -> dict[str, Any]:
    """kvray decode over the FP8 pool: the automatic plan, and both compiled layouts."""
    res: dict[str, Any] = {"batch": case.batch, "seq_len": case.seq_len, "kv_bytes": case.fp8_bytes}
    res["floor_us"] = case.fp8_bytes / (COPY_TBPS * 1e12) * 1e6
    calls = [case.fp8_call(s) for s in range(case.n_sets)]
    times = [graph_time_us(calls) for _ in range(ROUNDS)]
    res["kvray_us"], res["kvray_rounds_us"] = statistics.median(times), times
    res["kvray_tbps"] = tbps(case.fp8_bytes, res["kvray_us"])
    res["kvray_fraction_of_ceiling"] = res["kvray_tbps"] / COPY_TBPS
    res["variant_us"] = {
        str(v): graph_time_us([case.fp8_call(s, v) for s in range(case.n_sets)]) for v in (1, 5)
    }
    calls[0]()
    torch.cuda.synchronize()
    res["kvray_max_abs_err_vs_fp32"] = (case.out.float() - case.fp8_reference()).abs().max().item()
    res["kvray_variant"], res["kvray_splits"] = cuda_ops.decode_plan(
        case.batch, HQ, HKV, D, DTYPE, SPLIT_CAP, kv_fp8=True
    )
    return res


def bench_decode(args: argparse.Namespace, fi: Any) -> dict[str, list[dict[str, Any]]]:
    """Rows per cache type: "decode" (bf16, against FlashInfer and SDPA) and "decode_fp8"."""
    cases = CASES[:3] if args.quick else CASES
    max_pages = max(
        max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / (b * n * HKV * D * 4))))
        * b
        * math.ceil(n / PAGE)
        for b, n in cases
    )
    pool = Pool(max_pages + 64, fp8=args.kv_dtype in ("fp8", "both"))
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    rows: dict[str, list[dict[str, Any]]] = {"decode": [], "decode_fp8": []}
    for b, n in cases:
        case = DecodeCase(pool, b, n)
        if pool.fp8 is not None:
            rows["decode_fp8"].append(bench_fp8_case(case))
            print(json.dumps(rows["decode_fp8"][-1]), flush=True)
        if args.kv_dtype == "fp8":
            continue
        row: dict[str, Any] = {
            "batch": b,
            "seq_len": n,
            "kv_bytes": case.kv_bytes,
            "page_sets": case.n_sets,
        }
        row["floor_us"] = case.kv_bytes / (COPY_TBPS * 1e12) * 1e6
        row.update(bench_case(case, fi, workspace, sweep=args.sweep))
        row["kvray_fraction_of_ceiling"] = row["kvray_tbps"] / COPY_TBPS
        if "fi_best_us" in row:
            row["speedup_vs_flashinfer"] = row["fi_best_us"] / row["kvray_us"]
        rows["decode"].append(row)
        print(json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def _index_put(
    k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, loc: torch.Tensor
) -> None:
    kc[loc] = k
    vc[loc] = v


GEMV_SHAPES = {  # (K, N) of the linear layers a decode step runs
    "8b qkv": (4096, 6144), "8b o": (4096, 4096), "8b gate_up": (4096, 28672),
    "8b down": (14336, 4096), "8b lm_head": (4096, 128256), "demo qkv": (576, 960),
    "demo o": (576, 576), "demo gate_up": (576, 3072), "demo down": (1536, 576),
    "demo lm_head": (576, 49152),
}  # fmt: skip


def _weight_copies(k: int, n: int) -> list[torch.Tensor]:
    """Copies of a random [n, k] weight, >= 256 MB in all, for calls to cycle over so that
    the weights stream from HBM, as a decode step's layers do."""
    copies = max(1, min(64, math.ceil(256e6 / (k * n * 2))))
    return [torch.randn(n, k, device=DEV, dtype=DTYPE) / k**0.5 for _ in range(copies)]


def bench_gemv() -> list[dict[str, Any]]:
    """kvray's GEMV vs cuBLAS (F.linear) at decode batch sizes, weight bytes / time; calls
    cycle over enough weight copies (>= 256 MB) that the weights stream from HBM, as a
    decode step's layers do."""
    rows = []
    for name, (k, n) in GEMV_SHAPES.items():
        nbytes, ws = k * n * 2, _weight_copies(k, n)
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device=DEV, dtype=DTYPE)
            out = torch.empty(m, n, device=DEV, dtype=DTYPE)
            ours = graph_time_us([partial(cuda_ops.gemv, x, w, None, out) for w in ws])
            cublas = graph_time_us([partial(torch.matmul, x, w.T, out=out) for w in ws])
            # K shared by 1, 2 or 4 warps a row group (the default above is one of them)
            splits = {
                str(s): graph_time_us(
                    [partial(cuda_ops.gemv, x, w, None, out, split=s) for w in ws]
                )
                for s in (1, 2, 4)
            }
            rows.append({"layer": name, "m": m, "k": k, "n": n, "kvray_us": ours,
                         "cublas_us": cublas, "kvray_tbps": nbytes / ours / 1e6,
                         "cublas_tbps": nbytes / cublas / 1e6, "split_us": splits,
                         "floor_us": nbytes / (COPY_TBPS * 1e6)})  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    return rows


GEMM_BATCHES = (1, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)
SKINNY_SPLITS = (1, 2, 4, 8)


def bench_gemm() -> list[dict[str, Any]]:
    """cuBLAS (F.linear) on the linear layers at the batch sizes of an offline run's decode
    steps (the 8B shape's up to 256 rows, the demo's up to 64), and kvray's skinny and tiled
    GEMMs where they run (up to 64 rows; with K split over 1, 2, 4 or 8 warps, or blocks of
    a cluster, too), against each call's
    floor: the longer of streaming the weights at the copy ceiling and its FLOPs at the bf16
    peak (the two cross near M=190)."""
    rows = []
    for name, (k, n) in GEMV_SHAPES.items():
        nbytes, ws = k * n * 2, _weight_copies(k, n)
        for m in GEMM_BATCHES:
            if m > cuda_ops.SKINNY_MAX_ROWS and not name.startswith("8b"):
                continue
            x = torch.randn(m, k, device=DEV, dtype=DTYPE)
            out = torch.empty(m, n, device=DEV, dtype=DTYPE)
            us = graph_time_us([partial(torch.matmul, x, w.T, out=out) for w in ws])
            flops = 2 * m * k * n
            floor = max(nbytes / (COPY_TBPS * 1e6), flops / (BF16_TFLOPS * 1e6))
            row: dict[str, Any] = {"layer": name, "m": m, "k": k, "n": n, "cublas_us": us,
                                   "tflops": flops / us / 1e6, "floor_us": floor,
                                   "of_floor": floor / us}  # fmt: skip
            for op in ("skinny", "tiled") if m <= cuda_ops.SKINNY_MAX_ROWS else ():
                kernel = getattr(cuda_ops, f"{op}_gemm")
                ours = graph_time_us([partial(kernel, x, w, None, out) for w in ws])
                row[f"{op}_us"], row[f"{op}_of_floor"] = ours, floor / ours
                row[f"{op}_split_us"] = {
                    str(sp): graph_time_us([partial(kernel, x, w, None, out, split=sp) for w in ws])
                    for sp in SKINNY_SPLITS
                }
            rows.append(row)
        del ws
        torch.cuda.empty_cache()
    return rows


MLA_CASES = [(heads, b, n) for heads in (16, 128) for b in (1, 32, 128) for n in (1024, 4096)]


def bench_mla() -> list[dict[str, Any]]:
    """csrc's absorbed MLA decode (DeepSeek's 512 + 64 latent rows, one per token, scattered
    over the cache as pages would be) against SDPA over the same rows gathered contiguous;
    latent bytes / time against the copy ceiling. 16 heads: V2-Lite; 128: V2 / V3."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for heads, batch, n in MLA_CASES:
        nbytes = batch * n * 576 * 2
        sets = max(1, min(16, math.ceil(512e6 / nbytes)))
        slots = batch * n * sets
        cache = torch.randn(slots, 1, 576, device=DEV, dtype=DTYPE)
        tables = torch.randperm(slots, device=DEV).to(torch.int32).view(sets, batch, n)
        q = torch.randn(batch, heads, 576, device=DEV, dtype=DTYPE)
        out = torch.empty(batch, heads, 512, device=DEV, dtype=DTYPE)
        splits = cuda_ops.mla_num_splits(batch, heads, sms)
        o_part = torch.empty(batch * heads * splits * 512, device=DEV)
        ml_part = torch.empty(batch * heads * splits * 2, device=DEV)
        rows_idx = torch.arange(batch, device=DEV, dtype=torch.int32)
        lens = torch.full((batch,), n, device=DEV, dtype=torch.int32)
        scale = 192**-0.5
        ours: list[Callable[[], Any]] = [
            partial(cuda_ops.mla_decode, q, cache, tables[i], rows_idx, lens, scale, out, o_part,
                    ml_part, splits)
            for i in range(sets)
        ]  # fmt: skip
        kvray_us = graph_time_us(ours)
        query = q.unsqueeze(1)
        gathered = [cache[tables[i].long()].view(batch, 1, n, 576) for i in range(min(sets, 2))]
        sdpa = F.scaled_dot_product_attention
        sdpa_us = graph_time_us(
            [partial(sdpa, query, g, g[..., :512], scale=scale) for g in gathered]
        )
        row = {"heads": heads, "batch": batch, "seq_len": n, "splits": splits,
               "kvray_us": kvray_us, "kvray_tbps": nbytes / kvray_us / 1e6,
               "sdpa_contiguous_us": sdpa_us, "floor_us": nbytes / (COPY_TBPS * 1e6),
               "tflops": batch * heads * n * (576 + 512) * 2 / kvray_us / 1e6}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        del cache, tables, gathered, ours
        torch.cuda.empty_cache()
    return rows


def print_mla_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'MLA decode':<10} {'H':>3} {'B':>4} {'L':>5} | {'kvray us':>9} {'TB/s':>5} "
          f"{'floor us':>8} {'TFLOP/s':>7} | {'SDPA us':>8}")  # fmt: skip
    for r in rows:
        print(f"{'':<10} {r['heads']:3d} {r['batch']:4d} {r['seq_len']:5d} | {r['kvray_us']:9.1f} "
              f"{r['kvray_tbps']:5.2f} {r['floor_us']:8.1f} {r['tflops']:7.1f} | "
              f"{r['sdpa_contiguous_us']:8.1f}")  # fmt: skip


def print_gemv_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'linear (weight TB/s)':<16} {'M':>2} {'kvray us':>9} {'TB/s':>5} {'cuBLAS us':>10} {'TB/s':>5} {'floor us':>9}  split 1 / 2 / 4 us"
    )
    for r in rows:
        splits = " / ".join(f"{us:.1f}" for us in r.get("split_us", {}).values())
        print(f"{r['layer']:<16} {r['m']:2d} {r['kvray_us']:9.1f} {r['kvray_tbps']:5.2f} "
              f"{r['cublas_us']:10.1f} {r['cublas_tbps']:5.2f} {r['floor_us']:9.1f}  {splits}")  # fmt: skip


def print_gemm_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'linear':<16} {'M':>3} {'cuBLAS us':>9} {'TFLOP/s':>8} {'of floor':>8} "
        + f"{'skinny us':>9} {'of floor':>8} {'tiled us':>9} {'of floor':>8} {'floor us':>9}"
        + "  skinny split 1 / 2 / 4 / 8 us | tiled split 1 / 2 / 4 / 8 us"
    )
    for r in rows:
        ours = "".join(
            f"{r[f'{op}_us']:{w}.1f} {r[f'{op}_of_floor']:8.0%}"
            if f"{op}_us" in r
            else " " * (w + 9)
            for op, w in (("skinny", 9), ("tiled", 9))
        )
        splits = " | ".join(
            " / ".join(f"{us:.1f}" for us in r[f"{op}_split_us"].values())
            for op in ("skinny", "tiled")
            if f"{op}_split_us" in r
        )
        print(f"{r['layer']:<16} {r['m']:3d} {r['cublas_us']:9.1f} {r['tflops']:8.1f} "
              f"{r['of_floor']:8.0%} {ours} {r['floor_us']:9.1f}  {splits}")  # fmt: skip


def bench_store_kv() -> list[dict[str, Any]]:
    """One fused K+V scatter kernel vs two torch index_put (k_cache[loc] = k) per layer."""
    n_slots = 1 << 20
    k_cache = torch.randn(n_slots, HKV, D, device=DEV, dtype=DTYPE)
    v_cache = torch.randn(n_slots, HKV, D, device=DEV, dtype=DTYPE)
    rows = []
    for t in (1, 32, 128, 1024, 8192):
        k = torch.randn(t, HKV, D, device=DEV, dtype=DTYPE)
        v = torch.randn(t, HKV, D, device=DEV, dtype=DTYPE)
        loc = torch.randperm(n_slots, device=DEV)[:t]
        kernel = graph_time_us([partial(cuda_ops.store_kv, k, v, k_cache, v_cache, loc)])
        torch_us = graph_time_us([partial(_index_put, k, v, k_cache, v_cache, loc)])
        nbytes = 2 * 2 * t * HKV * D * 2  # read + write of K and V rows
        rows.append({"tokens": t, "kernel_us": kernel, "index_put_us": torch_us, "bytes": nbytes,
                     "kernel_tbps": tbps(nbytes, kernel), "index_put_tbps": tbps(nbytes, torch_us)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _prefill_case(name: str, seqs: list[tuple[int, int]], with_fa3: bool) -> dict[str, Any]:
    """One ragged batch, seqs = [(q_len, kv_len)]: kvray at every tiling, torch's
    FlashAttention-2 and (`with_fa3`) FlashInfer's FA3 as the engine runs them, vs SDPA per
    sequence."""
    batch = len(seqs)
    pages = [math.ceil(kv / PAGE) for _, kv in seqs]
    width = max(pages) * PAGE
    perm = torch.randperm(sum(pages) + 8, device=DEV)
    rt = torch.zeros(batch, width, dtype=torch.int32, device=DEV)
    first = 0
    for b, n in enumerate(pages):  # each sequence's pages scattered over the cache
        pos = torch.arange(n * PAGE, device=DEV)
        rt[b, : n * PAGE] = (perm[first : first + n][pos // PAGE] * PAGE + pos % PAGE).to(
            torch.int32
        )
        first += n
    n_slots = (sum(pages) + 8) * PAGE
    k_cache = torch.randn(n_slots, HKV, D, device=DEV, dtype=DTYPE)
    v_cache = torch.randn(n_slots, HKV, D, device=DEV, dtype=DTYPE)
    total_q = sum(q for q, _ in seqs)
    q = torch.randn(total_q, HQ, D, device=DEV, dtype=DTYPE)
    out = torch.empty_like(q)
    qo = (
        torch.tensor([0] + [q for q, _ in seqs], device=DEV, dtype=torch.int32)
        .cumsum(0)
        .to(torch.int32)
    )
    q_lens, kv_lens = [q for q, _ in seqs], [kv for _, kv in seqs]
    lens = torch.tensor(kv_lens, device=DEV, dtype=torch.int32)
    rows_idx = torch.arange(batch, device=DEV, dtype=torch.int32)
    table, rows = rt.cpu().numpy(), list(range(batch))  # the host's mirror, as the engine's

    def kvray_call(variant: int) -> Callable[[], None]:
        return partial(
            cuda_ops.prefill_attention, q, k_cache, v_cache, rt, rows_idx, lens, qo, PAGE,
            D**-0.5, out, variant=variant,
        )  # fmt: skip

    variants = {
        str(v): graph_time_us([kvray_call(v)], min_calls=8)
        for v in range(1, cuda_ops.prefill_variants())
    }
    us = graph_time_us([kvray_call(0)], min_calls=8)
    flash_us = None
    if flash.available(DTYPE, D):  # torch's FlashAttention-2 over K/V gathered by a GatherPlan
        cu_k = torch.tensor([0, *kv_lens], device=DEV).cumsum(0).to(torch.int32)
        plan = flash.GatherPlan.build(table, rows, qo, cu_k, q_lens, kv_lens)
        flash_us = graph_time_us(
            [partial(flash.prefill, q, k_cache, v_cache, plan, D**-0.5)], min_calls=8
        )
    fa3_us, fa3_paged_us, fa3_diff, fa3_error = None, None, None, None
    if with_fa3 and fa3.available(DTYPE, D):  # as `prefill_kernel: fa3` runs it
        try:
            fa3_us, fa3_paged_us, outs = _fa3_case(q, k_cache, v_cache, table, rows, seqs)
            kvray_call(0)()  # the reference: kvray's own kernel into `out`
            fa3_diff = max(float((o.float() - out.float()).abs().max()) for o in outs)
        except Exception as exc:  # a FlashInfer failure must not lose the other figures
            fa3_error = f"{type(exc).__name__}: {exc}"[:500]
    sdpa_calls: list[Callable[[], Any]] = []
    start = 0
    for b, (q_len, kv_len) in enumerate(seqs):  # SDPA on contiguous K/V, one call per sequence
        slots = rt[b, :kv_len].long()
        kc = k_cache[slots].permute(1, 0, 2).unsqueeze(0).contiguous()
        vc = v_cache[slots].permute(1, 0, 2).unsqueeze(0).contiguous()
        qc = q[start : start + q_len].permute(1, 0, 2).unsqueeze(0).contiguous()
        start += q_len
        off = kv_len - q_len
        keys, queries = torch.arange(kv_len, device=DEV), off + torch.arange(q_len, device=DEV)
        mask = (keys[None, :] <= queries[:, None]) if off else None
        sdpa_calls.append(
            partial(
                F.scaled_dot_product_attention,
                qc,
                kc,
                vc,
                attn_mask=mask,
                is_causal=off == 0,
                enable_gqa=True,
            )
        )
    sdpa = graph_time_us(sdpa_calls, min_calls=8) * len(sdpa_calls)
    flops = sum(4 * HQ * D * sum(kv - q_len + i + 1 for i in range(q_len)) for q_len, kv in seqs)
    return {"case": name, "batch": batch, "tokens": total_q, "kv_tokens": int(lens.sum()),
            "auto_variant": cuda_ops.prefill_variant(batch, total_q, HQ, D, DTYPE), "kvray_us": us,
            "variant_us": variants, "sdpa_us": sdpa, "kvray_tflops": flops / us / 1e6,
            "variant_tflops": {v: flops / t / 1e6 for v, t in variants.items()},
            "sdpa_tflops": flops / sdpa / 1e6, "floor_us_at_790_tflops": flops / 790e12 * 1e6,
            "flash_us": flash_us, "flash_tflops": flops / flash_us / 1e6 if flash_us else None,
            "fa3_us": fa3_us, "fa3_tflops": flops / fa3_us / 1e6 if fa3_us else None,
            "fa3_paged_us": fa3_paged_us,
            "fa3_paged_tflops": flops / fa3_paged_us / 1e6 if fa3_paged_us else None,
            "fa3_max_abs_diff_vs_kvray": fa3_diff, "fa3_error": fa3_error,
            "engine_picks": _engine_picks(seqs, flash_us, fa3_us)}  # fmt: skip


def _fa3_case(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: Any, rows: list[int],
    seqs: list[tuple[int, int]],
) -> tuple[float, float, list[torch.Tensor]]:  # fmt: skip
    """FlashInfer's FA3 as the engine runs it (fresh prompts: the ragged kernel on the new K/V,
    strided rows of a fused projection as the engine's are; else over the cache in place), and
    over the cache in place whatever the batch: (µs, paged µs, their outputs)."""
    q_lens, kv_lens = [n for n, _ in seqs], [kv for _, kv in seqs]
    runner = fa3.Fa3Prefill(q.device)
    slots = flash.context_slots(table, rows, kv_lens, q.device)
    paged_out = torch.empty_like(q)
    runner.plan(slots, q_lens, kv_lens, HQ, HKV, D, DTYPE, D**-0.5)
    paged_us = graph_time_us([partial(runner.run, q, k_cache, v_cache, paged_out)], min_calls=8)
    if q_lens != kv_lens:
        return paged_us, paged_us, [paged_out]
    fused = torch.empty(q.shape[0], HQ + 2 * HKV, D, device=q.device, dtype=q.dtype)
    fused[:, HQ : HQ + HKV] = k_cache[slots.long()]
    fused[:, HQ + HKV :] = v_cache[slots.long()]
    k, v = fused[:, HQ : HQ + HKV], fused[:, HQ + HKV :]
    ragged_out = torch.empty_like(q)
    runner.plan(None, q_lens, kv_lens, HQ, HKV, D, DTYPE, D**-0.5)
    ragged_us = graph_time_us([partial(runner.run, q, k, v, ragged_out)], min_calls=8)
    return ragged_us, paged_us, [paged_out, ragged_out]


def _engine_picks(seqs: list[tuple[int, int]], flash_us: float | None, fa3_us: float | None) -> str:
    """The kernel `prefill_kernel: auto` runs for this batch: FA3 where it runs, else kvray's
    for short chunks and FlashAttention-2 (where it runs) for the rest."""
    if fa3_us:
        return "fa3"
    if not flash.prefers_flash([q for q, _ in seqs]):
        return "kvray"
    return "flash" if flash_us else "kvray"


def prefill_cases() -> list[tuple[str, list[tuple[int, int]]]]:
    gen = torch.Generator().manual_seed(0)
    ragged = [
        int(x) for x in torch.randint(100, 1025, (16,), generator=gen)
    ]  # the offline bench's prompts
    return [
        ("prompt 1024", [(1024, 1024)]),
        ("prompt 1920", [(1920, 1920)]),
        ("prompt 4096", [(4096, 4096)]),
        ("chunk 512 after 1536", [(512, 2048)]),
        ("16 x 256", [(256, 256)] * 16),
        (f"16 prompts, {sum(ragged)} tokens", [(n, n) for n in ragged]),
        ("64 chunks of 32 after 480", [(32, 512)] * 64),
    ]


def prefill_kernel_info() -> dict[str, Any]:
    """Rows, residency, registers and spills of every prefill tiling, per dtype and head_dim."""
    dtypes = {"bf16": DTYPE, "fp16": torch.float16}
    return {f"{k} d{d}": {v: cuda_ops.prefill_kernel_info(d, dt, v) for v in range(1, cuda_ops.prefill_variants())}
            for k, dt in dtypes.items() for d in (64, 128)}  # fmt: skip


def bench_prefill(with_fa3: bool) -> list[dict[str, Any]]:
    """Ragged causal prefill over the paged cache vs SDPA on contiguous K/V (FLOP view)."""
    rows = []
    for name, seqs in prefill_cases():
        rows.append(_prefill_case(name, seqs, with_fa3))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def load_flashinfer(mode: str) -> tuple[Any, str | None]:
    if mode == "off":
        return None, "disabled"
    try:
        import flashinfer

        return flashinfer, None
    except Exception as exc:
        if mode == "require":
            raise
        return None, f"{type(exc).__name__}: {exc}"


def warm_flashinfer(decode: bool = True) -> None:
    """JIT-compile FlashInfer's FA3 prefill and (`decode`) paged decode kernels (tensor-core
    and CUDA-core paths) for these shapes, so a later run only loads them (`scripts/gpu-check`
    runs this in the background while the kvray kernels build and their tests run)."""
    import flashinfer

    t0 = time.time()
    ready = fa3.available(DTYPE, D)
    print(
        f"flashinfer FA3 prefill: {'ready' if ready else 'unavailable'} in {time.time() - t0:.1f}s"
    )
    if not decode:
        return
    batch, pages = 2, 4
    k = torch.randn(batch * pages, PAGE, HKV, D, device=DEV, dtype=DTYPE)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE)
    indptr = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * pages
    indices = torch.arange(batch * pages, device=DEV, dtype=torch.int32)
    last = torch.full((batch,), PAGE, device=DEV, dtype=torch.int32)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    for tc in (True, False):
        t0 = time.time()
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=DTYPE)
        w.run(q, (k, torch.randn_like(k)))
        torch.cuda.synchronize()
        print(f"flashinfer tensor_cores={tc}: ready in {time.time() - t0:.1f}s", flush=True)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'B':>4} {'L':>5} | {'kvray us':>9} {'TB/s':>5} {'%ceil':>5} | {'FI us':>8} {'x FI':>5} | {'SDPA us':>8} {'TB/s':>5}"
    )
    for r in rows:
        fi = r.get("fi_best_us")
        fi_s = f"{fi:8.1f} {r['speedup_vs_flashinfer']:5.2f}" if fi else f"{'-':>8} {'-':>5}"
        print(f"{r['batch']:>4} {r['seq_len']:>5} | {r['kvray_us']:9.1f} {r['kvray_tbps']:5.2f} "
              f"{100 * r['kvray_fraction_of_ceiling']:5.1f} | {fi_s} | "
              f"{r['sdpa_contiguous_us']:8.1f} {r['sdpa_contiguous_tbps']:5.2f}")  # fmt: skip


def print_sweep_table(rows: list[dict[str, Any]]) -> None:
    """--sweep's figures: each tiling variant at its own split count, and the automatic variant
    at forced split counts, beside what `auto` runs (µs; the fastest of the row starred)."""
    if not rows or "variant_us" not in rows[0]:
        return
    variants, splits = list(rows[0]["variant_us"]), list(rows[0]["forced_splits_us"])
    print(
        f"\n{'B':>4} {'L':>5} | {'auto (sweep)':>12} | "
        + " ".join(f"{'v' + v:>7}" for v in variants)
        + " | "
        + " ".join(f"{'s' + n:>7}" for n in splits)
    )
    for r in rows:
        times = [*r["variant_us"].values(), *r["forced_splits_us"].values()]
        best = min(times)
        cells = [f"{t:6.1f}{'*' if t == best else ' '}" for t in times]
        auto = f"v{r['kvray_variant']} s{r['kvray_splits']} {r['kvray_us']:5.1f}"
        print(f"{r['batch']:>4} {r['seq_len']:>5} | {auto:>12} | "
              f"{' '.join(cells[: len(variants)])} | {' '.join(cells[len(variants) :])}")  # fmt: skip


def print_fp8_table(rows: list[dict[str, Any]], bf16: list[dict[str, Any]]) -> None:
    bf16_us = {(r["batch"], r["seq_len"]): r["kvray_us"] for r in bf16}
    print(
        f"\n{'FP8':>4} {'L':>5} | {'kvray us':>9} {'TB/s':>5} {'%ceil':>5} {'floor us':>8} | {'bf16 us':>8} {'x bf16':>6}"
    )
    for r in rows:
        ref = bf16_us.get((r["batch"], r["seq_len"]))
        ref_s = f"{ref:8.1f} {ref / r['kvray_us']:6.2f}" if ref else f"{'-':>8} {'-':>6}"
        print(f"{r['batch']:>4} {r['seq_len']:>5} | {r['kvray_us']:9.1f} {r['kvray_tbps']:5.2f} "
              f"{100 * r['kvray_fraction_of_ceiling']:5.1f} {r['floor_us']:8.1f} | {ref_s}")  # fmt: skip


def print_prefill_table(rows: list[dict[str, Any]]) -> None:
    variants = sorted(rows[0]["variant_tflops"], key=int) if rows else []
    head = " ".join(f"{'v' + v:>6}" for v in variants)
    print(
        f"\n{'prefill case (TFLOP/s)':<34} {'kvray':>6} {head} {'FA2':>6} {'FA3':>6} {'paged':>6} {'SDPA':>6}  engine picks"
    )
    for r in rows:
        cols = " ".join(f"{r['variant_tflops'][v]:6.1f}" for v in variants)
        fa2, fa3_, paged = (
            f"{r[k]:6.1f}" if r.get(k) else f"{'-':>6}"
            for k in ("flash_tflops", "fa3_tflops", "fa3_paged_tflops")
        )
        print(
            f"{r['case']:<34} {r['kvray_tflops']:6.1f} {cols} {fa2} {fa3_} {paged} {r['sdpa_tflops']:6.1f}  {r['engine_picks']}"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--result-json", help="write the rows to this file")
    parser.add_argument("--flashinfer", choices=("auto", "off", "require"), default="auto")
    parser.add_argument(
        "--sweep", action="store_true", help="also time every tiling variant and split count"
    )
    parser.add_argument("--quick", action="store_true", help="three decode cases only")
    parser.add_argument(
        "--only",
        choices=("decode", "store_kv", "prefill", "gemv", "gemm", "mla"),
        help="run one of the benchmarks",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp8", "both"),
        default="both",
        help="KV cache types of the decode cases (fp8: e4m3 with per-row scales)",
    )


def run(args: argparse.Namespace) -> int:
    """Exit status 1 when one of the benchmarks failed (its error is in the result)."""
    if not torch.cuda.is_available():
        raise SystemExit("kvray bench kernels needs a CUDA GPU")
    torch.manual_seed(0)
    t0 = time.time()
    cuda_ops.load()
    fi, fi_err = load_flashinfer(args.flashinfer)
    result: dict[str, Any] = {
        "cuda": torch.version.cuda,
        "flashinfer": getattr(fi, "__version__", None),
        "flashinfer_error": fi_err,
        "ceiling_tbps": COPY_TBPS,
        "split_cap": SPLIT_CAP,
        "shape": {
            "q_heads": HQ,
            "kv_heads": HKV,
            "head_dim": D,
            "page_size": PAGE,
            "dtype": "bfloat16",
        },
        "method": "median per-call time over CUDA graph replays (median of ROUNDS interleaved "
        "rounds); KV bytes / time; page sets rotated so each graph reads >= 512 MB",
        "decode_blocks_per_sm": {
            str(v): cuda_ops.decode_blocks_per_sm(D, DTYPE, v)
            for v in range(cuda_ops.decode_variants())
        },
        "decode_fp8_blocks_per_sm": {
            str(v): cuda_ops.decode_blocks_per_sm(D, DTYPE, v, kv_fp8=True) for v in (1, 5)
        },
        "prefill_kernel_info": prefill_kernel_info(),
    }
    failed = False
    for name, fn in (
        ("decode", lambda: bench_decode(args, fi)),
        ("store_kv", bench_store_kv),
        ("prefill", lambda: bench_prefill(with_fa3=fi is not None)),
        ("gemv", bench_gemv),
        ("gemm", bench_gemm),
        ("mla", bench_mla),
    ):
        if args.only not in (None, name):
            continue
        try:
            out = fn()
            if isinstance(out, dict):  # decode: one list of rows per cache type
                result.update({k: rows for k, rows in out.items() if rows})
            else:
                result[name] = out
        except Exception as exc:
            failed = True
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:1000]
            print(f"{name} failed: {exc}", flush=True)
        torch.cuda.empty_cache()
        write_result(args.result_json, "kernels", result)  # what is done so far
    result["wall_s"] = time.time() - t0
    write_result(args.result_json, "kernels", result)
    if "decode" in result:
        print_table(result["decode"])
        print_sweep_table(result["decode"])
    if "decode_fp8" in result:
        print_fp8_table(result["decode_fp8"], result.get("decode", []))
    if "prefill" in result:
        print_prefill_table(result["prefill"])
    if "gemv" in result:
        print_gemv_table(result["gemv"])
    if "gemm" in result:
        print_gemm_table(result["gemm"])
    if "mla" in result:
        print_mla_table(result["mla"])
    return 1 if failed else 0
