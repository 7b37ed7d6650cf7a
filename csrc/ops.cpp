// Torch bindings of the kvray kernels: argument checks, then a launch on the current
// stream. Nothing here allocates device memory, so every op can run inside a CUDA graph.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "launch.h"

namespace {

using kvray::DType;

// A refusal raises RuntimeError("kvray: ..."). Its numbers are formatted with std::to_string,
// never an ostream: on the lent GPU machines every refusal whose message held a number
// crashed the process instead of raising (gemv 2026-12-03, argmax 2026-12-06, also with the
// message built in an ostringstream here), while refusals of C strings alone raised. Most
// likely the extension's ostream and the process's C++ runtime disagree on the locale's
// number formatting; std::to_string does not use it.
inline void kv_append(std::string& s, const char* v) { s += v; }
inline void kv_append(std::string& s, const std::string& v) { s += v; }
inline void kv_append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void kv_append(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename... Args>
std::string kv_message(const Args&... args) {
  std::string s;
  (kv_append(s, args), ...);
  return s;
}
#define KV_CHECK(cond, ...)                                          \
  do {                                                               \
    if (!(cond)) {                                                   \
      const std::string kv_msg_ = kv_message("kvray: ", __VA_ARGS__); \
      TORCH_CHECK(false, kv_msg_.c_str());                           \
    }                                                                \
  } while (0)

DType dtype_of(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return DType::kBF16;
  if (t.scalar_type() == at::kHalf) return DType::kFP16;
  KV_CHECK(false, name, " must be bfloat16 or float16, got ", t.scalar_type());
  return DType::kBF16;
}

void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  KV_CHECK(t.is_cuda() && t.get_device() == ref.get_device(), name,
           " must be on the same CUDA device as q");
}

void check_aligned(const at::Tensor& t, const char* name, int64_t stride_multiple) {
  KV_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    KV_CHECK(t.stride(d) % stride_multiple == 0 || t.size(d) == 1, name, " stride ", d,
             " must be a multiple of ", stride_multiple);
  KV_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

bool is_fp8(const at::Tensor& t) { return t.scalar_type() == at::kFloat8_e4m3fn; }

// The float32 scales [n_slots, n_kv_heads] of an FP8 cache, one per row of head_dim values.
void check_scales(const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                  const at::Tensor& k_cache, const char* op) {
  KV_CHECK(k_scale.has_value() && v_scale.has_value(), op,
           ": an FP8 (float8_e4m3fn) cache needs k_scale and v_scale");
  for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
    KV_CHECK(t->is_cuda() && t->get_device() == k_cache.get_device(), op,
             ": the scales must be on the cache's device");
    KV_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() &&
                 t->size(0) == k_cache.size(0) && t->size(1) == k_cache.size(1),
             op, ": the scales must be contiguous float32 [n_slots, n_kv_heads]");
  }
}

void check_int32_vec(const at::Tensor& t, const at::Tensor& ref, int64_t min_len, const char* name) {
  check_cuda(t, ref, name);
  KV_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(), name,
           " must be a contiguous 1-D int32 tensor");
  KV_CHECK(t.size(0) >= min_len, name, " has ", t.size(0), " entries, need ", min_len);
}

// `fp8_op`: the op reads an FP8 cache (decode), with bf16 queries and the scales.
kvray::PagedKV paged_kv(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                        const at::Tensor& seq_lens, int64_t batch, int64_t page_size,
                        const char* fp8_op = nullptr,
                        const std::optional<at::Tensor>& k_scale = std::nullopt,
                        const std::optional<at::Tensor>& v_scale = std::nullopt) {
  check_cuda(k_cache, q, "k_cache");
  check_cuda(v_cache, q, "v_cache");
  KV_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
               k_cache.sizes() == v_cache.sizes(),
           "k_cache and v_cache must be contiguous [n_slots, n_kv_heads, head_dim] of one shape");
  const bool fp8 = is_fp8(k_cache) && is_fp8(v_cache);
  if (fp8) {
    KV_CHECK(fp8_op != nullptr, "prefill_attention does not read an FP8 cache (dequantize it first)");
    KV_CHECK(q.scalar_type() == at::kBFloat16, fp8_op, ": an FP8 cache is read with bfloat16 q");
    check_scales(k_scale, v_scale, k_cache, fp8_op);
  } else {
    KV_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
             "k_cache and v_cache must have q's dtype (or both be float8_e4m3fn with scales)");
    KV_CHECK(!k_scale.has_value() && !v_scale.has_value(), "scales are given for a cache that is not FP8");
  }
  KV_CHECK(k_cache.size(2) == q.size(2), "head_dim of q and the cache differ");
  check_aligned(k_cache, "k_cache", 8);
  check_aligned(v_cache, "v_cache", 8);
  check_cuda(req_to_token, q, "req_to_token");
  KV_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 &&
               req_to_token.stride(1) == 1,
           "req_to_token must be int32 [max_running, max_seq_len] with contiguous rows");
  check_int32_vec(req_pool_indices, q, batch, "req_pool_indices");
  check_int32_vec(seq_lens, q, batch, "seq_lens");
  KV_CHECK(page_size >= 1, "page_size must be >= 1");
  kvray::PagedKV kv{k_cache.data_ptr(),         v_cache.data_ptr(),
                    k_cache.stride(0),          req_to_token.data_ptr<int32_t>(),
                    req_to_token.stride(0),     req_pool_indices.data_ptr<int32_t>(),
                    seq_lens.data_ptr<int32_t>(), static_cast<int>(page_size)};
  if (fp8) {
    kv.k_scale = k_scale->data_ptr<float>();
    kv.v_scale = v_scale->data_ptr<float>();
  }
  return kv;
}

