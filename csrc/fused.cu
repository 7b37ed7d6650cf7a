// Fused elementwise ops of the Llama layer, bit-exact with HF transformers' torch op
// sequence on CUDA (every intermediate rounded to the activation dtype where torch
// rounds, fp32 arithmetic written with __f*_rn so nvcc cannot contract it into FMAs):
//  - RMSNorm, optionally after the residual add, in one launch;
//  - rotate-half RoPE on q and k in place, optionally writing k and v to the paged KV
//    cache in the same launch (the decode step's rotary and store_kv as one kernel);
//  - SiLU(gate) * up.
//
// RMSNorm's mean of squares must add its fp32 terms in the order torch's CUDA reduction
// (ATen/native/cuda/Reduce.cuh, mean over the last dim of a contiguous float tensor) adds
// them, or the rounded result differs in a few elements per thousand rows. That order is
// set by a launch configuration torch derives from the row length and the number of rows;
// the host code below derives the same one (torch_mean_order) and the kernel replays it:
// `lanes` virtual threads each keep four partial sums over a strided walk of the row, then
// a pairwise tree combines the lanes.
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "launch.h"
#include "rope.cuh"

namespace kvray {
namespace {

constexpr int kMaxThreads = 512;  // torch's reduce block size (mnt_wrapper<float>)

// VEC elements of T moved as one 16-byte access, or one element when VEC == 1.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load(const T* p) {
  if constexpr (VEC * sizeof(T) == 16) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    return *reinterpret_cast<Pack<T, VEC>*>(&raw);
  } else {
    Pack<T, VEC> out;
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.v[i] = p[i];
    return out;
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* p, const Pack<T, VEC>& val) {
  if constexpr (VEC * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&val);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = val.v[i];
  }
}

// ---------------------------------------------------------------- RMSNorm

template <typename T>
__device__ __forceinline__ float square(const T* row, int k) {
  const float v = Num<T>::to_f(row[k]);
  return __fmul_rn(v, v);
}

// One virtual lane's share of torch's sum of squares over a row of n elements.
// Vectorized walk (n >= 128): torch reads the float row as 16-byte groups from the first
// 16-byte boundary; `shift` elements of the row lie before it and the lanes below four
// pick up the ones after it (torch's unaligned head), the rest in groups of four.
template <typename T>
__device__ float lane_sum_vectorized(const T* row, int n, int shift, int lane, int lanes,
                                     int lanes_x) {
  float head = 0.f;
  int base = 0, end = n;
  if (shift > 0) {
    if (lane >= shift && lane < 4 && lane < lanes_x) head = __fadd_rn(0.f, square(row, lane - shift));
    base = 4 - shift;
    end = n - base;
  }
  float acc[4] = {head, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int idx = lane; idx * 4 + 3 < end; idx += lanes) {
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] = __fadd_rn(acc[q], square(row, base + idx * 4 + q));
  }
  const int tail = end - end % 4 + lane;
  if (lane < lanes_x && tail < end) acc[0] = __fadd_rn(acc[0], square(row, base + tail));
  return __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), acc[2]), acc[3]);
}

// Scalar walk (n < 128): four accumulators over elements lane, lane + lanes, ...
template <typename T>
__device__ float lane_sum_scalar(const T* row, int n, int lane, int lanes) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int idx = lane;
  for (; idx + 3 * lanes < n; idx += 4 * lanes) {
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] = __fadd_rn(acc[q], square(row, idx + q * lanes));
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (idx >= n) break;
    acc[q] = __fadd_rn(acc[q], square(row, idx));
    idx += lanes;
  }
  return __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), acc[2]), acc[3]);
}

__device__ __forceinline__ int64_t row_offset(int64_t r, int inner_rows, int64_t s_outer,
                                              int64_t s_inner) {
  return (r / inner_rows) * s_outer + (r % inner_rows) * s_inner;
}

// A thread's first kPreChunks chunks of the norm weight, loaded before the wait on the kernel
// before (weights are never its output), so that under programmatic launch they are in
// registers by the time the row's sum is known.
constexpr int kPreChunks = 2;

template <typename T, int VEC>
struct NormWeight {
  Pack<T, VEC> pre[kPreChunks];
  const T* w;

  __device__ __forceinline__ NormWeight(const T* weight, int chunks, int first, int stride)
      : w(weight) {
#pragma unroll
    for (int q = 0; q < kPreChunks; ++q) {
      const int c = first + q * stride;
      if (c < chunks) pre[q] = load<T, VEC>(w + c * VEC);
    }
  }
};

// dst = weight * round(src * scale), torch's two roundings; chunks of VEC elements, this
// thread taking chunk `first` and every `stride`-th after it (the first ones prefetched).
template <typename T, int VEC>
__device__ __forceinline__ void scale_row(const T* src, const NormWeight<T, VEC>& w, T* dst,
                                          int chunks, float scale, int first, int stride) {
  auto one = [&](int c, const Pack<T, VEC>& g) {
    Pack<T, VEC> v = load<T, VEC>(src + c * VEC);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float normed = round_to<T>(__fmul_rn(Num<T>::to_f(v.v[i]), scale));
      v.v[i] = Num<T>::from_f(__fmul_rn(Num<T>::to_f(g.v[i]), normed));
    }
    store<T, VEC>(dst + c * VEC, v);
  };
#pragma unroll
  for (int q = 0; q < kPreChunks; ++q) {
    const int c = first + q * stride;
    if (c < chunks) one(c, w.pre[q]);
  }
  for (int c = first + kPreChunks * stride; c < chunks; c += stride)
    one(c, load<T, VEC>(w.w + c * VEC));
}

// The sum of a row's `lanes` per-lane partials (this thread's: v, lane `lane`) in torch's
// order: lanes of one warp row first (block_x_reduce), then across rows (block_y_reduce),
// each a tree with the offset halving and the lower lane's value on the left. Levels whose
// pairs lie in one warp go through shuffles (v plus the value `off` lanes up: the same
// operands in the same order), the others through `mine` (shared memory, the row's lanes);
// a barrier a level cost the norm kernels ~9 in series. Every thread of the block calls it;
// `active`: this thread is one of the row's lanes. Lane 0 gets the total.
__device__ __forceinline__ float torch_tree_sum(float v, float* mine, int lane, int lanes,
                                                int lanes_x, bool active) {
  const int lx = lane % lanes_x;
  int off = lanes_x / 2;
  if (off >= kWarp) {
    if (active) mine[lane] = v;
    for (; off >= kWarp; off >>= 1) {
      __syncthreads();
      if (active && lx < off) mine[lane] = v = __fadd_rn(v, mine[lane + off]);
    }
  }
  for (; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, off));
  const int rows = lanes / lanes_x, ly = lane / lanes_x;
  if (rows > 1) {
    if (active && lx == 0) mine[lane] = v;  // lx == 0 slots are never read above
    for (int o = rows / 2; o > 0; o >>= 1) {
      __syncthreads();
      if (active && lx == 0 && ly < o) mine[lane] = v = __fadd_rn(v, mine[lane + o * lanes_x]);
    }
  }
  return v;
}

