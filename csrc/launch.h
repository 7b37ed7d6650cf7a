// Plain parameter structs and host launchers of the kvray kernels. Shared by the .cu
// files (kernels) and ops.cpp (torch bindings), so neither side needs the other's headers.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace kvray {

enum class DType : int { kBF16 = 0, kFP16 = 1, kFP32 = 2 };  // kFP32: fused ops only

// KV cache of one layer: [n_slots, n_kv_heads, head_dim], contiguous. An FP8 (e4m3) cache
// also has float32 scales [n_slots, n_kv_heads], one per row of head_dim values (decode only).
struct PagedKV {
  const void* k;
  const void* v;
  int64_t slot_stride;  // elements between consecutive slots (n_kv_heads * head_dim)
  const int32_t* req_to_token;
  int64_t rt_stride;  // elements between rows of req_to_token
  const int32_t* req_pool_indices;
  const int32_t* seq_lens;
  int page_size;
  const float* k_scale = nullptr;  // set for an FP8 cache
  const float* v_scale = nullptr;
};

struct DecodeParams {
  PagedKV kv;
  const void* q;  // [B, Hq, D], last dim contiguous
  int64_t q_stride_b, q_stride_h;
  void* out;  // [B, Hq, D]
  int64_t out_stride_b, out_stride_h;
  float* o_part;   // [B, Hq, S_cap, D]
  float* ml_part;  // [B, Hq, S_cap, 2]
  int s_cap;
  int batch, num_q_heads, num_kv_heads, head_dim;
  int num_splits;  // splits actually used, 1..s_cap, fixed for a given batch size
  float scale_log2;
  DType dtype;
  int variant;  // resolved tiling variant (decode_resolve_variant), never 0 here
  bool kv_fp8 = false;  // the cache holds e4m3 bytes and scales (dtype is then kBF16)
  // [B, Hq] int32, zero between launches: set, the last split of each (request, head unit)
  // merges the partials (no combine kernel) and zeroes its counter again.
  int* counters = nullptr;
  // Set by the launcher (token-split layout, 2-16 splits): the splits of a (request, head
  // unit) run as one thread-block cluster and merge through distributed shared memory.
  bool cluster = false;
};

struct PrefillParams {
  PagedKV kv;
  const void* q;  // [T, Hq, D]
  int64_t q_stride_t, q_stride_h;
  void* out;  // [T, Hq, D]
  int64_t out_stride_t, out_stride_h;
  const int32_t* qo_indptr;  // [B + 1]
  int batch, num_tokens, num_q_heads, num_kv_heads, head_dim;
  float scale_log2;
  DType dtype;
  int variant;  // resolved tiling variant (prefill_resolve_variant), never 0 here
};

struct StoreParams {
  const void* k;
  const void* v;
  int64_t k_stride_t, k_stride_h, v_stride_t, v_stride_h;  // elements
  void* k_cache;
  void* v_cache;
  int64_t slot_stride;  // elements
  const int64_t* loc;   // [T]
  int num_tokens, num_kv_heads, head_dim;
  DType dtype = DType::kBF16;
  float* k_scale = nullptr;  // set: quantize to e4m3 with one scale per row ([n_slots, Hkv])
  float* v_scale = nullptr;
};

// The order in which torch's CUDA mean(-1) adds a row's terms (see fused.cu).
struct MeanOrder {
  int lanes;    // threads sharing one row's sum
  int lanes_x;  // of those, the ones in one warp row (they also take the unaligned ends)
  bool vectorized;
};

// RMSNorm over rows of n elements, contiguous within a row. Row r of x / out starts at
// (r / inner_rows) * outer + (r % inner_rows) * inner elements ([T, H, D] views of a
// fused projection: inner_rows = H). With residual set: residual = residual + x, then
// x = norm(residual) (residual rows contiguous, res_stride apart); else out = norm(x).
struct NormParams {
  void* x;
  void* residual;  // nullptr: plain norm
  void* out;
  const void* weight;  // [n]
  int64_t x_outer, x_inner, out_outer, out_inner, res_stride;
  int64_t rows;
  int inner_rows, n;
  float eps, inv_n;  // inv_n: torch's mean factor, float(rows) / float(rows * n)
  int lanes, lanes_x;
  bool vectorized;  // MeanOrder
  bool vec_ok;      // every row start, and n, allow 16-byte accesses
  DType dtype;
};

// Rotate-half RoPE in place on q [T, Hq, D] and k [T, Hk, D] (last dim contiguous);
// cos / sin: contiguous float32 [max_len, D], row positions[t] for token t. With k_cache
// set, the rotated k [T, Hk, D] and v (same shape) are also written to slot loc[t] of the
// caches [n_slots, Hk, D] (a negative slot is skipped), as store_kv would.
struct RotaryParams {
  void* q;
  void* k;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h;
  const int64_t* positions;
  const float* cos;
  const float* sin;
  int64_t num_tokens;
  int num_q_heads, num_k_heads, head_dim;
  DType dtype;
  const void* v = nullptr;
  int64_t v_stride_t = 0, v_stride_h = 0;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t slot_stride = 0;  // elements
  const int64_t* loc = nullptr;
};

// out[t, :inter] = silu(gate_up[t, :inter]) * gate_up[t, inter:].
struct SiluMulParams {
  const void* gate_up;
  void* out;
  int64_t in_stride, out_stride;
  int64_t num_tokens;
  int inter;
  bool vec_ok;
  DType dtype;
};

