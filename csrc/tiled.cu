// Tiled skinny GEMM for decode batches on large matrices: out[M, N] = x[M, K] @ w[N, K]^T
// (+ bias) for M <= 64, where the weights (tens to hundreds of MB) are one pass and the only
// cost that matters is streaming them at the copy ceiling.
//
// skinny.cu streams w through registers and has every warp read all of x through L1: on the
// 8B shape's matrices that is 2-4x the weight bytes in L1 and L2 traffic, and it lost to
// cuBLAS. Here a block of 4 warps owns a 128-row tile of w and a K range of it; w and x come
// into shared memory in 64-K stages through a cp.async ring (kStages deep, the next stages'
// bytes in flight while this one's MMAs run), x once per block instead of once per warp, and
// ldmatrix feeds mma.sync. The weights of the first stages are loaded before the wait on the
// kernel before (they are never its output), so they stream while it finishes.
//
// A matrix with too few tiles to fill the SMs splits K over up to 8 blocks, run as one
// thread-block cluster: each leaves its float32 partial sums in its shared memory, then each
// finishes a share of the tile's outputs, adding every block's partials of them in rank order
// through distributed shared memory: the result does not depend on which block finishes
// first, and no workspace or counters are needed.
//
// Gated (w = [gate; up], N = 2 * inter): a tile is 64 gate rows and the 64 up rows that go
// with them, placed so that the lane holding gate(m, j) also holds up(m, j), and writes
// silu(gate) * up as silu_and_mul would from the two rounded outputs (as the GEMV does).
// Where the engine runs it (the large matrices at a few tokens) is CudaOps' choice,
// worker/model/ops.py.
#include <cooperative_groups.h>

#include <algorithm>

#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kTileN = 128;  // rows of w a block owns (gated: 64 gate rows, 64 up rows)
constexpr int kTileK = 64;   // K a stage: 128-byte rows, eight 16-byte chunks
constexpr int kStages = 4;
constexpr int kMaxSplit = 8;  // blocks a cluster: the portable cluster size
constexpr int kChunks = kTileK / 8;

template <int MT>
struct Smem {
  static constexpr int kW = kTileN * kTileK, kX = MT * 16 * kTileK;  // elements a stage
  static constexpr int kStageBytes = (kW + kX) * 2;
  static constexpr int kBytes = kStages * kStageBytes;
  // the partial sums a block leaves for the cluster's merge, over the ring once it is done
  static constexpr int kAcc = MT * 4 * 4;  // floats a thread: [MT][4 n tiles][4]
  static_assert(kAcc * kThreads * 4 <= kBytes, "the partials fit in the ring");
};

// Splits of K: p.split when set. Else, where the tiles fill at most half a wave of resident
// blocks (two an SM), as many splits as fit that wave beside them, each keeping two stages
// of K; where they fill more, one split per 8 stages of K (512), at most kMaxSplit: the
// fastest split measured on every 8B and demo matrix but one (docs/performance.md, fifteenth
// session). Always 1 before Hopper (no clusters) or with KVRAY_TILED_CLUSTER=0.
int tiled_split(const GemvParams& p) {
  static const bool clusters = hopper_feature_on("KVRAY_TILED_CLUSTER");
  if (!clusters) return 1;
  if (p.split != 0) return p.split;
  const int rows_per_tile = p.gated ? kTileN / 2 : kTileN;
  const int tiles = ((p.gated ? p.n / 2 : p.n) + rows_per_tile - 1) / rows_per_tile;
  const int iters = (p.k + kTileK - 1) / kTileK;
  const int slots = 2 * p.num_sms;
  if (2 * tiles > slots) return std::max(1, std::min(kMaxSplit, iters / 8));
  int split = 1;
  while (split < kMaxSplit && tiles * (split + 1) <= slots && iters >= 2 * (split + 1)) ++split;
  return split;
}

// Row of w behind row r (0..127) of a block's tile: plain, rows n0 + r; gated, gate rows
// j0 + r for r < 64 and up rows inter + j0 + r - 64 after. ok: the row exists.
__device__ __forceinline__ int w_row(const GemvParams& p, int tile, int r, bool gated, bool& ok) {
  if (!gated) {
    const int row = tile * kTileN + r;
    ok = row < p.n;
    return row;
  }
  const int inter = p.n / 2, j = tile * (kTileN / 2) + (r & (kTileN / 2 - 1));
  ok = j < inter;
  return r < kTileN / 2 ? j : inter + j;
}

// Issue stage `it`'s loads (K it * 64 ..) into ring slot `slot`: w's 128 rows when W, x's
// MT * 16 rows when X. Rows past the matrix and chunks past K are zero-filled.
template <typename T, int MT, bool GATED, bool W, bool X>
__device__ __forceinline__ void load_stage(const GemvParams& p, int tile, int it, T* slot) {
  const int k_chunks = p.k / 8, c0 = it * kChunks;
  if constexpr (W) {
    const T* w = static_cast<const T*>(p.w);
#pragma unroll
    for (int i = 0; i < kTileN * kChunks / kThreads; ++i) {
      const int idx = threadIdx.x + i * kThreads, r = idx / kChunks, c = idx % kChunks;
      bool ok;
      const int row = w_row(p, tile, r, GATED, ok);
      ok = ok && c0 + c < k_chunks;
      const T* src = w + (ok ? static_cast<int64_t>(row) * p.k + (c0 + c) * 8 : 0);
      cp_async16(slot + swz<kTileK>(r, c), src, ok);
    }
  }
  if constexpr (X) {
    const T* x = static_cast<const T*>(p.x);
    T* xs = slot + Smem<MT>::kW;
#pragma unroll
    for (int i = 0; i < MT * 16 * kChunks / kThreads; ++i) {
      const int idx = threadIdx.x + i * kThreads, r = idx / kChunks, c = idx % kChunks;
      const bool ok = r < p.m && c0 + c < k_chunks;
      const T* src = x + (ok ? r * p.x_stride + (c0 + c) * 8 : 0);
      cp_async16(xs + swz<kTileK>(r, c), src, ok);
    }
  }
}

// Writes one unit of a lane's sums (see the kernel's end): v0 of n tile nt, v1 of n tile
// nt + 2, for row m = mt * 16 + g (+ 8 when e >= 2) of x. Plain: the two outputs plus bias,
// rounded once; gated: silu(gate) * up from the two rounded outputs, as silu_and_mul.
template <typename T, bool GATED>
__device__ __forceinline__ void finish(const GemvParams& p, int tile, int warp, int lane, int mt,
                                       int nt, int e, float v0, float v1) {
  const int g = lane / 4, t = lane % 4;
  const int m = mt * 16 + g + (e >= 2 ? 8 : 0);
  if (m >= p.m) return;
  const int r = 16 * warp + 8 * nt + 2 * t + (e & 1);  // the tile row of v0; v1's is r + 64
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(m) * p.out_stride;
  const T* bias = static_cast<const T*>(p.bias);
  bool ok;
  if constexpr (GATED) {
    const int j = w_row(p, tile, r, true, ok), inter = p.n / 2;
    if (!ok) return;
    const float bg = bias != nullptr ? Num<T>::to_f(bias[j]) : 0.f;
    const float bu = bias != nullptr ? Num<T>::to_f(bias[inter + j]) : 0.f;
    const float a = Num<T>::to_f(Num<T>::from_f(v0 + bg));
    const float up = Num<T>::to_f(Num<T>::from_f(v1 + bu));
    const float act = Num<T>::to_f(Num<T>::from_f(a / (1.0f + expf(-a))));  // torch's silu
    out[j] = Num<T>::from_f(__fmul_rn(act, up));
  } else {
    const int row0 = w_row(p, tile, r, false, ok);
    if (ok) out[row0] = Num<T>::from_f(v0 + (bias != nullptr ? Num<T>::to_f(bias[row0]) : 0.f));
    const int row1 = w_row(p, tile, r + kTileN / 2, false, ok);
    if (ok) out[row1] = Num<T>::from_f(v1 + (bias != nullptr ? Num<T>::to_f(bias[row1]) : 0.f));
  }
}

// One block: tile blockIdx.x / split of w over the split-th K range (blockIdx.x % split, the
// block's rank in its cluster). A warp's four 8-row n tiles: tiles 0 and 1 are the tile's rows
// 16 * warp .. + 15; tiles 2 and 3 are rows 64 + 16 * warp .. + 15 (gated: the up rows of
// tiles 0 and 1's gate rows).
template <typename T, int MT, bool GATED>
__global__ void __launch_bounds__(kThreads, 2) tiled_kernel(const GemvParams p, int split) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  T* ring = reinterpret_cast<T*>(smem_raw);
  constexpr int kStageElems = Smem<MT>::kStageBytes / 2;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int tile = blockIdx.x / split, part = blockIdx.x % split;
  const int iters = (p.k + kTileK - 1) / kTileK;
  const int per_part = (iters + split - 1) / split;
  const int it_begin = min(iters, part * per_part), it_end = min(iters, it_begin + per_part);
  const int n_it = it_end - it_begin;

  // The first stages' weights, then (after the wait) their x: one commit group each for the
  // weights, one for all of x, so the first iteration waits for everything in the ring.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_it) load_stage<T, MT, GATED, true, false>(p, tile, it_begin + s, ring + s * kStageElems);
    cp_async_commit();
  }
  grid_dependency_wait();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < n_it) load_stage<T, MT, GATED, false, true>(p, tile, it_begin + s, ring + s * kStageElems);
  cp_async_commit();

  // ldmatrix row addresses (element offsets within a stage), per k16 step kk via swz_step:
  // A (x, rows mt * 16 + lane % 16, chunk lane / 16); B (w, row of matrix lane / 8).
  const int a_off = swz<kTileK>(lane % 16, lane / 16);
  const int q = lane / 8, b_row = (q / 2) * 8 + lane % 8;
  const int b_off0 = swz<kTileK>(16 * warp + b_row, q % 2);
  const int b_off1 = swz<kTileK>(kTileN / 2 + 16 * warp + b_row, q % 2);

  float acc[MT][4][4] = {};
  for (int i = 0; i < n_it; ++i) {
    if (i == 0) {
      cp_async_wait<0>();
    } else {
      cp_async_wait<kStages - 2>();
    }
    __syncthreads();  // stage i is in, and every warp is done with the slot refilled below
    const int next = i + kStages - 1;
    if (next < n_it)
      load_stage<T, MT, GATED, true, true>(p, tile, it_begin + next, ring + (next % kStages) * kStageElems);
    cp_async_commit();

    const T* ws = ring + (i % kStages) * kStageElems;
    const T* xs = ws + Smem<MT>::kW;
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      uint32_t b[2][4];
      ldsm_x4(b[0], ws + swz_step(b_off0, kk));
      ldsm_x4(b[1], ws + swz_step(b_off1, kk));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t a[4];
        ldsm_x4(a, xs + mt * 16 * kTileK + swz_step(a_off, kk));
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          Dtype<T>::mma(acc[mt][nt], a, b[nt / 2][2 * (nt % 2)], b[nt / 2][2 * (nt % 2) + 1]);
      }
    }
  }

  // acc[mt][nt] holds C(m, col) for m = mt * 16 + g (+ 8 in [2], [3]), col = 2t, 2t + 1 of
  // n tile nt's 8 rows. A unit (mt, nt < 2, e) is one value of n tile nt and one of nt + 2:
  // two outputs, or (gated) the gate and up values of one.
#if KVRAY_CLUSTERS  // tiled_split gives 1 before Hopper
  constexpr int kUnits = MT * 2 * 4;
  if (split > 1) {  // rank r of the cluster adds every rank's partials of units r, r + split, ..
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cp_async_wait<0>();
    __syncthreads();  // the ring is free
    float* mine = reinterpret_cast<float*>(smem_raw);  // [kAcc][kThreads]
    const float* flat = &acc[0][0][0];
#pragma unroll
    for (int e = 0; e < Smem<MT>::kAcc; ++e) mine[e * kThreads + threadIdx.x] = flat[e];
    cluster.sync();
    for (int u = part; u < kUnits; u += split) {
      const int mt = u / 8, nt = u / 4 % 2, e = u % 4;
      const int i0 = ((mt * 4 + nt) * 4 + e) * kThreads + threadIdx.x;
      const int i1 = i0 + 8 * kThreads;  // acc[mt][nt + 2][e]
      float v0 = 0.f, v1 = 0.f;
      for (int r = 0; r < split; ++r) {  // in rank order: the same bits whoever finished first
        const float* theirs = cluster.map_shared_rank(mine, r);
        v0 += theirs[i0], v1 += theirs[i1];
      }
      finish<T, GATED>(p, tile, warp, lane, mt, nt, e, v0, v1);
    }
    cluster.sync();  // every block's partials stay until the others have read them
    return;
  }
#endif
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        finish<T, GATED>(p, tile, warp, lane, mt, nt, e, acc[mt][nt][e], acc[mt][nt + 2][e]);
}

template <typename T, int MT, bool GATED>
cudaError_t launch_gated(const GemvParams& p, cudaStream_t stream) {
  constexpr int smem = Smem<MT>::kBytes;
  auto kernel = tiled_kernel<T, MT, GATED>;
  static const cudaError_t set =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (set != cudaSuccess) return set;
  const int split = tiled_split(p);
  if (split < 1 || split > kMaxSplit) return cudaErrorInvalidValue;
  const int rows_per_tile = GATED ? kTileN / 2 : kTileN;
  const int tiles = ((GATED ? p.n / 2 : p.n) + rows_per_tile - 1) / rows_per_tile;
  const dim3 grid(static_cast<unsigned>(tiles * split));
  return launch_clustered(kernel, grid, kThreads, smem, stream,
                          static_cast<unsigned>(split > 1 ? split : 0), p, split);
}

template <typename T, int MT>
cudaError_t launch_tiles(const GemvParams& p, cudaStream_t stream) {
  return p.gated ? launch_gated<T, MT, true>(p, stream) : launch_gated<T, MT, false>(p, stream);
}

}  // namespace

cudaError_t launch_tiled_gemm(const GemvParams& p, cudaStream_t stream) {
  return dispatch_gemm(p, [&](auto dtype, auto mt) {
    return launch_tiles<decltype(dtype), decltype(mt)::value>(p, stream);
  });
}

}  // namespace kvray