// Block: threadIdx.x = virtual lane (p.lanes of them), threadIdx.y = row within the block.
// ADD: residual = round(residual + x), then x = norm(residual). Else out = norm(x).
template <typename T, int VEC, bool ADD>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(const NormParams p) {
  const NormWeight<T, VEC> weight(static_cast<const T*>(p.weight), p.n / VEC, threadIdx.x,
                                  blockDim.x);
  grid_dependency_wait();
  __shared__ float partial[kMaxThreads];
  __shared__ float inv_rms[kMaxThreads];
  const int lane = threadIdx.x, lanes = blockDim.x, y = threadIdx.y;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + y;
  const bool live = r < p.rows;
  const int chunks = p.n / VEC;
  T* x = static_cast<T*>(p.x) + (live ? row_offset(r, p.inner_rows, p.x_outer, p.x_inner) : 0);
  T* res = static_cast<T*>(p.residual) + (ADD && live ? r * p.res_stride : 0);
  T* out = static_cast<T*>(p.out) + (live ? row_offset(r, p.inner_rows, p.out_outer, p.out_inner) : 0);
  const T* src = ADD ? res : x;

  if (ADD && live) {
    for (int c = lane; c < chunks; c += lanes) {
      Pack<T, VEC> a = load<T, VEC>(x + c * VEC), b = load<T, VEC>(res + c * VEC);
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        b.v[i] = Num<T>::from_f(__fadd_rn(Num<T>::to_f(b.v[i]), Num<T>::to_f(a.v[i])));
      store<T, VEC>(res + c * VEC, b);
    }
  }
  __syncthreads();  // the row's summed residual is complete before anyone squares it

  float s = 0.f;
  if (live) {
    s = p.vectorized ? lane_sum_vectorized(src, p.n, static_cast<int>((r * p.n) & 3), lane, lanes,
                                           p.lanes_x)
                     : lane_sum_scalar(src, p.n, lane, lanes);
  }
  const float sum = torch_tree_sum(s, partial + y * lanes, lane, lanes, p.lanes_x, true);
  if (lane == 0) inv_rms[y] = rsqrtf(__fadd_rn(__fmul_rn(sum, p.inv_n), p.eps));
  __syncthreads();
  if (!live) return;

  scale_row<T, VEC>(src, weight, ADD ? x : out, chunks, inv_rms[y], lane, lanes);
}

// The same arithmetic for one row per block, where a row has n >= kRowKernelMinN or the
// tensor at most kRowKernelMaxRows rows: the block stages the row (after the residual add)
// in shared memory with 16-byte accesses from all its threads, the first p.lanes threads
// replay torch's per-lane sums from there, and all threads normalize. The kernel above
// walks global memory lane by lane: with few lanes per row (torch picks 32 for 32 rows of
// 4096) every lane waits on ~100 dependent loads, and 8 rows share a block; with one row of
// a decode step it reads the row from memory three times in series.
template <typename T, int VEC, bool ADD>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_row_kernel(const NormParams p) {
  const NormWeight<T, VEC> weight(static_cast<const T*>(p.weight), p.n / VEC, threadIdx.x,
                                  blockDim.x);
  grid_dependency_wait();
  extern __shared__ __align__(16) unsigned char staged[];
  __shared__ float partial[kMaxThreads];
  __shared__ float inv_rms;
  T* row = reinterpret_cast<T*>(staged);
  const int tid = threadIdx.x, threads = blockDim.x, lanes = p.lanes;
  const int64_t r = blockIdx.x;
  const int chunks = p.n / VEC;
  T* x = static_cast<T*>(p.x) + row_offset(r, p.inner_rows, p.x_outer, p.x_inner);
  T* res = static_cast<T*>(p.residual) + (ADD ? r * p.res_stride : 0);
  T* out = static_cast<T*>(p.out) + row_offset(r, p.inner_rows, p.out_outer, p.out_inner);

  for (int c = tid; c < chunks; c += threads) {
    Pack<T, VEC> a = load<T, VEC>(x + c * VEC);
    if constexpr (ADD) {
      Pack<T, VEC> b = load<T, VEC>(res + c * VEC);
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        b.v[i] = Num<T>::from_f(__fadd_rn(Num<T>::to_f(b.v[i]), Num<T>::to_f(a.v[i])));
      store<T, VEC>(res + c * VEC, b);
      a = b;
    }
    store<T, VEC>(row + c * VEC, a);
  }
  __syncthreads();

  float s = 0.f;
  if (tid < lanes) {
    s = p.vectorized ? lane_sum_vectorized(row, p.n, static_cast<int>((r * p.n) & 3), tid, lanes, p.lanes_x)
                     : lane_sum_scalar(row, p.n, tid, lanes);
  }
  const float sum = torch_tree_sum(s, partial, tid, lanes, p.lanes_x, tid < lanes);
  if (tid == 0) inv_rms = rsqrtf(__fadd_rn(__fmul_rn(sum, p.inv_n), p.eps));
  __syncthreads();

  scale_row<T, VEC>(row, weight, ADD ? x : out, chunks, inv_rms, tid, threads);
}

