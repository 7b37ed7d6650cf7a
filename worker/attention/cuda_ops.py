"""kvray's CUDA kernels (csrc/): built on first use, cached on disk, thin typed wrappers.

Importing this module never compiles or imports the extension: a CPU machine can import
it freely. The first op call (or an explicit `load()`) builds csrc/ with
`torch.utils.cpp_extension.load` (ninja) for the current GPU's architecture
(sm_90a on Hopper) into a cache directory keyed by the sources, torch, CUDA and the
arch, so later processes only load the built library.

All ops write into caller-provided tensors (or in place) and allocate nothing, so they
can be captured in CUDA graphs. The fused layer ops (norm, RoPE, SiLU·mul) give the same
bits as HF transformers' torch op sequence on the GPU (see csrc/fused.cu). Layouts: per layer, `k_cache` / `v_cache` are contiguous
`[n_slots, n_kv_heads, head_dim]`; the slot of (request row r, position p) is
`req_to_token[r, p // page_size * page_size] + p % page_size`. An FP8 cache
(float8_e4m3fn) comes with float32 `k_scale` / `v_scale` `[n_slots, n_kv_heads]`
(worker/attention/kv_quant.py); store_kv and decode_attention take them, prefill does not.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

_SOURCES = (
    "ops.cpp",
    "decode.cu",
    "prefill.cu",
    "store_kv.cu",
    "fused.cu",
    "gemv.cu",
    "mla.cu",
    "argmax.cu",
    "skinny.cu",
    "tiled.cu",
)
_HEADERS = ("common.cuh", "launch.h", "rope.cuh")


def find_csrc(package_dir: Path = Path(__file__).resolve().parents[1]) -> Path:
    """The kernels' sources: `worker/_csrc/` in an installed wheel (package data), else the
    checkout's top-level `csrc/` next to `worker/` (a source tree or an editable install)."""
    for candidate in (package_dir / "_csrc", package_dir.parent / "csrc"):
        if all((candidate / name).is_file() for name in (*_SOURCES, *_HEADERS)):
            return candidate
    raise KernelBuildError(
        f"the kvray kernel sources are neither in {package_dir / '_csrc'} nor in {package_dir.parent / 'csrc'}"
    )


DEFAULT_CACHE_DIR = Path.home() / ".cache" / "kvray" / "kernels"

# The decode kernel never makes a split shorter than this (csrc/decode.cu, kMinChunk), so
# more splits than max_seq_len / 256 would only add empty blocks.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64

_lock = threading.Lock()
_module: ModuleType | None = None


class KernelBuildError(RuntimeError):
    """The CUDA extension cannot be built here (no GPU, no nvcc, or a compile error)."""


def arch_flags(major: int, minor: int) -> list[str]:
    """nvcc -gencode flags for one compute capability; Hopper gets the sm_90a target."""
    if (major, minor) < (8, 0):
        raise KernelBuildError(
            f"kvray kernels need compute capability >= 8.0, found {major}.{minor}"
        )
    suffix = "a" if (major, minor) == (9, 0) else ""
    cc = f"{major}{minor}{suffix}"
    return [f"-gencode=arch=compute_{cc},code=sm_{cc}"]