void check_heads(const at::Tensor& q, const at::Tensor& k_cache) {
  const int64_t d = q.size(2);
  KV_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128, got ", d);
  KV_CHECK(q.size(1) % k_cache.size(1) == 0, "num q heads (", q.size(1),
           ") must be a multiple of num kv heads (", k_cache.size(1), ")");
}

void check_launch(cudaError_t err, const char* op) {
  KV_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
}

// Multiprocessor count of the current device, read once per device.
int num_sms() {
  static int cached[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) cudaDeviceGetAttribute(&cached[dev], cudaDevAttrMultiProcessorCount, dev);
  return cached[dev];
}

void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& out_cache_loc,
              const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  KV_CHECK(k.is_cuda() && k.dim() == 3 && k.sizes() == v.sizes(), "k and v must be CUDA [T, Hkv, D]");
  const c10::cuda::CUDAGuard guard(k.device());
  const DType dt = dtype_of(k, "k");
  const bool fp8 = is_fp8(k_cache) && is_fp8(v_cache);
  KV_CHECK(v.scalar_type() == k.scalar_type() &&
               (fp8 || (k_cache.scalar_type() == k.scalar_type() &&
                        v_cache.scalar_type() == k.scalar_type())),
           "k, v and the caches must share one dtype (or the caches both be float8_e4m3fn)");
  if (fp8) {
    check_scales(k_scale, v_scale, k_cache, "store_kv");
    KV_CHECK(k.size(2) == 64 || k.size(2) == 128, "an FP8 cache needs head_dim 64 or 128");
  } else {
    KV_CHECK(!k_scale.has_value() && !v_scale.has_value(), "scales are given for a cache that is not FP8");
  }
  check_cuda(v, k, "v");
  check_cuda(k_cache, k, "k_cache");
  check_cuda(v_cache, k, "v_cache");
  KV_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
               k_cache.sizes() == v_cache.sizes() && k_cache.size(1) == k.size(1) &&
               k_cache.size(2) == k.size(2),
           "caches must be contiguous [n_slots, Hkv, D] matching k");
  KV_CHECK(k.size(2) % 8 == 0, "head_dim must be a multiple of 8");
  check_aligned(k, "k", 8);
  check_aligned(v, "v", 8);
  check_aligned(k_cache, "k_cache", 8);
  check_aligned(v_cache, "v_cache", 8);
  check_cuda(out_cache_loc, k, "out_cache_loc");
  KV_CHECK(out_cache_loc.scalar_type() == at::kLong && out_cache_loc.dim() == 1 &&
               out_cache_loc.is_contiguous() && out_cache_loc.size(0) == k.size(0),
           "out_cache_loc must be contiguous int64 [T]");
  kvray::StoreParams p{k.data_ptr(),       v.data_ptr(),       k.stride(0),
                       k.stride(1),        v.stride(0),        v.stride(1),
                       k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                       out_cache_loc.data_ptr<int64_t>(),      static_cast<int>(k.size(0)),
                       static_cast<int>(k.size(1)),            static_cast<int>(k.size(2)),
                       dt};
  if (fp8) {
    p.k_scale = k_scale->data_ptr<float>();
    p.v_scale = v_scale->data_ptr<float>();
  }
  check_launch(kvray::launch_store_kv(p, c10::cuda::getCurrentCUDAStream()), "store_kv");
}

int resolve_variant(int64_t variant, int64_t batch, int64_t num_q_heads, int64_t num_kv_heads) {
  KV_CHECK(variant >= 0 && variant < kvray::decode_num_variants(), "unknown decode variant ", variant);
  return kvray::decode_resolve_variant(static_cast<int>(variant), static_cast<int>(batch),
                                       static_cast<int>(num_q_heads),
                                       static_cast<int>(num_kv_heads), num_sms());
}