// out[m, :] = x[m, :] @ w^T (+ bias) for m < M <= 8 (gemv; skinny_gemm, tiled_gemm: M <= 64): w [N, K]
// contiguous, K % 8 == 0, x and out rows contiguous (strides in elements, multiples of 8 for
// x), 16-byte aligned. Gated (N even): out[m, :N/2] = silu(first half of that) * second
// half, as silu_and_mul.
//
// With rope.positions set (skinny_gemm only, D % 16 == 0): w is a
// qkv projection whose N = (Hq + 2 Hk) * D rows are q's heads, k's, then v's; out gets q and
// k rotated as `rotary` rotates them and v as is, and rotated k and v also go to slot loc[m]
// of the caches [n_slots, Hk, D] (a negative slot is skipped): the bits of the plain
// projection then rotary_store_kv, in one launch.
struct GemvRope {
  const int64_t* positions = nullptr;  // [M]
  const float* cos = nullptr;          // [max_len, D] float32, as RotaryParams'
  const float* sin = nullptr;
  const int64_t* loc = nullptr;  // [M]
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t slot_stride = 0;  // elements
  int head_dim = 0, num_q_heads = 0, num_kv_heads = 0;
};

struct GemvParams {
  const void* x;
  const void* w;
  const void* bias;  // [N] or nullptr
  void* out;
  int64_t x_stride, out_stride;
  int m, n, k;
  DType dtype;
  bool gated = false;
  int split = 0;    // warps sharing a row group over K: 1, 2, 4 (skinny: 8 too; tiled: blocks, 1-8); 0: from the shape
  int num_sms = 0;  // of the device, for that choice
  GemvRope rope;
};

// out[r] = torch.argmax(x[r, :n]) for each of `rows` float32 rows (stride elements apart).
// Blocks sharing a row leave their results in partial [rows, kArgmaxMaxBlocks]; the last one
// merges them, counting in counters [rows] (int32, zero between launches, left zero).
constexpr int kArgmaxMaxBlocks = 32;
struct ArgmaxParams {
  const float* x;
  int64_t stride;
  int64_t* out;
  unsigned long long* partial;
  int* counters;
  int rows, n;
  bool vec_ok;    // n, stride and x allow 16-byte loads
  int slice = 0;  // elements a block takes (set by launch_argmax)
};

// Absorbed MLA decode over the latent cache [n_slots, 576] (kv_lora_rank 512 + rope 64):
// q [B, H, 576] (q_nope W_UK | q_pe), out [B, H, 512]; the slot of (row r, position t) is
// req_to_token[r * rt_stride + t]. Partials (num_splits > 1): o_part [B, H, splits, 512]
// and ml_part [B, H, splits, 2], float32.
struct MlaDecodeParams {
  const void* q;
  int64_t q_stride_b, q_stride_h;
  const void* cache;
  int64_t slot_stride;
  const int32_t* req_to_token;
  int64_t rt_stride;
  const int32_t* req_pool_indices;
  const int32_t* seq_lens;
  void* out;
  int64_t out_stride_b, out_stride_h;
  float* o_part;
  float* ml_part;
  int batch, num_heads, num_splits;
  float scale_log2;
  DType dtype;
};

// Splits chosen for a decode batch: about one wave of resident blocks, never more than
// s_cap. Depends only on shapes (batch size, heads), so graph launches stay valid.
int decode_num_splits(int batch, int num_q_heads, int num_kv_heads, int head_dim, DType dtype,
                      bool kv_fp8, int variant, int num_sms, int s_cap);
int decode_num_variants();
// Variant 0 means automatic: picks the layout from the batch and head counts (shapes only).
int decode_resolve_variant(int variant, int batch, int num_q_heads, int num_kv_heads,
                           int num_sms);
int decode_blocks_per_sm(DType dtype, bool kv_fp8, int head_dim, int variant);

cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream);
cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream);
int prefill_num_variants();
// The tiling a batch uses (variant 0 = automatic); blocks_per_sm_2: residency of tiling 2.
int prefill_resolve_variant(int variant, int batch, int num_tokens, int num_q_heads, int num_sms,
                            int blocks_per_sm_2);
// {query rows per block, resident blocks per SM, registers per thread, local (spill) bytes}
bool prefill_kernel_info(DType dtype, int head_dim, int variant, int out[4]);
cudaError_t launch_store_kv(const StoreParams& p, cudaStream_t stream);
cudaError_t launch_mla_decode(const MlaDecodeParams& p, cudaStream_t stream);
int mla_max_splits();

bool torch_mean_order(int64_t n, int64_t rows, MeanOrder* order);
cudaError_t launch_rms_norm(const NormParams& p, cudaStream_t stream);
cudaError_t launch_rotary(const RotaryParams& p, cudaStream_t stream);
cudaError_t launch_silu_and_mul(const SiluMulParams& p, cudaStream_t stream);
cudaError_t launch_gemv(const GemvParams& p, cudaStream_t stream);
cudaError_t launch_skinny_gemm(const GemvParams& p, cudaStream_t stream);  // M <= 64
cudaError_t launch_tiled_gemm(const GemvParams& p, cudaStream_t stream);   // M <= 64, split <= 8
cudaError_t launch_argmax(const ArgmaxParams& p, cudaStream_t stream);

}  // namespace kvray
