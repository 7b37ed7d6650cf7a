// Skinny GEMM on tensor cores for decode batches: out[M, N] = x[M, K] @ w[N, K]^T (+ bias)
// for M <= 64, the batch sizes where a linear layer is still one pass over its weights but
// too many rows for the GEMV's CUDA-core dot products.
//
// It is the GEMV's weight stream with mma.sync doing the arithmetic. Each warp owns 16 rows
// of w (two 8-row tiles, the MMA's B operand) and all M rows of x (16-row tiles, the A
// operand), and streams its rows with 16-byte loads, the next kUnroll steps' chunks in flight
// while this step's are multiplied. An MMA takes 16 values of K, but the dot product does not care in which order K is
// visited, so a lane's 16-byte chunk of a weight row (8 consecutive K) feeds two MMAs: lane
// (g, t) loads chunk t of each 32-K step of rows g and 8 + g, and the x chunk it loads at the
// same K fills the matching slots of A. No shared memory, no ldmatrix; x's few rows come
// through L1. Float32 accumulation, one rounding at the end. Where the engine runs it
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

// 32-K steps whose weight chunks a lane loads at once (twice that in flight, double-buffered):
// fewer with more x tiles, which would otherwise spill the registers
template <int MT>
constexpr int kUnroll = MT == 1 ? 4 : 2;

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

// This lane's chunk of each of U steps from chunk c0 on, of its rows in the two tiles.
template <int U>
__device__ __forceinline__ void load_w(const uint4* w0, const uint4* w1, bool ok0, bool ok1,
                                       int c0, int c_end, uint4 (&wv)[U][2]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u * kStepChunks;
    wv[u][0] = ok0 && c < c_end ? __ldcs(w0 + c) : make_uint4(0, 0, 0, 0);
    wv[u][1] = ok1 && c < c_end ? __ldcs(w1 + c) : make_uint4(0, 0, 0, 0);
  }
}

template <typename T, int MT, Epilogue E, int SPLIT>
__global__ void __launch_bounds__(kThreads, 2) skinny_kernel(const GemvParams p) {
  constexpr int kGroups = kWarps / SPLIT, U = kUnroll<MT>;
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
  uint4 wv[U][2], next[U][2];
  load_w(w0, w1, ok0, ok1, c_begin, c_end - t, wv);  // weights first (see gemv.cu)
  grid_dependency_wait();

  const uint4* x = reinterpret_cast<const uint4*>(p.x) + t;
  const int64_t x_chunks = p.x_stride / 8;
  float acc[MT][2][4] = {};
  for (int c0 = c_begin; c0 < c_end; c0 += U * kStepChunks) {
    // the next U steps' weights are in flight while this one's MMAs run
    const int c_next = c0 + U * kStepChunks;
    if (c_next < c_end) load_w(w0, w1, ok0, ok1, c_next, c_end - t, next);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * kStepChunks;  // the quad's first chunk of this step
      if (c >= c_end) break;
      const bool c_ok = c + t < c_end;
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
            const uint32_t* b = reinterpret_cast<const uint32_t*>(&wv[u][tile]);
            Dtype<T>::mma(acc[mt][tile], a, b[2 * s], b[2 * s + 1]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      wv[u][0] = next[u][0];
      wv[u][1] = next[u][1];
    }
  }

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

template <typename T, int MT, int SPLIT>
void launch_split(const GemvParams& p, cudaStream_t stream) {
  const bool rope = p.rope.positions != nullptr, paired = p.gated || rope;
  const int rows_per_block = kWarps / SPLIT * (paired ? 8 : 16);
  const int out_rows = paired ? p.n / 2 : p.n;
  const unsigned blocks = static_cast<unsigned>((out_rows + rows_per_block - 1) / rows_per_block);
  if (rope) {
    launch(skinny_kernel<T, MT, Epilogue::kRope, SPLIT>, blocks, kThreads, 0, stream, p);
  } else if (p.gated) {
    launch(skinny_kernel<T, MT, Epilogue::kGated, SPLIT>, blocks, kThreads, 0, stream, p);
  } else {
    launch(skinny_kernel<T, MT, Epilogue::kPlain, SPLIT>, blocks, kThreads, 0, stream, p);
  }
}

template <typename T, int MT>
cudaError_t launch_tiles(const GemvParams& p, cudaStream_t stream) {
  switch (skinny_split(p)) {
    case 1: launch_split<T, MT, 1>(p, stream); break;
    case 2: launch_split<T, MT, 2>(p, stream); break;
    case 4: launch_split<T, MT, 4>(p, stream); break;
    case 8: launch_split<T, MT, 8>(p, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_skinny_gemm(const GemvParams& p, cudaStream_t stream) {
  return dispatch_gemm(p, [&](auto dtype, auto mt) {
    return launch_tiles<decltype(dtype), decltype(mt)::value>(p, stream);
  });
}

}  // namespace kvray
