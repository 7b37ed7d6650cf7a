// Skinny GEMM on tensor cores for decode batches: out[M, N] = x[M, K] @ w[N, K]^T (+ bias)
// for M <= 64, the batch sizes where a linear layer is still one pass over its weights but
// too many rows for the GEMV's CUDA-core dot products.
//
// It is the GEMV's weight stream with mma.sync doing the arithmetic. Each warp owns 16 rows
// of w (two 8-row tiles, the MMA's B operand) and all M rows of x (16-row tiles, the A
// operand), and streams its rows in 16-byte chunks. An MMA takes 16 values of K, but the dot
// product does not care in which order K is visited, so a lane's 16-byte chunk of a weight
// row (8 consecutive K) feeds two MMAs: lane (g, t) loads chunk t of each 32-K step of rows g
// and 8 + g, and the x chunk it loads at the same K fills the matching slots of A.
//
// The weight chunks come through a ring in shared memory private to each lane: cp.async
// keeps kRing steps in flight without holding registers, and a lane reads back only what it
// wrote, so no barrier. On the demo's matrices the ring's first steps, issued before the
// wait on the previous kernel, are most of a warp's weights. x's few rows come through L1;
// no ldmatrix. Float32 accumulation, one rounding at the end. Where the engine runs it
// (small matrices, where it beats cuBLAS) is CudaOps' choice, worker/model/ops.py.
//
// Gated (the MLP's gate_up, w = [gate; up], N = 2 * inter): a warp's two tiles are gate rows
// j..j+7 and up rows inter + j..j+7, so the lane holding gate(m, j) also holds up(m, j) and
// writes silu(gate) * up as silu_and_mul would from the two rounded outputs.
//
// Rope (a qkv projection, head_dim a multiple of 16): the two tiles are rows i..i+7 and
// i + D/2.. of one head, so the lane holding x[i] of a token also holds x[i + D/2]; it
// rotates q and k and writes k and v to the cache as rotary_store_kv would (rope.cuh).
#include "common.cuh"
#include "launch.h"
#include "rope.cuh"

