// RMSNorm's arithmetic, bit-exact with HF transformers' torch ops on CUDA, shared by the norm
// kernels (fused.cu) and the GEMV that normalizes its own input rows (gemv.cu). See fused.cu
// for the order torch adds a row's squares in (MeanOrder) and why it matters.
#pragma once

#include "common.cuh"

namespace kvray {

constexpr int kNormMaxLanes = 512;  // torch's reduce block size: no order uses more lanes

// fp32 value of x after a round trip through T: the rounding torch applies after each op.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return Num<T>::to_f(Num<T>::from_f(x));
}

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

// torch's tree over `rows` rows of `lanes` partial sums each (row r's at partial[r * stride]):
// the lanes of one warp row first (block_x_reduce), then across warp rows (block_y_reduce),
// the offset halving and the lower lane's value on the left. The block's threads take each
// level's additions in turn; row r's sum ends in partial[r * stride].
__device__ __forceinline__ void tree_sum(float* partial, int rows, int stride, int lanes,
                                         int lanes_x) {
  for (int off = lanes_x / 2; off > 0; off >>= 1) {
    for (int i = threadIdx.x; i < rows * lanes; i += blockDim.x) {
      const int lane = i % lanes;
      if (lane % lanes_x < off) {
        float* s = partial + (i / lanes) * stride + lane;
        *s = __fadd_rn(*s, s[off]);
      }
    }
    __syncthreads();
  }
  for (int off = lanes / lanes_x / 2; off > 0; off >>= 1) {
    for (int i = threadIdx.x; i < rows * lanes; i += blockDim.x) {
      const int lane = i % lanes;
      if (lane % lanes_x == 0 && lane / lanes_x < off) {
        float* s = partial + (i / lanes) * stride + lane;
        *s = __fadd_rn(*s, s[off * lanes_x]);
      }
    }
    __syncthreads();
  }
}

}  // namespace kvray
