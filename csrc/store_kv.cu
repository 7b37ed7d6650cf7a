// KV write for the new tokens of a step: K and V rows of T tokens scattered to their slots
// in one launch (16-byte copies; a negative slot is skipped). Grid depends on T only.
// The FP8 variant quantizes each row (one token's head_dim values of one KV head) to e4m3
// with scale = max(|x|, 1e-12) / 448, as worker/attention/kv_quant.py does, bit for bit.
#include <algorithm>

#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

__global__ void __launch_bounds__(256) store_kv_kernel(const StoreParams p) {
  grid_dependency_wait();
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

constexpr float kFp8Max = 448.f;
constexpr float kScaleFloor = 1e-12f;

// D / 8 lanes share a row, 8 input values each; rows are 2 * T * Hkv (K rows, then V rows).
// The loop bound is the same for every lane of a warp, so the shuffles see the whole warp.
template <typename T, int D>
__global__ void __launch_bounds__(256) store_kv_fp8_kernel(const StoreParams p) {
  grid_dependency_wait();
  constexpr int kLanes = D / 8;
  constexpr int kRowsPerWarp = 32 / kLanes;
  const int lane = threadIdx.x % 32, sub = lane / kLanes, part = lane % kLanes;
  const int64_t half = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t base = warp * kRowsPerWarp; base < 2 * half; base += warps * kRowsPerWarp) {
    const int64_t r = base + sub;
    const bool is_v = r >= half;
    const int64_t j = is_v ? r - half : r;
    const int64_t t = j / p.num_kv_heads;
    const int h = static_cast<int>(j - t * p.num_kv_heads);
    const int64_t slot = r < 2 * half ? p.loc[t] : -1;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (slot >= 0) {
      const T* src = static_cast<const T*>(is_v ? p.v : p.k) +
                     t * (is_v ? p.v_stride_t : p.k_stride_t) +
                     h * (is_v ? p.v_stride_h : p.k_stride_h) + part * 8;
      raw = __ldg(reinterpret_cast<const uint4*>(src));
    }
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    float x[8];
    float amax = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 f = Dtype<T>::unpack(words[w]);
      x[2 * w] = f.x;
      x[2 * w + 1] = f.y;
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
#pragma unroll
    for (int off = kLanes / 2; off >= 1; off /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (slot < 0) continue;
    // The scale is a product by the float reciprocal of 448 (torch divides by a scalar that
    // way on CUDA, so kv_quant.py multiplies explicitly on every device); x / scale is an
    // IEEE division, as torch's tensor / tensor.
    const float scale = fmaxf(amax, kScaleFloor) * (1.0f / kFp8Max);
    uint16_t q[4];
#pragma unroll
    for (int w = 0; w < 4; ++w)
      q[w] = __nv_cvt_float2_to_fp8x2(make_float2(x[2 * w] / scale, x[2 * w + 1] / scale),
                                       __NV_SATFINITE, __NV_E4M3);
    uint8_t* dst = static_cast<uint8_t*>(is_v ? p.v_cache : p.k_cache) + slot * p.slot_stride +
                   h * D + part * 8;
    *reinterpret_cast<uint2*>(dst) = make_uint2(q[0] | (uint32_t(q[1]) << 16),
                                                q[2] | (uint32_t(q[3]) << 16));
    if (part == 0) (is_v ? p.v_scale : p.k_scale)[slot * p.num_kv_heads + h] = scale;
  }
}

template <typename T>
cudaError_t launch_fp8(const StoreParams& p, cudaStream_t stream) {
  const int64_t lanes = 2LL * p.num_tokens * p.num_kv_heads * (p.head_dim / 8);
  const int blocks = static_cast<int>(std::min<int64_t>((lanes + 255) / 256, 4096));
  if (p.head_dim == 128) {
    launch(store_kv_fp8_kernel<T, 128>, blocks, 256, 0, stream, p);
  } else if (p.head_dim == 64) {
    launch(store_kv_fp8_kernel<T, 64>, blocks, 256, 0, stream, p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_store_kv(const StoreParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.k_scale != nullptr) {
    return p.dtype == DType::kFP16 ? launch_fp8<__half>(p, stream)
                                   : launch_fp8<__nv_bfloat16>(p, stream);
  }
  const int64_t work = 2LL * p.num_tokens * p.num_kv_heads * (p.head_dim / 8);
  const int blocks = static_cast<int>(std::min<int64_t>((work + 255) / 256, 4096));
  launch(store_kv_kernel, blocks, 256, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace kvray
