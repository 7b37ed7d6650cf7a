// Greedy sampling's argmax over each row of float32 logits, torch.argmax's answer bit for bit:
// the first index of the largest value, a NaN counting as larger than any number and -0.0 as
// equal to 0.0. torch reduces a row in one block (~29 us for a 128k vocabulary on an H100);
// here several blocks share a row and the last of them to finish merges their results.
//
// A candidate is one 64-bit key that orders as (value, then lower index) do: the value's bits
// made monotonic in the high word, the complemented index in the low word. Unsigned max then
// picks torch's answer with no tie logic, and a zero key is below every real one.
#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long argmax_key(float v, int index) {
  uint32_t bits = __float_as_uint(v == 0.f ? 0.f : v);  // -0.0 and 0.0 tie
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  if (isnan(v)) bits = 0xFFFFFFFFu;
  return (static_cast<unsigned long long>(bits) << 32) | static_cast<uint32_t>(~index);
}

__device__ __forceinline__ unsigned long long block_max(unsigned long long key) {
  __shared__ unsigned long long warp_keys[kThreads / kWarp];
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
    key = other > key ? other : key;
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) warp_keys[warp] = key;
  __syncthreads();
  if (warp == 0) {
    key = lane < kThreads / kWarp ? warp_keys[lane] : 0ull;
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
      key = other > key ? other : key;
    }
  }
  return key;  // valid in thread 0
}

// grid (blocks per row, rows): block x takes the x-th slice of its row, four floats a load
// where the row allows it.
__global__ void __launch_bounds__(kThreads) argmax_kernel(const ArgmaxParams p) {
  grid_dependency_wait();
  const int row = blockIdx.y;
  const float* x = p.x + static_cast<int64_t>(row) * p.stride;
  const int slice = p.slice;
  const int lo = blockIdx.x * slice, hi = min(p.n, lo + slice);
  unsigned long long best = 0;
  if (p.vec_ok) {
    for (int i = lo + 4 * threadIdx.x; i < hi; i += 4 * kThreads) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(x + i));
      const unsigned long long a = argmax_key(v.x, i), b = argmax_key(v.y, i + 1);
      const unsigned long long c = argmax_key(v.z, i + 2), d = argmax_key(v.w, i + 3);
      const unsigned long long ab = a > b ? a : b, cd = c > d ? c : d;
      const unsigned long long m = ab > cd ? ab : cd;
      best = m > best ? m : best;
    }
  } else {
    for (int i = lo + threadIdx.x; i < hi; i += kThreads) {
      const unsigned long long k = argmax_key(__ldg(x + i), i);
      best = k > best ? k : best;
    }
  }
  best = block_max(best);
  if (threadIdx.x != 0) return;
  if (gridDim.x == 1) {
    p.out[row] = static_cast<int64_t>(~static_cast<uint32_t>(best));
    return;
  }
  unsigned long long* partial = p.partial + static_cast<int64_t>(row) * gridDim.x;
  partial[blockIdx.x] = best;
  __threadfence();  // the partial is visible before the count says so
  if (atomicAdd(p.counters + row, 1) != static_cast<int>(gridDim.x) - 1) return;
  __threadfence();
  for (unsigned j = 0; j < gridDim.x; ++j) {
    const unsigned long long k = __ldcg(partial + j);  // from L2: other blocks wrote them
    best = k > best ? k : best;
  }
  p.out[row] = static_cast<int64_t>(~static_cast<uint32_t>(best));
  p.counters[row] = 0;  // ready for the next launch
}

// ~4k floats a block: a 128k vocabulary spreads over 32 blocks, a 49k one over 12
int argmax_blocks_per_row(int n) {
  const int blocks = (n + 4095) / 4096;
  return blocks < 1 ? 1 : (blocks > kArgmaxMaxBlocks ? kArgmaxMaxBlocks : blocks);
}

}  // namespace

cudaError_t launch_argmax(const ArgmaxParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  const int blocks = argmax_blocks_per_row(p.n);
  ArgmaxParams q = p;
  q.slice = ((p.n + blocks - 1) / blocks + 3) / 4 * 4;  // a multiple of 4: float4 loads stay aligned
  launch(argmax_kernel, dim3(blocks, p.rows), kThreads, 0, stream, q);
  return cudaGetLastError();
}

}  // namespace kvray