namespace kvray {
namespace {

// What the epilogue writes: the rows; silu(gate) * up of a gate_up projection; or a qkv
// projection's q and k rotated and its k and v also to the cache (rope.cuh).
enum class Epilogue { kPlain, kGated, kRope };

constexpr int kThreads = 256, kWarps = kThreads / kWarp;
constexpr int kStepChunks = 4;  // 16-byte chunks of a row per 32-K step, one per lane of a quad

// 32-K steps of weight chunks in flight a lane, and the ring's bytes a block: [warp][step
// mod kRing][tile][lane], 16 bytes each
constexpr int kRing = 8;
constexpr int kRingBytes = kWarps * kRing * 2 * kWarp * 16;

// Warps sharing a group of rows over K (1, 2, 4 or 8): p.split when set, else the fewest that
// give at least two blocks an SM.
int skinny_split(const GemvParams& p) {
  if (p.split != 0) return p.split;
  const bool paired = p.gated || p.rope.positions != nullptr;
  const int groups = paired ? (p.n / 2 + 7) / 8 : (p.n + 15) / 16;
  const int blocks = (groups + kWarps - 1) / kWarps;  // at split 1
  int split = 1;
  while (split < 8 && blocks * split < 2 * p.num_sms) split *= 2;
  return split;
}

// The MMAs of one 32-K step from its first chunk c: w's two tiles in wv, x through L1.
template <typename T, int MT>
__device__ __forceinline__ void step_mma(const GemvParams& p, const uint4* x, int64_t x_chunks,
                                         int c, bool c_ok, int g, const uint4 (&wv)[2],
                                         float (&acc)[MT][2][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int m0 = mt * 16 + g, m1 = m0 + 8;
    const uint4 xa = c_ok && m0 < p.m ? __ldg(x + m0 * x_chunks + c) : make_uint4(0, 0, 0, 0);
    const uint4 xb = c_ok && m1 < p.m ? __ldg(x + m1 * x_chunks + c) : make_uint4(0, 0, 0, 0);
    const uint32_t* a0 = reinterpret_cast<const uint32_t*>(&xa);
    const uint32_t* a1 = reinterpret_cast<const uint32_t*>(&xb);
#pragma unroll
    for (int s = 0; s < 2; ++s) {  // K 8t + 4s .. 8t + 4s + 3 of the step
      const uint32_t a[4] = {a0[2 * s], a1[2 * s], a0[2 * s + 1], a1[2 * s + 1]};
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        const uint32_t* b = reinterpret_cast<const uint32_t*>(&wv[tile]);
        Dtype<T>::mma(acc[mt][tile], a, b[2 * s], b[2 * s + 1]);
      }
    }
  }
}

template <typename T, int MT, Epilogue E, int SPLIT>
__global__ void __launch_bounds__(kThreads, 2) skinny_kernel(const GemvParams p) {
  constexpr int kGroups = kWarps / SPLIT;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;  // the MMA's groupID and thread-in-group
  const int group = warp / SPLIT, part = warp % SPLIT;
  const int gi = blockIdx.x * kGroups + group;
  // tile 0: rows row0..row0+7; tile 1: row0 + gap..
  const int half = p.rope.head_dim / 2;
  int row0, gap;
  if constexpr (E == Epilogue::kPlain) {
    row0 = gi * 16, gap = 8;
  } else if constexpr (E == Epilogue::kGated) {
    row0 = gi * 8, gap = p.n / 2;  // gate rows, up rows
  } else {
    row0 = gi * 8 / half * p.rope.head_dim + gi * 8 % half, gap = half;  // a head's halves
  }
  const int r0 = row0 + g, r1 = row0 + gap + g;
  const bool ok0 = E == Epilogue::kPlain ? r0 < p.n : gi * 8 + g < p.n / 2;
  const bool ok1 = E == Epilogue::kPlain ? r1 < p.n : ok0;
  const int chunks = p.k / 8;
  // each part a whole number of 32-K steps
  const int per_part = (chunks + SPLIT * kStepChunks - 1) / (SPLIT * kStepChunks) * kStepChunks;
  const int c_begin = part * per_part, c_end = min(chunks, c_begin + per_part);
  const uint4* w = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w));
  const uint4* w0 = w + static_cast<int64_t>(ok0 ? r0 : 0) * chunks + t;
  const uint4* w1 = w + static_cast<int64_t>(ok1 ? r1 : 0) * chunks + t;
  const uint4* x = reinterpret_cast<const uint4*>(p.x) + t;
  const int64_t x_chunks = p.x_stride / 8;
  float acc[MT][2][4] = {};
  extern __shared__ uint4 ring[];
  uint4* own = ring + warp * kRing * 2 * kWarp + lane;
  const int steps = (c_end - c_begin + kStepChunks - 1) / kStepChunks;
  const auto issue = [&](int s) {  // step s's chunks into its slot (zeros past the end)
    const int c = c_begin + s * kStepChunks;
    const bool in = s < steps && c + t < c_end;
    uint4* slot = own + (s % kRing) * 2 * kWarp;
    cp_async16(slot, w0 + (in ? c : 0), ok0 && in);
    cp_async16(slot + kWarp, w1 + (in ? c : 0), ok1 && in);
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kRing - 1; ++s) issue(s);  // weights first (see gemv.cu)
  grid_dependency_wait();
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<kRing - 2>();  // step s has landed
    issue(s + kRing - 1);        // into the slot step s - 1 read
    const uint4* slot = own + (s % kRing) * 2 * kWarp;
    const uint4 wv[2] = {slot[0], slot[kWarp]};
    const int c = c_begin + s * kStepChunks;
    step_mma<T, MT>(p, x, x_chunks, c, c + t < c_end, g, wv, acc);
  }
  cp_async_wait<0>();  // the zero-fills past the end, before the block leaves

  if constexpr (SPLIT > 1) {  // the group's first warp adds the others' sums, in order
    __shared__ float parts[kWarps][MT * 8][kWarp];
    float* mine = &acc[0][0][0];
#pragma unroll
    for (int i = 0; i < MT * 8; ++i) parts[warp][i][lane] = mine[i];
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int i = 0; i < MT * 8; ++i)
#pragma unroll
      for (int q = 1; q < SPLIT; ++q) mine[i] += parts[warp + q][i][lane];
  }

  // acc[mt][tile] holds C(m, col) for m = mt*16 + g (+ 8 in [2], [3]), col = 2t, 2t + 1
  T* out = static_cast<T*>(p.out);
  const T* bias = static_cast<const T*>(p.bias);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = mt * 16 + g + (i >= 2 ? 8 : 0);
      const int col = 2 * t + (i & 1);
      if (m >= p.m) continue;
      if constexpr (E == Epilogue::kRope) {
        const int64_t at = p.rope.positions[m] * p.rope.head_dim + row0 % p.rope.head_dim + col;
        const float cs[4] = {p.rope.cos[at], p.rope.cos[at + half], p.rope.sin[at],
                             p.rope.sin[at + half]};
        rope_epilogue_pair<T>(p, m, row0 + col, acc[mt][0][i], acc[mt][1][i], cs, p.rope.loc[m]);
      } else if constexpr (E == Epilogue::kGated) {
        const int inter = p.n / 2;
        const int j = row0 + col;
        if (j >= inter) continue;
        const float bg = bias != nullptr ? Num<T>::to_f(bias[j]) : 0.f;
        const float bu = bias != nullptr ? Num<T>::to_f(bias[inter + j]) : 0.f;
        const float a = Num<T>::to_f(Num<T>::from_f(acc[mt][0][i] + bg));
        const float up = Num<T>::to_f(Num<T>::from_f(acc[mt][1][i] + bu));
        const float act = Num<T>::to_f(Num<T>::from_f(a / (1.0f + expf(-a))));  // torch's silu
        out[m * p.out_stride + j] = Num<T>::from_f(__fmul_rn(act, up));
      } else {
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
          const int row = row0 + tile * 8 + col;
          if (row >= p.n) continue;
          const float b = bias != nullptr ? Num<T>::to_f(bias[row]) : 0.f;
          out[m * p.out_stride + row] = Num<T>::from_f(acc[mt][tile][i] + b);
        }
      }
    }
}

template <auto kernel>
cudaError_t launch_one(unsigned blocks, const GemvParams& p, cudaStream_t stream) {
  static const cudaError_t set =  // once a kernel: the ring is over the 48 KiB default
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes);
  if (set != cudaSuccess) return set;
  return launch(kernel, blocks, kThreads, kRingBytes, stream, p);
}

template <typename T, int MT, int SPLIT>
cudaError_t launch_split(const GemvParams& p, cudaStream_t stream) {
  const bool rope = p.rope.positions != nullptr, paired = p.gated || rope;
  const int rows_per_block = kWarps / SPLIT * (paired ? 8 : 16);
  const int out_rows = paired ? p.n / 2 : p.n;
  const unsigned blocks = static_cast<unsigned>((out_rows + rows_per_block - 1) / rows_per_block);
  if (rope) return launch_one<skinny_kernel<T, MT, Epilogue::kRope, SPLIT>>(blocks, p, stream);
  if (p.gated) return launch_one<skinny_kernel<T, MT, Epilogue::kGated, SPLIT>>(blocks, p, stream);
  return launch_one<skinny_kernel<T, MT, Epilogue::kPlain, SPLIT>>(blocks, p, stream);
}

template <typename T, int MT>
cudaError_t launch_tiles(const GemvParams& p, cudaStream_t stream) {
  switch (skinny_split(p)) {
    case 1: return launch_split<T, MT, 1>(p, stream);
    case 2: return launch_split<T, MT, 2>(p, stream);
    case 4: return launch_split<T, MT, 4>(p, stream);
    case 8: return launch_split<T, MT, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_skinny_gemm(const GemvParams& p, cudaStream_t stream) {
  return dispatch_gemm(p, [&](auto dtype, auto mt) {
    return launch_tiles<decltype(dtype), decltype(mt)::value>(p, stream);
  });
}

}  // namespace kvray