// (resolved variant, splits) that decode_attention uses for these shapes.
std::pair<int64_t, int64_t> decode_plan(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                                        int64_t head_dim, bool fp16, bool kv_fp8, int64_t variant,
                                        int64_t max_splits) {
  const int v = resolve_variant(variant, batch, num_q_heads, num_kv_heads);
  const int splits = kvray::decode_num_splits(
      static_cast<int>(batch), static_cast<int>(num_q_heads), static_cast<int>(num_kv_heads),
      static_cast<int>(head_dim), fp16 ? DType::kFP16 : DType::kBF16, kv_fp8, v, num_sms(),
      static_cast<int>(max_splits));
  return {v, splits};
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                      const at::Tensor& seq_lens, int64_t page_size, double sm_scale,
                      const at::Tensor& out, const at::Tensor& o_part, const at::Tensor& ml_part,
                      int64_t num_splits, int64_t variant, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale,
                      const std::optional<at::Tensor>& counters) {
  KV_CHECK(q.is_cuda() && q.dim() == 3, "q must be a CUDA [B, Hq, D] tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const DType dt = dtype_of(q, "q");
  check_heads(q, k_cache);
  check_aligned(q, "q", 2);
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2);
  const kvray::PagedKV kv = paged_kv(q, k_cache, v_cache, req_to_token, req_pool_indices,
                                     seq_lens, batch, page_size, "decode_attention", k_scale,
                                     v_scale);
  const bool kv_fp8 = kv.k_scale != nullptr;
  check_cuda(out, q, "out");
  KV_CHECK(out.scalar_type() == q.scalar_type() && out.dim() == 3 && out.size(0) == batch &&
               out.size(1) == hq && out.size(2) == d,
           "out must be [B, Hq, D] with q's dtype");
  check_aligned(out, "out", 4);
  check_cuda(o_part, q, "o_part");
  check_cuda(ml_part, q, "ml_part");
  KV_CHECK(o_part.scalar_type() == at::kFloat && o_part.dim() == 4 && o_part.is_contiguous() &&
               o_part.size(0) >= batch && o_part.size(1) == hq && o_part.size(3) == d,
           "o_part must be contiguous float32 [>=B, Hq, S, D]");
  const int64_t s_cap = o_part.size(2);
  KV_CHECK(s_cap >= 1, "o_part needs at least one split");
  KV_CHECK(ml_part.scalar_type() == at::kFloat && ml_part.dim() == 4 && ml_part.is_contiguous() &&
               ml_part.size(0) >= batch && ml_part.size(1) == hq && ml_part.size(2) == s_cap &&
               ml_part.size(3) == 2,
           "ml_part must be contiguous float32 [>=B, Hq, S, 2]");
  const int v = resolve_variant(variant, batch, hq, k_cache.size(1));
  const int splits =
      num_splits > 0
          ? static_cast<int>(std::min(num_splits, s_cap))
          : kvray::decode_num_splits(static_cast<int>(batch), static_cast<int>(hq),
                                     static_cast<int>(k_cache.size(1)), static_cast<int>(d), dt,
                                     kv_fp8, v, num_sms(), static_cast<int>(s_cap));
  kvray::DecodeParams p{kv,
                        q.data_ptr(),
                        q.stride(0),
                        q.stride(1),
                        out.data_ptr(),
                        out.stride(0),
                        out.stride(1),
                        o_part.data_ptr<float>(),
                        ml_part.data_ptr<float>(),
                        static_cast<int>(s_cap),
                        static_cast<int>(batch),
                        static_cast<int>(hq),
                        static_cast<int>(k_cache.size(1)),
                        static_cast<int>(d),
                        splits,
                        static_cast<float>(sm_scale * 1.4426950408889634),
                        dt,
                        v,
                        kv_fp8};
  if (counters.has_value()) {
    check_cuda(*counters, q, "counters");
    KV_CHECK(counters->scalar_type() == at::kInt && counters->is_contiguous() &&
                 counters->numel() >= batch * hq,
             "counters must be contiguous int32 with at least B * Hq zeros");
    p.counters = counters->data_ptr<int32_t>();
  }
  check_launch(kvray::launch_decode(p, c10::cuda::getCurrentCUDAStream()), "decode_attention");
}

// Absorbed MLA decode (csrc/mla.cu): q [B, H, 576] over latent rows cache [n_slots, 576]
// (or [n_slots, 1, 576]); out [B, H, 512]; o_part / ml_part float32 hold B * H * splits
// partials of 512 and 2 values (unused with one split).
void mla_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& req_to_token,
                const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, double sm_scale,
                const at::Tensor& out, const at::Tensor& o_part, const at::Tensor& ml_part,
                int64_t num_splits) {
  KV_CHECK(q.is_cuda() && q.dim() == 3 && q.size(2) == 576,
           "mla_decode: q must be a CUDA [B, H, 576] tensor (kv_lora_rank 512 + rope 64)");
  const c10::cuda::CUDAGuard guard(q.device());
  const DType dt = dtype_of(q, "q");
  check_aligned(q, "q", 8);
  check_cuda(cache, q, "cache");
  KV_CHECK(cache.scalar_type() == q.scalar_type() && cache.is_contiguous() &&
               cache.size(-1) == 576 && (cache.dim() == 2 || (cache.dim() == 3 && cache.size(1) == 1)),
           "mla_decode: cache must be contiguous [n_slots, 576] or [n_slots, 1, 576] of q's dtype");
  check_aligned(cache, "cache", 8);
  const int64_t batch = q.size(0), heads = q.size(1);
  check_cuda(req_to_token, q, "req_to_token");
  KV_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 &&
               req_to_token.stride(1) == 1,
           "req_to_token must be int32 [max_running, max_seq_len] with contiguous rows");
  check_int32_vec(req_pool_indices, q, batch, "req_pool_indices");
  check_int32_vec(seq_lens, q, batch, "seq_lens");
  check_cuda(out, q, "out");
  KV_CHECK(out.scalar_type() == q.scalar_type() && out.dim() == 3 && out.size(0) == batch &&
               out.size(1) == heads && out.size(2) == 512,
           "mla_decode: out must be [B, H, 512] with q's dtype");
  check_aligned(out, "out", 8);
  KV_CHECK(num_splits >= 1 && num_splits <= kvray::mla_max_splits(), "mla_decode: num_splits must be in 1..",
           kvray::mla_max_splits());
  if (num_splits > 1) {
    check_cuda(o_part, q, "o_part");
    check_cuda(ml_part, q, "ml_part");
    KV_CHECK(o_part.scalar_type() == at::kFloat && o_part.is_contiguous() &&
                 o_part.numel() >= batch * heads * num_splits * 512 &&
                 ml_part.scalar_type() == at::kFloat && ml_part.is_contiguous() &&
                 ml_part.numel() >= batch * heads * num_splits * 2,
             "mla_decode: o_part / ml_part must be contiguous float32 with room for B * H * splits partials");
  }
  kvray::MlaDecodeParams p{q.data_ptr(),
                           q.stride(0),
                           q.stride(1),
                           cache.data_ptr(),
                           576,
                           req_to_token.data_ptr<int32_t>(),
                           req_to_token.stride(0),
                           req_pool_indices.data_ptr<int32_t>(),
                           seq_lens.data_ptr<int32_t>(),
                           out.data_ptr(),
                           out.stride(0),
                           out.stride(1),
                           o_part.data_ptr<float>(),
                           ml_part.data_ptr<float>(),
                           static_cast<int>(batch),
                           static_cast<int>(heads),
                           static_cast<int>(num_splits),
                           static_cast<float>(sm_scale * 1.4426950408889634),
                           dt};
  check_launch(kvray::launch_mla_decode(p, c10::cuda::getCurrentCUDAStream()), "mla_decode");
}

// The prefill tiling for a batch of `batch` sequences and `num_tokens` queries in all.
int resolve_prefill(int64_t variant, int64_t batch, int64_t num_tokens, int64_t num_q_heads,
                    int64_t head_dim, DType dt) {
  int info[4] = {0, 0, 0, 0};  // tiling 2's {rows, blocks per SM, registers, spill bytes}
  kvray::prefill_kernel_info(dt, static_cast<int>(head_dim), 2, info);
  return kvray::prefill_resolve_variant(static_cast<int>(variant), static_cast<int>(batch),
                                        static_cast<int>(num_tokens), static_cast<int>(num_q_heads),
                                        num_sms(), std::max(info[1], 1));
}

void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                       const at::Tensor& seq_lens, const at::Tensor& qo_indptr, int64_t page_size,
                       double sm_scale, const at::Tensor& out, int64_t variant) {
  KV_CHECK(q.is_cuda() && q.dim() == 3, "q must be a CUDA [T, Hq, D] tensor");
  const c10::cuda::CUDAGuard guard(q.device());
  const DType dt = dtype_of(q, "q");
  check_heads(q, k_cache);
  check_aligned(q, "q", 8);
  check_int32_vec(qo_indptr, q, 1, "qo_indptr");
  const int64_t batch = qo_indptr.size(0) - 1;
  const kvray::PagedKV kv =
      paged_kv(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, batch, page_size);
  check_cuda(out, q, "out");
  KV_CHECK(out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes(),
           "out must have q's shape and dtype");
  check_aligned(out, "out", 2);
  KV_CHECK(variant >= 0 && variant < kvray::prefill_num_variants(), "prefill variant out of range");
  kvray::PrefillParams p{kv,
                         q.data_ptr(),
                         q.stride(0),
                         q.stride(1),
                         out.data_ptr(),
                         out.stride(0),
                         out.stride(1),
                         qo_indptr.data_ptr<int32_t>(),
                         static_cast<int>(batch),
                         static_cast<int>(q.size(0)),
                         static_cast<int>(q.size(1)),
                         static_cast<int>(k_cache.size(1)),
                         static_cast<int>(q.size(2)),
                         static_cast<float>(sm_scale * 1.4426950408889634),
                         dt,
                         resolve_prefill(variant, batch, q.size(0), q.size(1), q.size(2), dt)};
  check_launch(kvray::launch_prefill(p, c10::cuda::getCurrentCUDAStream()), "prefill_attention");
}

// ---- fused elementwise ops of the Llama layer (csrc/fused.cu) ----

DType float_dtype_of(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat) return DType::kFP32;
  return dtype_of(t, name);
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Elements per 16-byte access of this dtype.
int64_t vec_width(const at::Tensor& t) { return 16 / static_cast<int64_t>(t.element_size()); }

