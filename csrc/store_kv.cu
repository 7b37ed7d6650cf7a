// KV write for the new tokens of a step: K and V rows of T tokens scattered to their slots
// in one launch (16-byte copies; a negative slot is skipped). Grid depends on T only.
#include <algorithm>

#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

__global__ void __launch_bounds__(256) store_kv_kernel(const StoreParams p) {
  const int chunks = p.head_dim / 8;
  const int64_t per_token = static_cast<int64_t>(p.num_kv_heads) * chunks;
  const int64_t total = p.num_tokens * per_token;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < 2 * total;
       i += step) {
    const bool is_v = i >= total;
    const int64_t j = is_v ? i - total : i;
    const int64_t t = j / per_token;
    const int rem = static_cast<int>(j - t * per_token);
    const int h = rem / chunks, c = rem % chunks;
    const int64_t slot = p.loc[t];
    if (slot < 0) continue;
    const uint16_t* src = static_cast<const uint16_t*>(is_v ? p.v : p.k) +
                          t * (is_v ? p.v_stride_t : p.k_stride_t) +
                          h * (is_v ? p.v_stride_h : p.k_stride_h) + c * 8;
    uint16_t* dst = static_cast<uint16_t*>(is_v ? p.v_cache : p.k_cache) + slot * p.slot_stride +
                    h * p.head_dim + c * 8;
    *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
  }
}

}  // namespace

cudaError_t launch_store_kv(const StoreParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int64_t work = 2LL * p.num_tokens * p.num_kv_heads * (p.head_dim / 8);
  const int blocks = static_cast<int>(std::min<int64_t>((work + 255) / 256, 4096));
  store_kv_kernel<<<blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvray
