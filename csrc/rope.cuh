// RoPE's rotate-half as HF applies it in the activation dtype, shared by the rotary kernel
// (fused.cu) and the skinny GEMM's qkv projection, which rotates its own outputs (skinny.cu).
#pragma once

#include "common.cuh"
#include "launch.h"

namespace kvray {

// (x1, x2) = (x[i], x[i + D/2]) rotated: x * cos + rotate_half(x) * sin with rotate_half(x) =
// cat(-x2, x1), the cos / sin values and each product rounded to T as torch rounds them.
template <typename T>
__device__ __forceinline__ float2 rotate_half_pair(float x1, float x2, float cos1, float cos2,
                                                   float sin1, float sin2) {
  cos1 = round_to<T>(cos1), cos2 = round_to<T>(cos2);
  sin1 = round_to<T>(sin1), sin2 = round_to<T>(sin2);
  return make_float2(
      __fadd_rn(round_to<T>(__fmul_rn(x1, cos1)), round_to<T>(__fmul_rn(-x2, sin1))),
      __fadd_rn(round_to<T>(__fmul_rn(x2, cos2)), round_to<T>(__fmul_rn(x1, sin2))));
}

// A qkv projection's epilogue (GemvParams::rope) for token m and rows (row, row + D/2) of head
// row / D: the two sums plus bias rounded to T as the plain projection writes them, rotated
// for a q or k head, then written to out, and for a k or v head to the token's cache slot
// too (none if negative). cs: the token's cos at row % D and + D/2, then its sin at both.
template <typename T>
__device__ __forceinline__ void rope_epilogue_pair(const GemvParams& p, int m, int row,
                                                   float sum1, float sum2, const float (&cs)[4],
                                                   int64_t slot) {
  const GemvRope& r = p.rope;
  const int d = r.head_dim, half = d / 2, head = row / d;
  const T* bias = static_cast<const T*>(p.bias);
  float x1 = round_to<T>(sum1 + (bias != nullptr ? Num<T>::to_f(bias[row]) : 0.f));
  float x2 = round_to<T>(sum2 + (bias != nullptr ? Num<T>::to_f(bias[row + half]) : 0.f));
  const bool rotate = head < r.num_q_heads + r.num_kv_heads;
  if (rotate) {
    const float2 y = rotate_half_pair<T>(x1, x2, cs[0], cs[1], cs[2], cs[3]);
    x1 = y.x, x2 = y.y;
  }
  T* o = static_cast<T*>(p.out) + m * p.out_stride + row;
  o[0] = Num<T>::from_f(x1), o[half] = Num<T>::from_f(x2);
  if (head < r.num_q_heads || slot < 0) return;
  const int kv_head = head - r.num_q_heads - (rotate ? 0 : r.num_kv_heads);
  T* c = static_cast<T*>(rotate ? r.k_cache : r.v_cache) + slot * r.slot_stride + kv_head * d +
         row % d;
  c[0] = Num<T>::from_f(x1), c[half] = Num<T>::from_f(x2);
}

}  // namespace kvray