void check_same(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_cuda(t, ref, name);
  KV_CHECK(t.scalar_type() == ref.scalar_type(), name, " must have x's dtype");
}

// Rows of a [T, N] or [T, H, N] tensor with a contiguous last dim, as NormParams strides.
void norm_rows(const at::Tensor& t, const char* name, int64_t* outer, int64_t* inner) {
  KV_CHECK(t.dim() == 2 || t.dim() == 3, name, " must be [T, N] or [T, H, N]");
  KV_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, name, " must have a contiguous last dimension");
  *outer = t.stride(0);
  *inner = t.dim() == 3 ? t.stride(1) : 0;
}

kvray::NormParams norm_params(const at::Tensor& x, const at::Tensor& weight, double eps) {
  KV_CHECK(x.is_cuda(), "x must be a CUDA tensor");
  const DType dt = float_dtype_of(x, "x");
  check_same(weight, x, "weight");
  const int64_t n = x.size(-1);
  KV_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous(),
           "weight must be contiguous [N] with N = x.size(-1)");
  const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
  kvray::MeanOrder order{};
  KV_CHECK(n >= 1 && n <= (1 << 16) && kvray::torch_mean_order(n, std::max<int64_t>(rows, 1), &order),
           "rms_norm supports rows of 1..65536 elements, got ", n);
  kvray::NormParams p{};
  p.weight = weight.data_ptr();
  p.rows = rows;
  p.inner_rows = x.dim() == 3 ? static_cast<int>(x.size(1)) : 1;
  p.n = static_cast<int>(n);
  p.eps = static_cast<float>(eps);
  // torch's MeanOps factor: float(outputs) / numel, a float divided by an int64 (as float).
  p.inv_n = static_cast<float>(std::max<int64_t>(rows, 1)) / static_cast<float>(std::max<int64_t>(rows, 1) * n);
  p.lanes = order.lanes;
  p.lanes_x = order.lanes_x;
  p.vectorized = order.vectorized;
  p.dtype = dt;
  return p;
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  KV_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be [T, N] of one shape");
  const c10::cuda::CUDAGuard guard(x.device());
  kvray::NormParams p = norm_params(x, weight, eps);
  check_same(residual, x, "residual");
  norm_rows(x, "x", &p.x_outer, &p.x_inner);
  KV_CHECK(residual.stride(1) == 1 || residual.size(1) == 1, "residual must have a contiguous last dimension");
  p.x = x.data_ptr();
  p.residual = residual.data_ptr();
  p.out = x.data_ptr();
  p.res_stride = residual.stride(0);
  p.out_outer = p.x_outer;
  const int64_t w = vec_width(x);
  p.vec_ok = p.n % w == 0 && p.x_outer % w == 0 && p.res_stride % w == 0 && aligned16(x) &&
             aligned16(residual) && aligned16(weight);
  check_launch(kvray::launch_rms_norm(p, c10::cuda::getCurrentCUDAStream()), "fused_add_rms_norm");
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  KV_CHECK(out.sizes() == x.sizes(), "out must have x's shape");
  const c10::cuda::CUDAGuard guard(x.device());
  kvray::NormParams p = norm_params(x, weight, eps);
  check_same(out, x, "out");
  norm_rows(x, "x", &p.x_outer, &p.x_inner);
  norm_rows(out, "out", &p.out_outer, &p.out_inner);
  p.x = x.data_ptr();
  p.residual = nullptr;
  p.out = out.data_ptr();
  const int64_t w = vec_width(x);
  const bool rows_ok = p.x_outer % w == 0 && p.x_inner % w == 0 && p.out_outer % w == 0 &&
                       p.out_inner % w == 0;
  p.vec_ok = p.n % w == 0 && rows_ok && aligned16(x) && aligned16(out) && aligned16(weight);
  check_launch(kvray::launch_rms_norm(p, c10::cuda::getCurrentCUDAStream()), "rms_norm");
}

kvray::RotaryParams rotary_params(const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& positions, const at::Tensor& cos_cache,
                                  const at::Tensor& sin_cache) {
  KV_CHECK(q.is_cuda() && q.dim() == 3 && k.dim() == 3, "q and k must be CUDA [T, H, D] tensors");
  const DType dt = float_dtype_of(q, "q");
  check_same(k, q, "k");
  const int64_t d = q.size(2);
  KV_CHECK(k.size(0) == q.size(0) && k.size(2) == d && d % 2 == 0,
           "k must be [T, Hk, D] with q's T and an even D");
  KV_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k must have a contiguous last dimension");
  check_cuda(positions, q, "positions");
  KV_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
               positions.is_contiguous() && positions.size(0) == q.size(0),
           "positions must be contiguous int64 [T]");
  for (const at::Tensor* t : {&cos_cache, &sin_cache}) {
    check_cuda(*t, q, "cos_cache / sin_cache");
    KV_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() && t->size(1) == d,
             "cos_cache and sin_cache must be contiguous float32 [max_len, D]");
  }
  return kvray::RotaryParams{q.data_ptr(),         k.data_ptr(),
                             q.stride(0),          q.stride(1),
                             k.stride(0),          k.stride(1),
                             positions.data_ptr<int64_t>(),
                             cos_cache.data_ptr<float>(),
                             sin_cache.data_ptr<float>(),
                             q.size(0),
                             static_cast<int>(q.size(1)),
                             static_cast<int>(k.size(1)),
                             static_cast<int>(d),
                             dt};
}

void rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
            const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  const kvray::RotaryParams p = rotary_params(q, k, positions, cos_cache, sin_cache);
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(kvray::launch_rotary(p, c10::cuda::getCurrentCUDAStream()), "rotary");
}

void rotary_store_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& positions, const at::Tensor& cos_cache,
                     const at::Tensor& sin_cache, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& out_cache_loc) {
  kvray::RotaryParams p = rotary_params(q, k, positions, cos_cache, sin_cache);
  const c10::cuda::CUDAGuard guard(q.device());
  KV_CHECK(p.dtype != DType::kFP32, "rotary_store_kv takes bfloat16 or float16 q, k and v");
  check_same(v, k, "v");
  KV_CHECK(v.dim() == 3 && v.sizes() == k.sizes() && v.stride(2) == 1,
           "v must be [T, Hk, D] like k, with a contiguous last dimension");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    check_same(*c, k, "k_cache / v_cache");
    KV_CHECK(c->dim() == 3 && c->is_contiguous() && c->size(1) == k.size(1) && c->size(2) == k.size(2),
             "caches must be contiguous [n_slots, Hk, D] matching k (an FP8 cache takes rotary and store_kv)");
  }
  KV_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have one shape");
  check_cuda(out_cache_loc, k, "out_cache_loc");
  KV_CHECK(out_cache_loc.scalar_type() == at::kLong && out_cache_loc.dim() == 1 &&
               out_cache_loc.is_contiguous() && out_cache_loc.size(0) == k.size(0),
           "out_cache_loc must be contiguous int64 [T]");
  p.v = v.data_ptr();
  p.v_stride_t = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_stride = k_cache.stride(0);
  p.loc = out_cache_loc.data_ptr<int64_t>();
  check_launch(kvray::launch_rotary(p, c10::cuda::getCurrentCUDAStream()), "rotary_store_kv");
}

void silu_and_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  KV_CHECK(gate_up.is_cuda() && gate_up.dim() == 2 && out.dim() == 2,
           "gate_up and out must be CUDA [T, 2I] and [T, I] tensors");
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const DType dt = float_dtype_of(gate_up, "gate_up");
  check_cuda(out, gate_up, "out");
  KV_CHECK(out.scalar_type() == gate_up.scalar_type(), "out must have gate_up's dtype");
  const int64_t inter = out.size(1);
  KV_CHECK(out.size(0) == gate_up.size(0) && gate_up.size(1) == 2 * inter,
           "out must be [T, I] for gate_up [T, 2I]");
  KV_CHECK((gate_up.stride(1) == 1 || gate_up.size(1) <= 1) && (out.stride(1) == 1 || inter <= 1),
           "gate_up and out must have a contiguous last dimension");
  const int64_t w = vec_width(out);
  kvray::SiluMulParams p{gate_up.data_ptr(), out.data_ptr(), gate_up.stride(0), out.stride(0),
                         gate_up.size(0),    static_cast<int>(inter),
                         inter % w == 0 && gate_up.stride(0) % w == 0 && out.stride(0) % w == 0 &&
                             aligned16(gate_up) && aligned16(out),
                         dt};
  check_launch(kvray::launch_silu_and_mul(p, c10::cuda::getCurrentCUDAStream()), "silu_and_mul");
}

// The checks and parameters gemv and skinny_gemm share; max_m is the op's row limit.
kvray::GemvParams linear_params(const char* op, int64_t max_m, const at::Tensor& x,
                                const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                                const at::Tensor& out, bool gated, int64_t split) {
  KV_CHECK(x.is_cuda() && x.dim() == 2 && w.dim() == 2 && out.dim() == 2, op,
           ": x [M, K], w [N, K] and out [M, N] must be 2-D CUDA tensors");
  const DType dt = dtype_of(x, "x");
  check_cuda(w, x, "w");
  check_cuda(out, x, "out");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  KV_CHECK(m >= 1 && m <= max_m, op, " takes 1 to ", max_m, " rows, got ", m);
  KV_CHECK(w.size(1) == k && k % 8 == 0 && w.is_contiguous(), "w must be contiguous [N, K], K % 8 == 0");
  KV_CHECK(!gated || n % 2 == 0, "a gated ", op, " needs an even N (gate rows, then up rows)");
  KV_CHECK(out.size(0) == m && out.size(1) == (gated ? n / 2 : n) && out.stride(1) == 1,
           "out must be [M, N] (gated: [M, N / 2]), rows contiguous");
  KV_CHECK(w.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
           "x, w and out must share a dtype");
  check_aligned(x, "x", 8);
  check_aligned(w, "w", 8);
  const void* b = nullptr;
  if (bias.has_value()) {
    KV_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                 bias->scalar_type() == x.scalar_type(),
             "bias must be a contiguous [N] tensor of x's dtype");
    check_cuda(*bias, x, "bias");
    b = bias->data_ptr();
  }
  kvray::GemvParams p{x.data_ptr(), w.data_ptr(), b, out.data_ptr(), x.stride(0), out.stride(0),
                      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), dt, gated};
  p.split = static_cast<int>(split);
  p.num_sms = num_sms();
  return p;
}

void gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
          const at::Tensor& out, bool gated, int64_t split) {
  const c10::cuda::CUDAGuard guard(x.device());
  KV_CHECK(split == 0 || split == 1 || split == 2 || split == 4, "gemv: split must be 0, 1, 2 or 4");
  const kvray::GemvParams p = linear_params("gemv", 8, x, w, bias, out, gated, split);
  check_launch(kvray::launch_gemv(p, c10::cuda::getCurrentCUDAStream()), "gemv");
}

// The checks and parameters of a qkv projection with rotary_store_kv's work in its epilogue
// (launch.h, GemvRope), for w [N, K] and x's dtype.
kvray::GemvRope rope_params(const at::Tensor& x, const at::Tensor& w, const at::Tensor& positions,
                            const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                            int64_t num_q_heads, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& out_cache_loc) {
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    check_same(*c, x, "k_cache / v_cache");
    KV_CHECK(c->dim() == 3 && c->is_contiguous() && c->sizes() == k_cache.sizes(),
             "k_cache and v_cache must be contiguous [n_slots, Hk, D] of x's dtype");
  }
  const int64_t hk = k_cache.size(1), d = k_cache.size(2);
  KV_CHECK(num_q_heads >= 1 && d % 2 == 0 && w.size(0) == (num_q_heads + 2 * hk) * d,
           "w must be [(Hq + 2 Hk) * D, K] for caches [n_slots, Hk, D] with an even D");
  for (const at::Tensor* t : {&positions, &out_cache_loc}) {
    check_cuda(*t, x, "positions / out_cache_loc");
    KV_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() &&
                 t->size(0) == x.size(0),
             "positions and out_cache_loc must be contiguous int64 [M]");
  }
  for (const at::Tensor* t : {&cos_cache, &sin_cache}) {
    check_cuda(*t, x, "cos_cache / sin_cache");
    KV_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() && t->size(1) == d,
             "cos_cache and sin_cache must be contiguous float32 [max_len, D]");
  }
  return kvray::GemvRope{positions.data_ptr<int64_t>(), cos_cache.data_ptr<float>(),
                         sin_cache.data_ptr<float>(), out_cache_loc.data_ptr<int64_t>(),
                         k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                         static_cast<int>(d), static_cast<int>(num_q_heads), static_cast<int>(hk)};
}

void skinny_rope_store_kv(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias, const at::Tensor& out,
                          const at::Tensor& positions, const at::Tensor& cos_cache,
                          const at::Tensor& sin_cache, int64_t num_q_heads,
                          const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& out_cache_loc, int64_t split) {
  const c10::cuda::CUDAGuard guard(x.device());
  KV_CHECK(split == 0 || split == 1 || split == 2 || split == 4 || split == 8,
           "skinny_rope_store_kv: split must be 0, 1, 2, 4 or 8");
  kvray::GemvParams p = linear_params("skinny_rope_store_kv", 64, x, w, bias, out, false, split);
  p.rope = rope_params(x, w, positions, cos_cache, sin_cache, num_q_heads, k_cache, v_cache,
                       out_cache_loc);
  KV_CHECK(p.rope.head_dim % 16 == 0, "skinny_rope_store_kv needs a head_dim that is a multiple of 16");
  check_launch(kvray::launch_skinny_gemm(p, c10::cuda::getCurrentCUDAStream()),
               "skinny_rope_store_kv");
}

void skinny_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                 const at::Tensor& out, bool gated, int64_t split) {
  const c10::cuda::CUDAGuard guard(x.device());
  KV_CHECK(split == 0 || split == 1 || split == 2 || split == 4 || split == 8,
           "skinny_gemm: split must be 0, 1, 2, 4 or 8");
  const kvray::GemvParams p = linear_params("skinny_gemm", 64, x, w, bias, out, gated, split);
  check_launch(kvray::launch_skinny_gemm(p, c10::cuda::getCurrentCUDAStream()), "skinny_gemm");
}

void tiled_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                const at::Tensor& out, bool gated, int64_t split) {
  const c10::cuda::CUDAGuard guard(x.device());
  KV_CHECK(split >= 0 && split <= 8, "tiled_gemm: split must be 0 to 8");
  const kvray::GemvParams p = linear_params("tiled_gemm", 64, x, w, bias, out, gated, split);
  check_launch(kvray::launch_tiled_gemm(p, c10::cuda::getCurrentCUDAStream()), "tiled_gemm");
}

// out[r] = argmax(x[r]) as torch.argmax(x, -1) gives it; partial and counters are the
// caller's scratch (the executor's), counters zero.
void argmax(const at::Tensor& x, const at::Tensor& out, const at::Tensor& partial,
            const at::Tensor& counters) {
  KV_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
           "argmax: x must be a float32 CUDA [B, N] tensor, rows contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), n = x.size(1);
  KV_CHECK(n >= 1 && n < (int64_t{1} << 31), "argmax: rows of 1 to 2^31 - 1 elements");
  check_cuda(out, x, "out");
  KV_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == rows &&
               out.is_contiguous(),
           "argmax: out must be a contiguous int64 [B] tensor");
  check_cuda(partial, x, "partial");
  const int64_t partials = rows * kvray::kArgmaxMaxBlocks;
  KV_CHECK(partial.scalar_type() == at::kLong && partial.is_contiguous() &&
               partial.numel() >= partials,
           "argmax: partial must be a contiguous int64 tensor of at least ", partials, " entries");
  check_int32_vec(counters, x, rows, "counters");
  kvray::ArgmaxParams p{x.data_ptr<float>(),
                        x.stride(0),
                        out.data_ptr<int64_t>(),
                        reinterpret_cast<unsigned long long*>(partial.data_ptr<int64_t>()),
                        counters.data_ptr<int>(),
                        static_cast<int>(rows),
                        static_cast<int>(n),
                        n % 4 == 0 && x.stride(0) % 4 == 0 &&
                            reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0};
  check_launch(kvray::launch_argmax(p, c10::cuda::getCurrentCUDAStream()), "argmax");
}

// A tensor over t's memory that does not own it. The piecewise prompt graphs keep one for
// each attention input they hand out, so that their memory pool can reuse that memory later
// in the capture the way an eager forward's allocator would.
at::Tensor alias(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvray CUDA kernels: paged attention, the KV write, fused norm / RoPE / SiLU";
  m.def("store_kv", &store_kv, "scatter K/V rows of new tokens into the paged cache (FP8: quantized)");
  m.def("decode_attention", &decode_attention, "paged split-KV decode attention");
  m.def("prefill_attention", &prefill_attention, "paged ragged causal prefill attention");
  m.def("mla_decode", &mla_decode, "absorbed MLA decode over the latent cache, split-KV");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual), in place");
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) over the last dim ([T, N] or [T, H, N])");
  m.def("rotary", &rotary, "rotate-half RoPE on q and k in place");
  m.def("rotary_store_kv", &rotary_store_kv,
        "rotate-half RoPE on q and k in place, and k, v written to the paged cache, in one launch");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up for gate_up = [gate | up]");
  m.def("gemv", &gemv,
        "out = x @ w.T (+ bias) for 1 to 8 rows of x (decode batches); gated: silu(gate) * up");
  m.def("skinny_rope_store_kv", &skinny_rope_store_kv,
        "skinny_gemm over a qkv projection, q and k rotated and k, v written to the paged cache: "
        "the bits of skinny_gemm then rotary_store_kv, for 1 to 64 rows");
  m.def("skinny_gemm", &skinny_gemm,
        "out = x @ w.T (+ bias) for 1 to 64 rows of x on tensor cores, one pass over w; gated too");
  m.def("tiled_gemm", &tiled_gemm,
        "skinny_gemm through shared memory, K split over a cluster: for large matrices");
  m.def("argmax", &argmax, "out = argmax(x, -1) of float32 rows, torch's answer, several blocks a row");
  m.def("alias", &alias, "a tensor over another's memory that does not own it");
  m.def("decode_plan", &decode_plan, "(resolved variant, splits) decode uses for a batch");
  m.def("decode_num_variants", &kvray::decode_num_variants, "number of decode tiling variants");
  m.def(
      "decode_blocks_per_sm",
      [](int64_t head_dim, bool fp16, bool kv_fp8, int64_t variant) {
        return kvray::decode_blocks_per_sm(fp16 ? DType::kFP16 : DType::kBF16, kv_fp8,
                                           static_cast<int>(head_dim), static_cast<int>(variant));
      },
      "resident blocks per SM of a decode variant (0 if not compiled)");
  m.def("prefill_num_variants", &kvray::prefill_num_variants, "number of prefill tiling variants");
  m.def(
      "prefill_resolve_variant",
      [](int64_t variant, int64_t batch, int64_t num_tokens, int64_t num_q_heads, int64_t head_dim,
         bool fp16) {
        return resolve_prefill(variant, batch, num_tokens, num_q_heads, head_dim,
                               fp16 ? DType::kFP16 : DType::kBF16);
      },
      "the tiling variant prefill_attention uses for a batch (0 = automatic)");
  m.def(
      "prefill_kernel_info",
      [](int64_t head_dim, bool fp16, int64_t variant) {
        int out[4] = {0, 0, 0, 0};
        kvray::prefill_kernel_info(fp16 ? DType::kFP16 : DType::kBF16, static_cast<int>(head_dim),
                                   static_cast<int>(variant), out);
        return std::vector<int64_t>(out, out + 4);
      },
      "[query rows per block, blocks per SM, registers, spill bytes] of a prefill variant");
}
