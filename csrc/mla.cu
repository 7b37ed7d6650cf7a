// MLA decode attention in the absorbed form (DeepSeek-V2/V3), split-KV with a combine step.
//
// Every head of a request attends over the same latent rows `[c | k_pe]` (kv_lora_rank 512
// + rope 64 = 576 wide): the query arrives already folded into the latent space (q_nope
// times W_UK, then q_pe), scores are q . row over all 576 columns, and the output is the
// softmax-weighted sum of the rows' first 512 columns (W_UV is applied after, in torch).
// So one block takes 16 heads of one request and a chunk of its tokens, and streams each
// latent row from memory once for all 16 heads: 32-token tiles into shared memory, scores
// with one (head, token) pair a thread, an online softmax per head (a warp per head), then
// each thread accumulates 32 output columns of one head.
//
// The grid depends only on the batch size and head count (splits come from the host, a
// function of the batch size), never on live lengths, so launches can be captured in CUDA
// graphs; splits past a sequence's end exit at once and the combine skips them.
#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

constexpr int kQK = 576;     // latent row: kv_lora_rank + qk_rope_head_dim
constexpr int kV = 512;      // kv_lora_rank: the part of a row that is also the value
constexpr int kHeads = 16;   // heads per block
constexpr int kTile = 32;    // tokens per shared-memory tile
constexpr int kThreads = 256;
constexpr int kRowPad = 8;   // row stride 584 elements: 16-byte reads of 8 rows hit distinct banks
constexpr int kRow = kQK + kRowPad;
constexpr int kMinChunk = 64;  // fewest tokens a split takes
constexpr int kColsPerThread = kHeads * kV / kThreads;  // 32 output columns of one head

static_assert(kHeads * kTile == 2 * kThreads, "two (head, token) scores per thread");
static_assert(kColsPerThread == 32, "four 8-column chunks per thread");

struct Smem {
  float q[kHeads][kQK];
  __align__(16) uint16_t rows[kTile][kRow];  // raw 16-bit values of the tile's latent rows
  float p[kHeads][kTile];
  float alpha[kHeads];
};

__host__ __device__ __forceinline__ int mla_chunk(int len, int splits) {
  int c = (len + splits - 1) / splits;
  c = (c + kTile - 1) / kTile * kTile;
  return c < kMinChunk ? kMinChunk : c;
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  return Dtype<T>::unpack(v);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) mla_decode_kernel(MlaDecodeParams p) {
  grid_dependency_wait();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int split = blockIdx.x, group = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int head0 = group * kHeads;
  const int len = p.seq_lens[b];
  const int chunk = mla_chunk(len, p.num_splits);
  const int begin = split * chunk;
  const int end = min(begin + chunk, len);
  if (begin >= end && split > 0) return;  // past the end: the combine skips this split

  // The 16 heads' queries as float (rows past num_heads are zero).
  for (int i = tid; i < kHeads * kQK / 2; i += kThreads) {
    const int h = i / (kQK / 2), c = i % (kQK / 2) * 2;
    float2 v = make_float2(0.f, 0.f);
    if (head0 + h < p.num_heads) {
      const T* q = static_cast<const T*>(p.q) + b * p.q_stride_b + (head0 + h) * p.q_stride_h;
      v = unpack2<T>(*reinterpret_cast<const uint32_t*>(q + c));
    }
    s.q[h][c] = v.x;
    s.q[h][c + 1] = v.y;
  }

  // Softmax state of heads `warp` and `warp + 8`, held by every lane of the warp.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  // Output columns of one head: 4 chunks of 8, the chunks 128 columns apart.
  const int oh = tid / (kThreads / kHeads), oc = tid % (kThreads / kHeads) * 8;
  float acc[kColsPerThread];
#pragma unroll
  for (int i = 0; i < kColsPerThread; ++i) acc[i] = 0.f;

  const int32_t* slots = p.req_to_token + static_cast<int64_t>(p.req_pool_indices[b]) * p.rt_stride;
  const T* cache = static_cast<const T*>(p.cache);
  for (int t0 = begin; t0 < end; t0 += kTile) {
    __syncthreads();  // the last tile's rows and weights are no longer read
    constexpr int kChunks = kQK / 8;  // 16-byte chunks per row
    for (int i = tid; i < kTile * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (t0 + r < end) {
        const T* row = cache + static_cast<int64_t>(slots[t0 + r]) * p.slot_stride;
        v = *reinterpret_cast<const uint4*>(row + c);
      }
      *reinterpret_cast<uint4*>(&s.rows[r][c]) = v;
    }
    __syncthreads();

    // Scores: thread (warp w, lane t) takes heads w and w + 8 against token t.
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int h = warp + 8 * k;
      float dot = 0.f;
#pragma unroll 4
      for (int c = 0; c < kQK; c += 8) {
        const uint4 raw = *reinterpret_cast<const uint4*>(&s.rows[lane][c]);
        const float4 qa = *reinterpret_cast<const float4*>(&s.q[h][c]);
        const float4 qb = *reinterpret_cast<const float4*>(&s.q[h][c + 4]);
        const float2 r0 = unpack2<T>(raw.x), r1 = unpack2<T>(raw.y);
        const float2 r2 = unpack2<T>(raw.z), r3 = unpack2<T>(raw.w);
        dot += qa.x * r0.x + qa.y * r0.y + qa.z * r1.x + qa.w * r1.y;
        dot += qb.x * r2.x + qb.y * r2.y + qb.z * r3.x + qb.w * r3.y;
      }
      const float score = t0 + lane < end ? dot * p.scale_log2 : -INFINITY;
      float tile_max = score;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(~0u, tile_max, o));
      const float m_new = fmaxf(m[k], tile_max);
      const float e = exp2f(score - m_new);
      float sum = e;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
      const float alpha = exp2f(m[k] - m_new);
      l[k] = l[k] * alpha + sum;
      m[k] = m_new;
      s.p[h][lane] = e;
      if (lane == 0) s.alpha[h] = alpha;
    }
    __syncthreads();

    // Values: acc = acc * alpha + sum_t p[t] * row[t][cols].
    const float alpha = s.alpha[oh];