def _build_tag(csrc: Path, flags: list[str]) -> str:
    """Hash of everything that changes the binary: sources, flags, torch and CUDA versions."""
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        h.update(name.encode())
        h.update((csrc / name).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    return h.hexdigest()[:16]


def _check_toolkit() -> None:
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        raise KernelBuildError("kvray CUDA kernels need a CUDA GPU; none is visible to torch")
    home = cpp_extension.CUDA_HOME
    if home is None or not (Path(home) / "bin" / "nvcc").exists():
        raise KernelBuildError(
            "kvray CUDA kernels are compiled on first use and need the CUDA toolkit (nvcc); "
            "none was found. Install it and set CUDA_HOME, or use backend='torch'."
        )
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError as exc:
            raise KernelBuildError(
                "building the kvray kernels needs ninja (pip install ninja)"
            ) from exc


def load(*, verbose: bool = False, cache_dir: Path | None = None) -> ModuleType:
    """Build (first time) and import the extension; later calls return the loaded module."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            _module = _build(verbose=verbose, cache_dir=cache_dir or DEFAULT_CACHE_DIR)
    return _module


def _build(*, verbose: bool, cache_dir: Path) -> ModuleType:
    _check_toolkit()
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    flags = [*arch_flags(major, minor), "-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    csrc = find_csrc()
    tag = _build_tag(csrc, flags)
    build_dir = cache_dir / f"sm{major}{minor}-{tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=f"kvray_kernels_{tag}",
            sources=[str(csrc / s) for s in _SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=flags,
            extra_include_paths=[str(csrc)],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except (RuntimeError, OSError) as exc:
        raise KernelBuildError(f"building the kvray kernels in {build_dir} failed: {exc}") from exc


def recommended_max_splits(max_seq_len: int) -> int:
    """Split capacity (o_part.shape[2]) for a workspace serving sequences up to max_seq_len."""
    return max(1, min(_MAX_SPLITS, math.ceil(max_seq_len / _MIN_TOKENS_PER_SPLIT)))


def decode_plan(
    batch: int,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_splits: int,
    *,
    kv_fp8: bool = False,
) -> tuple[int, int]:
    """(kernel variant, split count) decode_attention uses for this batch: shapes only."""
    variant, splits = load().decode_plan(
        batch, n_q_heads, n_kv_heads, head_dim, dtype == torch.float16, kv_fp8, 0, max_splits
    )
    return int(variant), int(splits)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache[out_cache_loc] = k and v_cache[out_cache_loc] = v in one launch (slots < 0 skipped).

    With an FP8 cache each row is quantized (kv_quant.quantize_rows, the same bytes) and its
    scale written to k_scale / v_scale."""
    load().store_kv(k, v, k_cache, v_cache, out_cache_loc, k_scale, v_scale)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    out: torch.Tensor,
    o_part: torch.Tensor,
    ml_part: torch.Tensor,
    *,
    num_splits: int = 0,
    variant: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """One query token per request over its paged KV; writes out[B, Hq, D].

    o_part [>=B, Hq, S, D] and ml_part [>=B, Hq, S, 2] (float32) hold split partials
    (size S with recommended_max_splits). The kernel layout and split count are chosen
    from B and the shapes (see decode_plan); `num_splits` / `variant` force them, for
    tests and benchmarks (variant 0 = automatic, whose layout KVRAY_DECODE_LAYOUT=split or
    head forces, for measuring; an FP8 cache has variants 1 and 5 only).
    An FP8 cache needs k_scale / v_scale and bf16 q. `counters` (int32, >= B * Hq, zeros,
    left zero): the last split of each head merges the partials, in the same launch and
    with the same bits as the combine kernel that runs without them.
    """
    # fmt: skip
    load().decode_attention(
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        page_size,
        sm_scale,
        out,
        o_part,
        ml_part,
        num_splits,
        variant,
        k_scale,
        v_scale,
        counters,
    )


MLA_MAX_SPLITS = 32


def mla_num_splits(batch: int, num_heads: int, num_sms: int) -> int:
    """Splits of mla_decode for a batch: enough blocks for two per multiprocessor (the
    kernel's shared memory allows two), from the shapes alone so graphs stay valid."""
    blocks = max(batch, 1) * -(-num_heads // 16)
    return max(1, min(MLA_MAX_SPLITS, -(-2 * num_sms // blocks)))


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    o_part: torch.Tensor,
    ml_part: torch.Tensor,
    num_splits: int,
) -> None:
    """Absorbed MLA decode: q `[B, H, 576]` (q_nope W_UK | q_pe) over one layer's latent rows
    `[n_slots, 1, 576]`; writes out `[B, H, 512]`, the weighted sum of the rows' first 512
    columns. o_part / ml_part (float32, room for B * H * num_splits partials of 512 and 2)
    hold the splits' partials; one split writes out directly."""
    load().mla_decode(
        q,
        cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale,
        out,
        o_part,
        ml_part,
        num_splits,
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    page_size: int,
    sm_scale: float,
    out: torch.Tensor,
    *,
    variant: int = 0,
) -> None:
    """Ragged causal attention of packed queries q[T, Hq, D] over paged KV; writes out.

    Sequence b owns q rows qo_indptr[b]:qo_indptr[b+1]; seq_lens[b] counts its KV
    including the new tokens (>= its query count), whose K/V must already be stored.
    The tiling is chosen from T and the batch size (prefill_variant); `variant` forces
    one, for tests and benchmarks (0 = automatic).
    """
    # fmt: skip
    load().prefill_attention(
        q,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        qo_indptr,
        page_size,
        sm_scale,
        out,
        variant,
    )


def prefill_variant(
    batch: int, num_tokens: int, num_q_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """The prefill tiling used for `batch` sequences of `num_tokens` queries in all."""
    return int(
        load().prefill_resolve_variant(
            0, batch, num_tokens, num_q_heads, head_dim, dtype == torch.float16
        )
    )


def prefill_variants() -> int:
    """Number of prefill tiling variants compiled, 0 (automatic) included."""
    return int(load().prefill_num_variants())


def prefill_kernel_info(head_dim: int, dtype: torch.dtype, variant: int) -> dict[str, int]:
    """Static facts of a prefill variant on this GPU: tile rows, residency, registers, spills."""
    rows, blocks, regs, spill = load().prefill_kernel_info(
        head_dim, dtype == torch.float16, variant
    )
    return {"tile_m": rows, "blocks_per_sm": blocks, "registers": regs, "spill_bytes": spill}


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place on [T, N] tensors: residual = residual + x, then x = rms_norm(residual) * weight."""
    load().fused_add_rms_norm(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out = rms_norm(x) * weight over the last dim of [T, N] or [T, H, N] (out may be x)."""
    load().rms_norm(x, weight, eps, out)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate-half RoPE in place on q [T, Hq, D] and k [T, Hk, D] (strided views allowed).

    cos_cache / sin_cache: float32 [max_len, D]; positions: int64 [T], each < max_len.
    """
    load().rotary(q, k, positions, cos_cache, sin_cache)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """`rotary` then `store_kv` in one launch, the same bits (a bf16 or fp16 cache; an FP8
    one quantizes whole rows and takes the two ops)."""
    load().rotary_store_kv(
        q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, out_cache_loc
    )


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]."""
    load().silu_and_mul(gate_up, out)


GEMV_MAX_ROWS = 8


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gated: bool = False,
    split: int = 0,
) -> None:
    """out [M, N] = x [M, K] @ w [N, K].T (+ bias) for M <= GEMV_MAX_ROWS: one pass over w.

    `gated` (w = [gate; up], N even): out [M, N / 2] = silu(gate) * up, the bits of
    `silu_and_mul` applied to the plain GEMV's output (with the same `split`). `split`: warps
    sharing each group of rows over K (1, 2 or 4; 0: the default)."""
    _check_one_pass("gemv", x, w, GEMV_MAX_ROWS)
    load().gemv(x, w, bias, out, gated, split)


def _check_one_pass(op: str, x: torch.Tensor, w: torch.Tensor, max_rows: int) -> None:
    # Checked here too: refusals whose message held a number crashed the process on the lent
    # GPUs until 07c17b0 (KV_CHECK in csrc/ops.cpp).
    if not 1 <= x.shape[0] <= max_rows:
        raise ValueError(f"{op} takes 1 to {max_rows} rows, got {x.shape[0]}")
    if x.shape[-1] % 8 or w.shape[-1] != x.shape[-1] or not w.is_contiguous():
        raise ValueError(f"{op}: w must be contiguous [N, K] with K % 8 == 0 and x [M, K]")


SKINNY_MAX_ROWS = 64


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gated: bool = False,
    split: int = 0,
) -> None:
    """As `gemv` for M <= SKINNY_MAX_ROWS, on tensor cores: still one pass over w, for decode
    batches too large for the GEMV's dot products. `split`: 1, 2, 4 or 8 (0: the default)."""
    _check_one_pass("skinny_gemm", x, w, SKINNY_MAX_ROWS)
    load().skinny_gemm(x, w, bias, out, gated, split)


def skinny_rope_store_kv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    num_q_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    split: int = 0,
) -> None:
    """The qkv projection's `skinny_gemm` with `rotary_store_kv`'s work in its epilogue, the
    same bits in one launch: out [M, (Hq + 2 Hk) * D] holds q and k rotated and v, and k and v
    go to slot out_cache_loc[m] of the caches [n_slots, Hk, D] (bf16 / fp16); M <=
    SKINNY_MAX_ROWS, D a multiple of 16."""
    _check_one_pass("skinny_rope_store_kv", x, w, SKINNY_MAX_ROWS)
    load().skinny_rope_store_kv(
        x, w, bias, out, positions, cos_cache, sin_cache, num_q_heads, k_cache, v_cache,
        out_cache_loc, split,
    )  # fmt: skip


def tiled_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    gated: bool = False,
    split: int = 0,
) -> None:
    """As `skinny_gemm`, with w and x staged through shared memory by blocks of 128 rows of
    w, for matrices too large for the skinny GEMM's register stream. `split`: blocks sharing
    a tile over K, 1 to 8, run as one cluster (0: tiled.cu's pick from the tile count, the
    SMs and K)."""
    _check_one_pass("tiled_gemm", x, w, SKINNY_MAX_ROWS)
    load().tiled_gemm(x, w, bias, out, gated, split)


ARGMAX_MAX_BLOCKS = 32  # csrc/launch.h kArgmaxMaxBlocks: partials a row


def argmax(
    x: torch.Tensor, out: torch.Tensor, partial: torch.Tensor, counters: torch.Tensor
) -> None:
    """out[r] = torch.argmax(x[r]) for float32 rows x [B, N], bit for bit (first index of the
    largest, NaN above all); partial: int64 [>= B * ARGMAX_MAX_BLOCKS], counters: int32 [>= B],
    zero, left zero."""
    if partial.numel() < x.shape[0] * ARGMAX_MAX_BLOCKS:
        raise ValueError(f"argmax: partial too small for {x.shape[0]} rows")
    load().argmax(x, out, partial, counters)


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory (same shape and strides) that does not keep it allocated:
    reading it is valid only while the caller knows what that memory holds."""
    return load().alias(t)


def decode_variants() -> int:
    """Number of decode tiling variants compiled (for the benchmark sweep)."""
    return int(load().decode_num_variants())


def decode_blocks_per_sm(
    head_dim: int, dtype: torch.dtype, variant: int = 0, *, kv_fp8: bool = False
) -> int:
    """Resident blocks per SM of a decode variant on this GPU (0 if not compiled)."""
    return int(load().decode_blocks_per_sm(head_dim, dtype == torch.float16, kv_fp8, variant))