constexpr int kRowKernelMinN = 1024;
constexpr int kRowKernelMaxRows = 8;  // fewer rows (decode steps) take it at any n
constexpr int kRowKernelMaxBytes = 48 * 1024;  // static shared-memory limit without opt-in

int last_pow2(int n) {
  n |= n >> 1;
  n |= n >> 2;
  n |= n >> 4;
  n |= n >> 8;
  n |= n >> 16;
  return std::max(1, n - (n >> 1));
}

// ---------------------------------------------------------------- RoPE

// Heads a token's threads cover: q, k, and with a cache v (copied, not rotated).
__host__ __device__ __forceinline__ int rotary_heads(const RotaryParams& p) {
  return p.num_q_heads + p.num_k_heads * (p.k_cache != nullptr ? 2 : 1);
}

// VEC float32 values from p (16-byte loads where VEC is a multiple of 4; p then aligned).
template <int VEC>
__device__ __forceinline__ void load_floats(const float* p, float (&out)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int j = 0; j < VEC / 4; ++j) {
      const float4 v = reinterpret_cast<const float4*>(p)[j];
      out[4 * j] = v.x, out[4 * j + 1] = v.y, out[4 * j + 2] = v.z, out[4 * j + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = p[j];
  }
}

// Block (token, y): a thread per VEC pairs (d .. d + VEC - 1, each with d + D/2) of one head
// of q, k, then v, which rotate together. With a cache, the token's k and v also go to slot
// loc[token] (none if < 0). 32-bit index math and 16-byte accesses: a prompt step's rotary
// ran at a fifth of HBM bandwidth with a thread per pair and 64-bit divisions. The slot,
// the position and its cos/sin rows (step metadata and constant tables, never the kernel
// before's output) are read before the wait, so only q/k/v's loads follow it.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) rotary_kernel(const RotaryParams p) {
  const int half = p.head_dim / 2, per_head = half / VEC;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= rotary_heads(p) * per_head) return;
  const int64_t t = blockIdx.x;
  int h = c / per_head;
  const int d = (c - h * per_head) * VEC;
  const int64_t slot = p.k_cache != nullptr ? p.loc[t] : -1;
  T* x;
  T* cached = nullptr;  // where this head goes in the cache, if anywhere
  if (h < p.num_q_heads) {
    x = static_cast<T*>(p.q) + t * p.q_stride_t + h * p.q_stride_h;
  } else if ((h -= p.num_q_heads) < p.num_k_heads) {
    x = static_cast<T*>(p.k) + t * p.k_stride_t + h * p.k_stride_h;
    if (slot >= 0) cached = static_cast<T*>(p.k_cache) + slot * p.slot_stride + h * p.head_dim;
  } else {
    if (slot < 0) return;
    h -= p.num_k_heads;
    const T* v = static_cast<const T*>(p.v) + t * p.v_stride_t + h * p.v_stride_h;
    T* dst = static_cast<T*>(p.v_cache) + slot * p.slot_stride + h * p.head_dim;
    grid_dependency_wait();
    store<T, VEC>(dst + d, load<T, VEC>(v + d));
    store<T, VEC>(dst + d + half, load<T, VEC>(v + d + half));
    return;
  }
  const int64_t row = p.positions[t] * p.head_dim;
  float c1[VEC], c2[VEC], s1[VEC], s2[VEC];
  load_floats<VEC>(p.cos + row + d, c1);
  load_floats<VEC>(p.cos + row + d + half, c2);
  load_floats<VEC>(p.sin + row + d, s1);
  load_floats<VEC>(p.sin + row + d + half, s2);
  grid_dependency_wait();
  Pack<T, VEC> a = load<T, VEC>(x + d), b = load<T, VEC>(x + d + half);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float2 y = rotate_half_pair<T>(Num<T>::to_f(a.v[i]), Num<T>::to_f(b.v[i]), c1[i], c2[i],
                                         s1[i], s2[i]);
    a.v[i] = Num<T>::from_f(y.x);
    b.v[i] = Num<T>::from_f(y.y);
  }
  store<T, VEC>(x + d, a);
  store<T, VEC>(x + d + half, b);
  if (cached != nullptr) {
    store<T, VEC>(cached + d, a);
    store<T, VEC>(cached + d + half, b);
  }
}

// ---------------------------------------------------------------- SiLU * up

template <typename T, int VEC>
__global__ void __launch_bounds__(256) silu_and_mul_kernel(const SiluMulParams p) {
  grid_dependency_wait();
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c * VEC >= p.inter) return;
  const int64_t t = blockIdx.x;
  const T* gate = static_cast<const T*>(p.gate_up) + t * p.in_stride + c * VEC;
  const Pack<T, VEC> g = load<T, VEC>(gate), u = load<T, VEC>(gate + p.inter);
  Pack<T, VEC> o;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float a = Num<T>::to_f(g.v[i]);
    const float act = round_to<T>(a / (1.0f + expf(-a)));  // torch's silu, in fp32
    o.v[i] = Num<T>::from_f(__fmul_rn(act, Num<T>::to_f(u.v[i])));
  }
  store<T, VEC>(static_cast<T*>(p.out) + t * p.out_stride + c * VEC, o);
}

template <template <typename> class F, typename... Args>
cudaError_t by_dtype(DType dtype, Args&&... args) {
  if (dtype == DType::kBF16) return F<__nv_bfloat16>::run(args...);
  if (dtype == DType::kFP16) return F<__half>::run(args...);
  return F<float>::run(args...);
}

template <typename T>
struct LaunchNorm {
  static cudaError_t run(const NormParams& p, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    const size_t row_bytes = static_cast<size_t>(p.n) * sizeof(T);
    if ((p.n >= kRowKernelMinN || p.rows <= kRowKernelMaxRows) && row_bytes <= kRowKernelMaxBytes) {
      const unsigned threads = static_cast<unsigned>(std::max(p.lanes, 256));
      const dim3 rows(static_cast<unsigned>(p.rows));
      if (p.residual != nullptr) {
        if (p.vec_ok) launch(rms_norm_row_kernel<T, kVec, true>, rows, threads, row_bytes, stream, p);
        else launch(rms_norm_row_kernel<T, 1, true>, rows, threads, row_bytes, stream, p);
      } else {
        if (p.vec_ok) launch(rms_norm_row_kernel<T, kVec, false>, rows, threads, row_bytes, stream, p);
        else launch(rms_norm_row_kernel<T, 1, false>, rows, threads, row_bytes, stream, p);
      }
      return cudaGetLastError();
    }
    const dim3 block(p.lanes, std::max(1, 256 / p.lanes));
    const dim3 grid(static_cast<unsigned>((p.rows + block.y - 1) / block.y));
    if (p.residual != nullptr) {
      if (p.vec_ok) launch(rms_norm_kernel<T, kVec, true>, grid, block, 0, stream, p);
      else launch(rms_norm_kernel<T, 1, true>, grid, block, 0, stream, p);
    } else {
      if (p.vec_ok) launch(rms_norm_kernel<T, kVec, false>, grid, block, 0, stream, p);
      else launch(rms_norm_kernel<T, 1, false>, grid, block, 0, stream, p);
    }
    return cudaGetLastError();
  }
};

// Every pointer 16-byte aligned and every stride a whole number of 16-byte groups: then a
// thread takes 16 bytes of each half of a head (the cos / sin rows: float4 loads).
inline bool rotary_vec_ok(const RotaryParams& p, int vec) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool cache = p.k_cache != nullptr;
  return p.head_dim % (2 * vec) == 0 && p.head_dim % 4 == 0 && aligned(p.q) && aligned(p.k) &&
         aligned(p.cos) && aligned(p.sin) && p.q_stride_t % vec == 0 && p.q_stride_h % vec == 0 &&
         p.k_stride_t % vec == 0 && p.k_stride_h % vec == 0 &&
         (!cache || (aligned(p.v) && aligned(p.k_cache) && aligned(p.v_cache) &&
                     p.v_stride_t % vec == 0 && p.v_stride_h % vec == 0 && p.slot_stride % vec == 0));
}

template <typename T>
struct LaunchRotary {
  static cudaError_t run(const RotaryParams& p, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec_ok = rotary_vec_ok(p, kVec);
    const int groups = rotary_heads(p) * (p.head_dim / 2) / (vec_ok ? kVec : 1);  // threads a token
    const int threads = std::min(256, (groups + 31) / 32 * 32);
    const dim3 grid(static_cast<unsigned>(p.num_tokens), (groups + threads - 1) / threads);
    if (vec_ok) launch(rotary_kernel<T, kVec>, grid, threads, 0, stream, p);
    else launch(rotary_kernel<T, 1>, grid, threads, 0, stream, p);
    return cudaGetLastError();
  }
};

template <typename T>
struct LaunchSiluMul {
  static cudaError_t run(const SiluMulParams& p, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    const int vec = p.vec_ok ? kVec : 1;
    const dim3 grid(static_cast<unsigned>(p.num_tokens), (p.inter / vec + 255) / 256);
    if (p.vec_ok) launch(silu_and_mul_kernel<T, kVec>, grid, 256, 0, stream, p);
    else launch(silu_and_mul_kernel<T, 1>, grid, 256, 0, stream, p);
    return cudaGetLastError();
  }
};

}  // namespace

// torch's launch configuration for mean(-1) of a contiguous float [rows, n] tensor
// (setReduceConfig in ATen/native/cuda/Reduce.cuh), reduced to what fixes the order of
// the additions. Returns false when torch would also split rows across blocks (n beyond
// ~128k), an order the kernel does not replay.
bool torch_mean_order(int64_t n, int64_t rows, MeanOrder* order) {
  const bool vectorized = n >= 128;  // "vectorize along input": groups of 4 floats
  const int64_t dim0 = vectorized ? n / 4 : n;
  const int d0 = dim0 < kMaxThreads ? last_pow2(static_cast<int>(dim0)) : kMaxThreads;
  const int d1 = rows < kMaxThreads ? last_pow2(static_cast<int>(rows)) : kMaxThreads;
  int bw = std::min(d0, 32);
  const int bh = std::min(d1, kMaxThreads / bw);
  bw = std::min(d0, kMaxThreads / bh);
  int64_t step = bw;
  const bool across_warps = (n + step - 1) / step >= std::min(bh * 16, 256);
  if (across_warps) step *= bh;
  if (across_warps && (n + step - 1) / step >= 256) return false;
  order->lanes_x = bw;
  order->lanes = across_warps ? bw * bh : bw;
  order->vectorized = vectorized;
  return true;
}

cudaError_t launch_rms_norm(const NormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return by_dtype<LaunchNorm>(p.dtype, p, stream);
}

cudaError_t launch_rotary(const RotaryParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  return by_dtype<LaunchRotary>(p.dtype, p, stream);
}

cudaError_t launch_silu_and_mul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.inter == 0) return cudaSuccess;
  return by_dtype<LaunchSiluMul>(p.dtype, p, stream);
}

}  // namespace kvray