#pragma unroll
    for (int i = 0; i < kColsPerThread; ++i) acc[i] *= alpha;
    const int n = min(kTile, end - t0);
    for (int t = 0; t < n; ++t) {
      const float w = s.p[oh][t];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 raw = *reinterpret_cast<const uint4*>(&s.rows[t][oc + 128 * j]);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int w2 = 0; w2 < 4; ++w2) {
          const float2 v = unpack2<T>(words[w2]);
          acc[8 * j + 2 * w2] += w * v.x;
          acc[8 * j + 2 * w2 + 1] += w * v.y;
        }
      }
    }
  }

  // Head oh's (m, l) lives in warp oh % 8, slot oh / 8: pass it through shared memory.
  __syncthreads();
  if (lane == 0) {
    s.p[warp][0] = m[0];
    s.p[warp][1] = l[0];
    s.p[warp + 8][0] = m[1];
    s.p[warp + 8][1] = l[1];
  }
  __syncthreads();
  const int head = head0 + oh;
  if (head >= p.num_heads) return;
  const float mh = s.p[oh][0], lh = s.p[oh][1];
  const float inv = lh > 0.f ? 1.f / lh : 0.f;
  if (p.num_splits == 1) {
    T* out = static_cast<T*>(p.out) + b * p.out_stride_b + head * p.out_stride_h;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t packed[4];
#pragma unroll
      for (int w2 = 0; w2 < 4; ++w2)
        packed[w2] = Dtype<T>::pack(acc[8 * j + 2 * w2] * inv, acc[8 * j + 2 * w2 + 1] * inv);
      *reinterpret_cast<uint4*>(out + oc + 128 * j) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
    return;
  }
  const int64_t part = (static_cast<int64_t>(b) * p.num_heads + head) * p.num_splits + split;
  float* o = p.o_part + part * kV;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    *reinterpret_cast<float4*>(o + oc + 128 * j) =
        make_float4(acc[8 * j] * inv, acc[8 * j + 1] * inv, acc[8 * j + 2] * inv, acc[8 * j + 3] * inv);
    *reinterpret_cast<float4*>(o + oc + 128 * j + 4) = make_float4(
        acc[8 * j + 4] * inv, acc[8 * j + 5] * inv, acc[8 * j + 6] * inv, acc[8 * j + 7] * inv);
  }
  if (oc == 0) {
    p.ml_part[2 * part] = mh;
    p.ml_part[2 * part + 1] = lh;
  }
}

// One block per (request, head): the active splits' normalized partials, weighted by
// l * 2^(m - max m).
template <typename T>
__global__ void __launch_bounds__(128) mla_combine_kernel(MlaDecodeParams p) {
  grid_dependency_wait();
  const int head = blockIdx.x, b = blockIdx.y;
  const int len = p.seq_lens[b];
  const int active = max(1, min(p.num_splits, (len + mla_chunk(len, p.num_splits) - 1) /
                                                  mla_chunk(len, p.num_splits)));
  const int64_t base = (static_cast<int64_t>(b) * p.num_heads + head) * p.num_splits;
  float m_max = -INFINITY;
  for (int i = 0; i < active; ++i) m_max = fmaxf(m_max, p.ml_part[2 * (base + i)]);
  float weight[64];
  float total = 0.f;
  for (int i = 0; i < active && i < 64; ++i) {
    const float m = p.ml_part[2 * (base + i)], l = p.ml_part[2 * (base + i) + 1];
    weight[i] = l > 0.f ? l * exp2f(m - m_max) : 0.f;
    total += weight[i];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  T* out = static_cast<T*>(p.out) + b * p.out_stride_b + head * p.out_stride_h;
  for (int c = threadIdx.x * 4; c < kV; c += blockDim.x * 4) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i = 0; i < active && i < 64; ++i) {
      const float4 v = *reinterpret_cast<const float4*>(p.o_part + (base + i) * kV + c);
      sum.x += weight[i] * v.x;
      sum.y += weight[i] * v.y;
      sum.z += weight[i] * v.z;
      sum.w += weight[i] * v.w;
    }
    *reinterpret_cast<uint2*>(out + c) =
        make_uint2(Dtype<T>::pack(sum.x * inv, sum.y * inv), Dtype<T>::pack(sum.z * inv, sum.w * inv));
  }
}

template <typename T>
cudaError_t launch_typed(const MlaDecodeParams& p, cudaStream_t stream) {
  const int smem = static_cast<int>(sizeof(Smem));
  auto kern = mla_decode_kernel<T>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_splits, (p.num_heads + kHeads - 1) / kHeads, p.batch);
  launch(kern, grid, kThreads, smem, stream, p);
  if (p.num_splits > 1) {
    launch(mla_combine_kernel<T>, dim3(p.num_heads, p.batch), 128, 0, stream, p);
  }
  return cudaGetLastError();
}

}  // namespace

int mla_max_splits() { return 64; }

cudaError_t launch_mla_decode(const MlaDecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.dtype == DType::kBF16) return launch_typed<__nv_bfloat16>(p, stream);
  if (p.dtype == DType::kFP16) return launch_typed<__half>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvray
