// Skinny GEMM for decode batches: out[M, N] = x[M, K] @ w[N, K]^T (+ bias) for M <= 8.
//
// At decode batch sizes a linear layer is one pass over its weights. Each warp owns kRows
// consecutive rows of w and streams them with 16-byte loads, kUnroll chunks per row in
// flight per lane before any arithmetic (so enough bytes are outstanding per SM to cover
// HBM latency); the M activation rows are tiny and come through L1. Every lane keeps
// float32 partial dot products, reduced across the warp at the end, then rounded once.
//
// Gated (the MLP's gate_up projection, w = [gate; up], N = 2 * inter): warp j takes gate
// row j and up row inter + j and writes silu(gate) * up as silu_and_mul would from the two
// rounded outputs, bit for bit, so a decode step needs no activation kernel.
#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / kWarp;
constexpr int kRows = 2;    // rows of w per warp
constexpr int kUnroll = 4;  // 16-byte chunks of each row a lane loads before using them

// Warps sharing a row group (1, 2 or 4): p.split when set, else KVRAY_GEMV_SPLIT when set (for
// measuring), else the fewest that give at least two blocks an SM, or more while each part
// keeps a whole pass of the warp's loads (the 8B shape's rows: 4 measured fastest there).
int gemv_split(const GemvParams& p) {
  static const int forced = [] {
    const char* env = std::getenv("KVRAY_GEMV_SPLIT");
    return env != nullptr ? std::atoi(env) : 0;
  }();
  if (p.split != 0) return p.split;
  if (forced != 0) return forced;
  const int out_rows = p.gated ? p.n / 2 : p.n;
  const int rows_per_block = p.gated ? kWarps : kWarps * kRows;  // at split 1
  const int blocks = (out_rows + rows_per_block - 1) / rows_per_block;
  const int chunks = p.k / 8;
  int split = 1;
  while (split < 4 && (blocks * split < 2 * p.num_sms || chunks / (2 * split) >= kWarp * kUnroll))
    split *= 2;
  return split;
}

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float f[8]) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = Dtype<T>::unpack(u[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// kUnroll 16-byte chunks of each of this warp's kRows rows of w (row_gap chunks apart),
// from a lane's chunk c0 on.
template <typename T>
__device__ __forceinline__ void load_w(const uint4* w, int chunks, int64_t row_gap,
                                       bool second_row, int c0, uint4 (&wv)[kUnroll][kRows]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int c = c0 + u * kWarp;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool ok = c < chunks && (r == 0 || second_row);
      wv[u][r] = ok ? __ldcs(w + r * row_gap + c) : make_uint4(0, 0, 0, 0);
    }
  }
}

// The warp's first chunks of w are loaded before the wait on the kernel before: weights are
// never a previous kernel's output, so with programmatic dependent launch their first bytes
// are in flight while that kernel finishes.
//
// SPLIT > 1: SPLIT warps share a group of rows, each taking a contiguous SPLIT-th of K, and
// the group's first warp adds their sums in a fixed order. More, shorter blocks: a small
// matrix (qkv, o, and down with its long rows) then fills the SMs evenly and its last
// blocks finish sooner.
template <typename T, int M, bool GATED, int SPLIT>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const GemvParams p) {
  constexpr int kGroups = kWarps / SPLIT;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int group = warp / SPLIT, part = warp % SPLIT;
  const int inter = p.n / 2;
  // this group's rows: row0 and row0 + 1, or (gated) gate row0 and up row inter + row0
  const int row0 = (blockIdx.x * kGroups + group) * (GATED ? 1 : kRows);
  const bool has_rows = row0 < (GATED ? inter : p.n);
  const int chunks = p.k / 8;
  const int per_part = (chunks + SPLIT - 1) / SPLIT;
  const int c_begin = part * per_part, c_end = min(chunks, c_begin + per_part);
  const int64_t row_gap = static_cast<int64_t>(GATED ? inter : 1) * chunks;
  const uint4* w = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w)) +
                   static_cast<int64_t>(row0) * chunks;
  const bool second_row = GATED || row0 + 1 < p.n;
  uint4 wv[kUnroll][kRows];
  if (has_rows) load_w<T>(w, c_end, row_gap, second_row, c_begin + lane, wv);
  grid_dependency_wait();
  if (SPLIT == 1 && !has_rows) return;  // with SPLIT > 1 every warp reaches the barrier below
  const uint4* x = reinterpret_cast<const uint4*>(p.x);
  const int64_t x_chunks = p.x_stride / 8;
  float acc[M][kRows] = {};
  for (int c0 = c_begin + lane; has_rows && c0 < c_end; c0 += kWarp * kUnroll) {
    if (c0 != c_begin + lane) load_w<T>(w, c_end, row_gap, second_row, c0, wv);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * kWarp;
      if (c < c_end) {
        float wf[kRows][8];
#pragma unroll
        for (int r = 0; r < kRows; ++r) unpack8<T>(wv[u][r], wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[8];
          unpack8<T>(__ldg(x + m * x_chunks + c), xf);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[m][r] = fmaf(wf[r][i], xf[i], acc[m][r]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int off = kWarp / 2; off > 0; off >>= 1)
        acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], off);
  if constexpr (SPLIT > 1) {
    __shared__ float parts[kWarps][M][kRows];
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < kRows; ++r) parts[warp][m][r] = acc[m][r];
    }
    __syncthreads();
    if (part != 0 || !has_rows) return;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float sum = parts[warp][m][r];
#pragma unroll
        for (int q = 1; q < SPLIT; ++q) sum += parts[warp + q][m][r];
        acc[m][r] = sum;
      }
  }
  if (lane != 0) return;
  T* out = static_cast<T*>(p.out);
  const T* bias = static_cast<const T*>(p.bias);
  if constexpr (GATED) {
    const float bg = bias != nullptr ? Num<T>::to_f(bias[row0]) : 0.f;
    const float bu = bias != nullptr ? Num<T>::to_f(bias[inter + row0]) : 0.f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float a = Num<T>::to_f(Num<T>::from_f(acc[m][0] + bg));
      const float up = Num<T>::to_f(Num<T>::from_f(acc[m][1] + bu));
      const float act = Num<T>::to_f(Num<T>::from_f(a / (1.0f + expf(-a))));  // torch's silu
      out[m * p.out_stride + row0] = Num<T>::from_f(__fmul_rn(act, up));
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row0 + r;
    if (row >= p.n) break;
    const float b = bias != nullptr ? Num<T>::to_f(bias[row]) : 0.f;  // added before the rounding
#pragma unroll
    for (int m = 0; m < M; ++m) out[m * p.out_stride + row] = Num<T>::from_f(acc[m][r] + b);
  }
}

template <typename T, int M, int SPLIT>
void launch_split(const GemvParams& p, cudaStream_t stream) {
  const int groups = kWarps / SPLIT;
  const int rows_per_block = p.gated ? groups : groups * kRows;
  const int out_rows = p.gated ? p.n / 2 : p.n;
  const unsigned blocks = static_cast<unsigned>((out_rows + rows_per_block - 1) / rows_per_block);
  if (p.gated) {
    launch(gemv_kernel<T, M, true, SPLIT>, blocks, kThreads, 0, stream, p);
  } else {
    launch(gemv_kernel<T, M, false, SPLIT>, blocks, kThreads, 0, stream, p);
  }
}

template <typename T, int M>
cudaError_t launch_rows(const GemvParams& p, cudaStream_t stream) {
  switch (gemv_split(p)) {
    case 1: launch_split<T, M, 1>(p, stream); break;
    case 2: launch_split<T, M, 2>(p, stream); break;
    case 4: launch_split<T, M, 4>(p, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const GemvParams& p, cudaStream_t stream) {
  switch (p.m) {
    case 1: return launch_rows<T, 1>(p, stream);
    case 2: return launch_rows<T, 2>(p, stream);
    case 3: return launch_rows<T, 3>(p, stream);
    case 4: return launch_rows<T, 4>(p, stream);
    case 5: return launch_rows<T, 5>(p, stream);
    case 6: return launch_rows<T, 6>(p, stream);
    case 7: return launch_rows<T, 7>(p, stream);
    case 8: return launch_rows<T, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_gemv(const GemvParams& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (p.dtype == DType::kBF16) return launch_typed<__nv_bfloat16>(p, stream);
  if (p.dtype == DType::kFP16) return launch_typed<__half>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvray
