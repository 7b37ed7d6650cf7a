// Paged decode attention, split-KV (FlashDecoding) with a combine step.
//
// A warp owns the q heads of one kv head's GQA group as the 16 rows of m16n8k16
// tensor-core MMAs (rows past the group are zero), so every K/V byte is read from memory
// once per step. It streams 16-token tiles through its own cp.async ring in shared
// memory (no block-wide barriers in the main loop) and keeps an online-softmax state.
// Two block layouts share that warp code:
//  - token-split: one block per (split, kv head, request); its warps take interleaved
//    tiles of the split and merge their states in shared memory at the end;
//  - head-major: one block per (split, 4 kv heads, request); each warp streams one head,
//    so the block reads adjacent head slices of the same token rows together.
// Variant 0 picks head-major once the batch alone gives every SM a block, token-split
// below that. With one split holding tokens (one in the grid, or a sequence shorter than
// the shortest split) the block writes the output directly; otherwise it writes
// a normalized partial plus (max, sum) and the active splits are merged: by a combine
// kernel, or, given zeroed counters, by whichever split of a (request, head unit)
// finishes last (one launch fewer a layer; the counter is left at zero for the next), or,
// in the token-split layout with up to 16 splits, by the first split of a thread-block
// cluster holding all of them, reading the others' partials from their shared memory (no
// round trip through global memory, no fence or atomic).
//
// Under programmatic launch a warp issues the first tiles of its ring before it waits for
// the kernel before, which writes q and each sequence's newest token: tiles of older
// tokens only, so their loads overlap that kernel.
//
// The grid depends only on shapes (batch, heads, the split count chosen from the batch
// size), never on live sequence lengths, so launches can be captured in CUDA graphs;
// splits that start past a sequence's end exit at once and the combine skips them.
//
// An FP8 cache (e4m3 bytes, one float32 scale per token and kv head) runs the same kernels
// on half the bytes: its tiles are widened to bf16 as fragments leave shared memory, each
// token's K scale multiplies its score after the QK MMA and its V scale is folded into P
// before the PV MMA (attend_tile_fp8).
#include <algorithm>
#include <cooperative_groups.h>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

constexpr int kRows = 16;  // q heads per block: the MMA M dimension

__host__ __device__ __forceinline__ int split_chunk(int len, int num_splits, int tile,
                                                    int min_chunk) {
  int c = (len + num_splits - 1) / num_splits;
  c = (c + tile - 1) / tile * tile;
  return c < min_chunk ? min_chunk : c;
}

template <typename KV>
constexpr bool kIsFp8 = std::is_same_v<KV, __nv_fp8_e4m3>;

// Geometry of one warp's K/V tile of TT tokens (elements of KV): how the warp's 16-byte
// copies cover it, and one ring stage: the K tile, the V tile and, for FP8, the tokens'
// K and V scales (TT floats each).
template <typename KV, int D, int TT>
struct Tile {
  static constexpr int kChunks = D * static_cast<int>(sizeof(KV)) / 16;  // per K/V row
  static constexpr int kChunkElems = 16 / static_cast<int>(sizeof(KV));
  static constexpr int kRowsPerPass = 32 / kChunks;  // rows one warp-wide copy covers
  static constexpr int kPasses = TT / kRowsPerPass;  // copies per tile per warp
  static constexpr int kElems = TT * D;
  static constexpr int kStageElems = 2 * kElems + (kIsFp8<KV> ? 2 * TT * 4 : 0);
  static_assert(TT % 16 == 0 && TT <= 32 && kPasses >= 1, "tile of 16 or 32 tokens");
};

// Element offset of 16-byte chunk `chunk` of tile row `row` (swizzled, see common.cuh).
template <typename KV, int D>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  if constexpr (kIsFp8<KV>) {
    return swz_fp8<D>(row, chunk);
  } else {
    return swz<D>(row, chunk);
  }
}

template <typename KV, int D, int NW, int TT, int ST>
struct Cfg {
  // Fewest tokens per split: shorter splits cost more in partials than they gain in
  // parallelism.
  static constexpr int kMinChunk = 256;
  static constexpr int kStageBytes =
      NW * ST * Tile<KV, D, TT>::kStageElems * static_cast<int>(sizeof(KV));
  static constexpr int kMergeBytes = NW * (kRows * D + 2 * kRows) * 4;
  static constexpr int kSmem = kStageBytes > kMergeBytes ? kStageBytes : kMergeBytes;
};

template <typename T, int D>
__device__ void store_row4(const DecodeParams& p, int b, int head, int d, const float v[4]) {
  T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + head * p.out_stride_h + d;
  uint2 packed = {Dtype<T>::pack(v[0], v[1]), Dtype<T>::pack(v[2], v[3])};
  *reinterpret_cast<uint2*>(dst) = packed;
}

// Online-softmax state of one warp over 16 q rows (heads); a lane holds rows r0, r0 + 8.
template <int D>
struct WarpState {
  float o[D / 8][4];
  float m[2], l[2];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }
};

// A lane's output columns: pair i (0 .. D/8 - 1) of row half h sits at head_dim column
// o_col0(lane) + off. The bf16 path holds columns 8i + c0, +1 in o[i]; the FP8 path (whose
// V operands come from byte-wise transposes) holds columns 4 * (lane & 3) .. + 3 of each
// 16, the even ones in o[2c] and the odd ones in o[2c + 1].
template <bool kFp8>
__device__ __forceinline__ int o_col0(int lane) {
  return kFp8 ? (lane & 3) * 4 : (lane & 3) * 2;
}

template <bool kFp8, int D>
__device__ __forceinline__ float2 o_pair(const WarpState<D>& st, int i, int h, int& off) {
  if constexpr (kFp8) {
    const int c = i >> 1, e = i & 1;
    off = c * 16 + 2 * e;
    return make_float2(st.o[2 * c][2 * h + e], st.o[2 * c + 1][2 * h + e]);
  } else {
    off = i * 8;
    return make_float2(st.o[i][2 * h], st.o[i][2 * h + 1]);
  }
}

// The FP8 tiles' bf16 operands are the e4m3 values times 2^-120 (e4m3x2_to_bf16x2_raw):
// Q is scaled by 2^60 here and scores and P by 2^60 in attend_tile_fp8, which keeps every
// product and sum far inside float32's normal range; the output is scaled back at the end.
constexpr float kFp8QScale = 0x1p60f;
constexpr float kFp8PScale = 0x1p60f;
constexpr float kFp8OScale = 0x1p60f;

// Q rows head0 .. head0 + n_rows - 1 of request b as MMA A fragments (zero past n_rows).
// With kFp8 the columns of each 16 are permuted as the K operands are (attend_tile_fp8):
// a lane's k pairs c0, c0 + 8 hold head_dim columns 4 * (lane & 3) and + 2.
template <typename T, int D, bool kFp8>
__device__ __forceinline__ void load_q(uint32_t (&qa)[D / 16][4], const DecodeParams& p, int b,
                                       int head0, int n_rows, int lane) {
  const int r0 = lane >> 2, c0 = (lane & 3) * 2;
  const T* qb = static_cast<const T*>(p.q) + b * p.q_stride_b + head0 * p.q_stride_h;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = r0 + (i & 1) * 8;
      const int col = kFp8 ? kk * 16 + 2 * c0 + (i >> 1) * 2 : kk * 16 + c0 + (i >> 1) * 8;
      qa[kk][i] = row < n_rows
                      ? *reinterpret_cast<const uint32_t*>(qb + row * p.q_stride_h + col)
                      : 0u;
      if constexpr (kFp8) {
        const float2 f = Dtype<T>::unpack(qa[kk][i]);
        qa[kk][i] = Dtype<T>::pack(f.x * kFp8QScale, f.y * kFp8QScale);
      }
    }
  }
}

// One tile of TT tokens from shared memory: S = Q K^T, online softmax, O += P V.
template <typename T, int D, int TT>
__device__ __forceinline__ void attend_tile(WarpState<D>& st, const uint32_t (&qa)[D / 16][4],
                                            const T* ks, const T* vs, int nvalid,
                                            float scale_log2, int lane) {
  const int c0 = (lane & 3) * 2;
  float s[TT / 8][4];
#pragma unroll
  for (int nt = 0; nt < TT / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < TT / 16; ++np) {
      uint32_t bk[4];
      ldsm_x4(bk, ks + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                              kk * 2 + ((lane >> 3) & 1)));
      Dtype<T>::mma(s[2 * np], qa[kk], bk[0], bk[1]);
      Dtype<T>::mma(s[2 * np + 1], qa[kk], bk[2], bk[3]);
    }
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < TT / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = nt * 8 + c0 + (e & 1);
      s[nt][e] = tok < nvalid ? s[nt][e] * scale_log2 : -INFINITY;
      mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
  }
  float corr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(st.m[h], quad_max(mx[h]));
    corr[h] = rescale(st.m[h], m_new);
    st.m[h] = m_new;
    st.l[h] *= corr[h];
  }
#pragma unroll
  for (int nt = 0; nt < TT / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = fast_exp2(s[nt][e] - st.m[e >> 1]);
      st.l[e >> 1] += s[nt][e];
    }
  }
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
    st.o[dn][0] *= corr[0];
    st.o[dn][1] *= corr[0];
    st.o[dn][2] *= corr[1];
    st.o[dn][3] *= corr[1];
  }
  // P's accumulator layout is already the A-operand layout of the PV MMA.
#pragma unroll
  for (int k16 = 0; k16 < TT / 16; ++k16) {
    uint32_t pa[4];
    pa[0] = Dtype<T>::pack(s[2 * k16][0], s[2 * k16][1]);
    pa[1] = Dtype<T>::pack(s[2 * k16][2], s[2 * k16][3]);
    pa[2] = Dtype<T>::pack(s[2 * k16 + 1][0], s[2 * k16 + 1][1]);
    pa[3] = Dtype<T>::pack(s[2 * k16 + 1][2], s[2 * k16 + 1][3]);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t bv[4];
      ldsm_x4_trans(bv, vs + swz<D>(k16 * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                    dp * 2 + (lane >> 4)));
      Dtype<T>::mma(st.o[2 * dp], pa, bv[0], bv[1]);
      Dtype<T>::mma(st.o[2 * dp + 1], pa, bv[2], bv[3]);
    }
  }
}

// One FP8 stage from shared memory: K and V tiles of e4m3 bytes, then the tokens' K and V
// scales. Operands are widened to bf16 as they leave shared memory; ldmatrix moves the
// bytes as 16-bit pairs, so
//  - K: a non-transposed load gives a lane 4 adjacent bytes (head_dim columns 4q .. 4q + 3
//    of one token, q = lane & 3), which become its k pairs c0 and c0 + 8: the same column
//    permutation is applied to Q (load_q), and a dot product does not care about order;
//  - V: a transposed load gives a lane 2 tokens x 2 columns per matrix; two matrices (tokens
//    2q, 2q + 1 and 2q + 8, 2q + 9) give, byte-picked, the B operands of column 2g (one MMA)
//    and of column 2g + 1 (another), g = lane >> 2, so each 16 columns take two accumulator
//    tiles, even and odd columns (o_pair reads them back in order).
template <int D, int TT>
__device__ __forceinline__ void attend_tile_fp8(WarpState<D>& st, const uint32_t (&qa)[D / 16][4],
                                                const __nv_fp8_e4m3* stage, int nvalid,
                                                float scale_log2, int lane) {
  using C = Tile<__nv_fp8_e4m3, D, TT>;
  const __nv_fp8_e4m3* ks = stage;
  const __nv_fp8_e4m3* vs = stage + C::kElems;
  const float* k_scale = reinterpret_cast<const float*>(stage + 2 * C::kElems);
  const float* v_scale = k_scale + TT;
  const int c0 = (lane & 3) * 2;
  // lane -> (token, chunk) of an x4 load: matrices (tokens 0-7 | 8-15) x (chunk | chunk + 1)
  const int ld_row = (lane & 7) + (((lane >> 3) & 1) << 3), ld_chunk = lane >> 4;
  constexpr uint32_t kLo = 0x9180, kHi = 0xB3A2;    // bytes 0, 1 | 2, 3, sign-extended
  constexpr uint32_t kEven = 0xA280, kOdd = 0xB391;  // bytes 0, 2 | 1, 3
  float s[TT / 8][4];
#pragma unroll
  for (int nt = 0; nt < TT / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; kk += 2) {
#pragma unroll
    for (int np = 0; np < TT / 16; ++np) {
      uint32_t r[4];
      ldsm_x4(r, ks + swz_fp8<D>(np * 16 + ld_row, kk + ld_chunk));
#pragma unroll
      for (int m = 0; m < 4; ++m)
        Dtype<__nv_bfloat16>::mma(s[2 * np + (m & 1)], qa[kk + (m >> 1)],
                                  e4m3x2_to_bf16x2_raw(r[m], kLo),
                                  e4m3x2_to_bf16x2_raw(r[m], kHi));
    }
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < TT / 8; ++nt) {
    const float2 ksc = *reinterpret_cast<const float2*>(k_scale + nt * 8 + c0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = nt * 8 + c0 + (e & 1);
      const float mul = ((e & 1) ? ksc.y : ksc.x) * scale_log2;
      s[nt][e] = tok < nvalid ? s[nt][e] * mul : -INFINITY;
      mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    }
  }
  float corr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(st.m[h], quad_max(mx[h]));
    corr[h] = rescale(st.m[h], m_new);
    st.m[h] = m_new;
    st.l[h] *= corr[h];
  }
#pragma unroll
  for (int nt = 0; nt < TT / 8; ++nt) {
    const float2 vsc = *reinterpret_cast<const float2*>(v_scale + nt * 8 + c0);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pv = fast_exp2(s[nt][e] - st.m[e >> 1]);
      st.l[e >> 1] += pv;
      s[nt][e] = pv * ((e & 1) ? vsc.y : vsc.x) * kFp8PScale;  // P with V's scale folded in
    }
  }
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
    st.o[dn][0] *= corr[0];
    st.o[dn][1] *= corr[0];
    st.o[dn][2] *= corr[1];
    st.o[dn][3] *= corr[1];
  }
#pragma unroll
  for (int k16 = 0; k16 < TT / 16; ++k16) {
    uint32_t pa[4];
    pa[0] = Dtype<__nv_bfloat16>::pack(s[2 * k16][0], s[2 * k16][1]);
    pa[1] = Dtype<__nv_bfloat16>::pack(s[2 * k16][2], s[2 * k16][3]);
    pa[2] = Dtype<__nv_bfloat16>::pack(s[2 * k16 + 1][0], s[2 * k16 + 1][1]);
    pa[3] = Dtype<__nv_bfloat16>::pack(s[2 * k16 + 1][2], s[2 * k16 + 1][3]);
#pragma unroll
    for (int dc = 0; dc < D / 16; dc += 2) {
      uint32_t r[4];
      ldsm_x4_trans(r, vs + swz_fp8<D>(k16 * 16 + ld_row, dc + ld_chunk));
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        Dtype<__nv_bfloat16>::mma(st.o[2 * (dc + c)], pa, e4m3x2_to_bf16x2_raw(r[2 * c], kEven),
                                  e4m3x2_to_bf16x2_raw(r[2 * c + 1], kEven));
        Dtype<__nv_bfloat16>::mma(st.o[2 * (dc + c) + 1], pa,
                                  e4m3x2_to_bf16x2_raw(r[2 * c], kOdd),
                                  e4m3x2_to_bf16x2_raw(r[2 * c + 1], kOdd));
      }
    }
  }
}

// A warp streams its tiles (tile i starts at token first + i * stride, tokens < end) of one
// kv head through its own ST-deep cp.async ring `wsm` and folds them into `st`. The slot
// of a tile's tokens is looked up one tile ahead so the page-table load is off the path.
// `ready` waits for the kernel before (grid_dependency_wait) and loads `qa`; it runs once
// the ring's first tiles that lie wholly before token `fresh` are issued: only a
// sequence's newest token (and q) can come from that kernel, every older one from an
// earlier step or kernel that has completed, so under programmatic launch those loads
// overlap the kernel before.
template <typename T, typename KV, int D, int TT, int ST, typename Ready>
__device__ __forceinline__ void stream_tiles(WarpState<D>& st, const uint32_t (&qa)[D / 16][4],
                                             KV* wsm, const DecodeParams& p, int b, int kvh,
                                             int first, int stride, int n_tiles, int end,
                                             int fresh, int lane, Ready&& ready) {
  using C = Tile<KV, D, TT>;
  constexpr bool kFp8 = kIsFp8<KV>;
  const int32_t* rt_row =
      p.kv.req_to_token + static_cast<int64_t>(p.kv.req_pool_indices[b]) * p.kv.rt_stride;
  const KV* kbase = static_cast<const KV*>(p.kv.k) + kvh * D;
  const KV* vbase = static_cast<const KV*>(p.kv.v) + kvh * D;
  auto tile_slot = [&](int i) -> int64_t {
    const int pos = first + i * stride + lane;
    return (lane < TT && pos < end) ? slot_of(rt_row, pos, p.kv.page_size) : int64_t(-1);
  };
  auto issue = [&](int i, int64_t my_slot) {
    KV* ks = wsm + (i % ST) * C::kStageElems;
    KV* vs = ks + C::kElems;
    const int col = lane % C::kChunks;
#pragma unroll
    for (int u = 0; u < C::kPasses; ++u) {
      const int row = lane / C::kChunks + u * C::kRowsPerPass;
      const int64_t slot = __shfl_sync(0xffffffffu, my_slot, row);
      const bool valid = slot >= 0;
      const int64_t off = valid ? slot * p.kv.slot_stride + col * C::kChunkElems : 0;
      cp_async16(ks + tile_offset<KV, D>(row, col), kbase + off, valid);
      cp_async16(vs + tile_offset<KV, D>(row, col), vbase + off, valid);
    }
    if constexpr (kFp8) {  // lane t < TT fetches token t's scales
      if (lane < TT) {
        float* sc = reinterpret_cast<float*>(vs + C::kElems);
        const int64_t at = my_slot >= 0 ? my_slot * p.num_kv_heads + kvh : 0;
        cp_async4(sc + lane, p.kv.k_scale + at, my_slot >= 0);
        cp_async4(sc + TT + lane, p.kv.v_scale + at, my_slot >= 0);
      }
    }
  };

  int64_t next_slot = n_tiles > 0 ? tile_slot(0) : -1;
  auto prologue = [&](int i) {
    if (i < n_tiles) {
      const int64_t s = next_slot;
      if (i + 1 < n_tiles) next_slot = tile_slot(i + 1);
      issue(i, s);
    }
    cp_async_commit();
  };
  int early = 0;  // prologue tiles issued before `ready`: each ends before `fresh`
  while (early < ST - 1 && early < n_tiles && min(end, first + early * stride + TT) <= fresh)
    prologue(early++);
  ready();
  for (int i = early; i < ST - 1; ++i) prologue(i);
  for (int i = 0; i < n_tiles; ++i) {
    const int nxt = i + ST - 1;
    if (nxt < n_tiles) {
      const int64_t s = next_slot;
      if (nxt + 1 < n_tiles) next_slot = tile_slot(nxt + 1);
      issue(nxt, s);
    }
    cp_async_commit();
    cp_async_wait<ST - 1>();
    __syncwarp();
    const KV* ks = wsm + (i % ST) * C::kStageElems;
    const int nvalid = min(TT, end - (first + i * stride));
    if constexpr (kFp8) {
      attend_tile_fp8<D, TT>(st, qa, ks, nvalid, p.scale_log2 * kFp8QScale, lane);
    } else {
      attend_tile<T, D, TT>(st, qa, ks, ks + C::kElems, nvalid, p.scale_log2, lane);
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  if constexpr (kFp8) {
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
      for (int e = 0; e < 4; ++e) st.o[dn][e] *= kFp8OScale;
  }
}

// Token range [start, end) of split `split` of a sequence of `len` tokens.
template <int TT, int MIN_CHUNK>
__device__ __forceinline__ void split_range(int len, int num_splits, int split, int& start,
                                            int& end) {
  const int chunk = split_chunk(len, num_splits, TT, MIN_CHUNK);
  start = split * chunk;
  end = min(len, start + chunk);
}

template <typename T, int D>
__device__ void write_zeros(const DecodeParams& p, int b, int head0, int n_rows, int tid,
                            int nthreads) {
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  for (int it = tid; it < n_rows * (D / 4); it += nthreads)
    store_row4<T, D>(p, b, head0 + it / (D / 4), (it % (D / 4)) * 4, zero);
}

// Splits of a sequence of `len` tokens that hold tokens (the ones that write partials).
__device__ __forceinline__ int active_splits(int len, int num_splits, int tile, int min_chunk) {
  const int chunk = split_chunk(len, num_splits, tile, min_chunk);
  return len > 0 ? (len + chunk - 1) / chunk : 0;
}

// One warp merges the n_act normalized partials of (request b, q head qh) into out, D / 32
// values a lane, splits in order. The partials may come from other blocks of this grid:
// they are read past L1.
template <typename T, int D>
__device__ void combine_head(const DecodeParams& p, int b, int qh, int n_act, int lane) {
  constexpr int E = D / 32;
  const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + qh) * p.s_cap;
  const float* ml = p.ml_part + row * 2;
  const float* op = p.o_part + row * D + lane * E;
  float mw = -INFINITY;
  for (int s = 0; s < n_act; ++s) mw = fmaxf(mw, __ldcg(ml + 2 * s));
  float lsum = 0.f, acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int s = 0; s < n_act; ++s) {
    const float w = __ldcg(ml + 2 * s + 1) * fast_exp2(__ldcg(ml + 2 * s) - mw);
    lsum += w;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] += w * __ldcg(op + s * D + e);
  }
  const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
  T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + qh * p.out_stride_h + lane * E;
  uint32_t packed[E / 2];
#pragma unroll
  for (int e = 0; e < E / 2; ++e) packed[e] = Dtype<T>::pack(acc[2 * e] * inv, acc[2 * e + 1] * inv);
  if constexpr (E == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = packed[0];
  }
}

// Counts one more finished split of (request b, head unit); true for the last of n_act.
// Called by one thread after its block's (or warp's) partials are fenced; the last one
// resets the counter for the next launch.
__device__ __forceinline__ bool count_split(const DecodeParams& p, int b, int unit, int n_act) {
  int* counter = p.counters + static_cast<int64_t>(b) * p.num_q_heads + unit;
  const bool last = atomicAdd(counter, 1) == n_act - 1;
  if (last) *counter = 0;
  return last;
}

// The merge of a cluster's splits: each block leaves its merged (o, m, l) rows in its shared
// memory, then the first split combines the n_act active ones as combine_head does, reading
// them through distributed shared memory; the second barrier keeps every block's shared
// memory alive until it has. Every thread of every block of the cluster calls it.
template <typename T, int D, int NW, int kItems>
__device__ void cluster_merge(const DecodeParams& p, int b, int head0, int n_rows, int split,
                              int n_act, const float4 (&kept_o)[kItems],
                              const float2 (&kept_ml)[kItems], uint8_t* smem_raw) {
#if KVRAY_CLUSTERS
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  float* mine = reinterpret_cast<float*>(smem_raw);  // [kRows][D] o, then [kRows] m, [kRows] l
  __syncthreads();  // the warps' states in this memory are read
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int it = threadIdx.x + k * NW * 32;
    if (it >= n_rows * (D / 4)) break;
    const int h = it / (D / 4), d = (it % (D / 4)) * 4;
    *reinterpret_cast<float4*>(mine + h * D + d) = kept_o[k];
    if (d == 0) mine[kRows * D + h] = kept_ml[k].x, mine[kRows * D + kRows + h] = kept_ml[k].y;
  }
  cluster.sync();
  if (split == 0) {
    for (int it = threadIdx.x; it < n_rows * (D / 4); it += NW * 32) {
      const int h = it / (D / 4), d = (it % (D / 4)) * 4;
      float mw = -INFINITY;
      for (int s = 0; s < n_act; ++s) mw = fmaxf(mw, cluster.map_shared_rank(mine, s)[kRows * D + h]);
      float lsum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int s = 0; s < n_act; ++s) {
        const float* r = cluster.map_shared_rank(mine, s);
        const float w = r[kRows * D + kRows + h] * fast_exp2(r[kRows * D + h] - mw);
        lsum += w;
        const float4 o = *reinterpret_cast<const float4*>(r + h * D + d);
        acc[0] += w * o.x, acc[1] += w * o.y, acc[2] += w * o.z, acc[3] += w * o.w;
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] *= inv;
      store_row4<T, D>(p, b, head0 + h, d, acc);
    }
  }
  cluster.sync();
#endif
}

// Token-split layout: one block per (split, kv head, request); its NW warps take
// interleaved tiles of the split and merge their states through shared memory at the end.
template <typename T, typename KV, int D, int NW, int TT, int ST>
__global__ void __launch_bounds__(NW * 32) decode_split_kernel(const DecodeParams p) {
  using C = Cfg<KV, D, NW, TT, ST>;
  constexpr bool kFp8 = kIsFp8<KV>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head_chunks = (group + kRows - 1) / kRows;
  const int kvh = blockIdx.y / head_chunks, hc = blockIdx.y % head_chunks;
  const int b = blockIdx.z, split = blockIdx.x;
  const int n_rows = min(kRows, group - hc * kRows);
  const int head0 = kvh * group + hc * kRows;

  const int len = p.kv.seq_lens[b];
  int start, end;
  split_range<TT, C::kMinChunk>(len, p.num_splits, split, start, end);
  // The only split holding tokens (a sequence under kMinChunk) writes the output itself;
  // with several, a cluster's blocks all take part in its two barriers (they see one len).
  const int n_act = active_splits(len, p.num_splits, TT, C::kMinChunk);
  const bool direct = n_act == 1, clustered = p.cluster && n_act > 1;
  if (start >= end) {  // an empty sequence's output is zeros, written by its first split
    grid_dependency_wait();
    if (p.num_splits == 1 || (p.counters != nullptr && split == 0))
      write_zeros<T, D>(p, b, head0, n_rows, threadIdx.x, NW * 32);
#if KVRAY_CLUSTERS
    if (clustered) {
      cooperative_groups::this_cluster().sync();
      cooperative_groups::this_cluster().sync();
    }
#endif
    return;
  }
  uint32_t qa[D / 16][4];
  WarpState<D> st;
  st.init();
  const int n_tiles = (end - start + TT - 1) / TT;
  const int my_tiles = warp < n_tiles ? (n_tiles - warp + NW - 1) / NW : 0;
  KV* wsm = reinterpret_cast<KV*>(smem_raw) + warp * ST * Tile<KV, D, TT>::kStageElems;
  stream_tiles<T, KV, D, TT, ST>(st, qa, wsm, p, b, kvh, start + warp * TT, NW * TT, my_tiles,
                                 end, len - 1, lane, [&] {
                                   grid_dependency_wait();
                                   load_q<T, D, kFp8>(qa, p, b, head0, n_rows, lane);
                                 });
  __syncthreads();

  // Merge the warps' states through shared memory (the tile ring is free now).
  const int r0 = lane >> 2, c0 = o_col0<kFp8>(lane);
  constexpr int kWarpFloats = kRows * D + 2 * kRows;
  float* wo = reinterpret_cast<float*>(smem_raw) + warp * kWarpFloats;
  {
    const float l0 = quad_sum(st.l[0]), l1 = quad_sum(st.l[1]);
    if ((lane & 3) == 0) {
      wo[kRows * D + r0] = st.m[0];
      wo[kRows * D + r0 + 8] = st.m[1];
      wo[kRows * D + kRows + r0] = l0;
      wo[kRows * D + kRows + r0 + 8] = l1;
    }
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      int off;
      const float2 lo = o_pair<kFp8, D>(st, dn, 0, off), hi = o_pair<kFp8, D>(st, dn, 1, off);
      *reinterpret_cast<float2*>(wo + r0 * D + off + c0) = lo;
      *reinterpret_cast<float2*>(wo + (r0 + 8) * D + off + c0) = hi;
    }
  }
  __syncthreads();

  const float* all = reinterpret_cast<const float*>(smem_raw);
  constexpr int kItems = (kRows * D / 4 + NW * 32 - 1) / (NW * 32);  // a thread's, at most
  float4 kept_o[kItems];  // this split's merged state, kept for the cluster's merge
  float2 kept_ml[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int it = threadIdx.x + k * NW * 32;
    if (it >= n_rows * (D / 4)) break;
    const int h = it / (D / 4), d = (it % (D / 4)) * 4;
    float mw = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mw = fmaxf(mw, all[w * kWarpFloats + kRows * D + h]);
    float lsum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float* base = all + w * kWarpFloats;
      const float sc = rescale(base[kRows * D + h], mw);
      lsum += base[kRows * D + kRows + h] * sc;
      const float4 ov = *reinterpret_cast<const float4*>(base + h * D + d);
      acc[0] += ov.x * sc;
      acc[1] += ov.y * sc;
      acc[2] += ov.z * sc;
      acc[3] += ov.w * sc;
    }
    const float inv = 1.f / lsum;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] *= inv;
    if (direct) {
      store_row4<T, D>(p, b, head0 + h, d, acc);
    } else if (clustered) {
      kept_o[k] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      kept_ml[k] = make_float2(mw, lsum);
    } else {
      const int64_t row = (static_cast<int64_t>(b) * p.num_q_heads + head0 + h) * p.s_cap + split;
      *reinterpret_cast<float4*>(p.o_part + row * D + d) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      if (d == 0) *reinterpret_cast<float2*>(p.ml_part + row * 2) = make_float2(mw, lsum);
    }
  }
  if (clustered) {
    cluster_merge<T, D, NW>(p, b, head0, n_rows, split, n_act, kept_o, kept_ml, smem_raw);
    return;
  }
  if (!direct && p.counters != nullptr) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = count_split(p, b, blockIdx.y, n_act);
    __syncthreads();
    if (last) {
      __threadfence();
      for (int r = warp; r < n_rows; r += NW) combine_head<T, D>(p, b, head0 + r, n_act, lane);
    }
  }
}

// Head-major layout: one block per (split, group of NW kv-head units, request); each warp
// owns one (kv head, head chunk) and streams the whole split, so a block reads NW adjacent
// head slices of the same token rows at about the same time (DRAM row locality) and no
// cross-warp merge is needed.
template <typename T, typename KV, int D, int NW, int TT, int ST>
__global__ void __launch_bounds__(NW * 32) decode_head_kernel(const DecodeParams p) {
  using C = Cfg<KV, D, NW, TT, ST>;
  constexpr bool kFp8 = kIsFp8<KV>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head_chunks = (group + kRows - 1) / kRows;
  const int unit = blockIdx.y * NW + warp;
  if (unit >= p.num_kv_heads * head_chunks) return;
  const int kvh = unit / head_chunks, hc = unit % head_chunks;
  const int b = blockIdx.z, split = blockIdx.x;
  const int n_rows = min(kRows, group - hc * kRows);
  const int head0 = kvh * group + hc * kRows;

  const int len = p.kv.seq_lens[b];
  int start, end;
  split_range<TT, C::kMinChunk>(len, p.num_splits, split, start, end);
  if (start >= end) {  // an empty sequence's output is zeros, written by its first split
    grid_dependency_wait();
    if (p.num_splits == 1 || (p.counters != nullptr && split == 0))
      write_zeros<T, D>(p, b, head0, n_rows, lane, 32);
    return;
  }
  const int n_act = active_splits(len, p.num_splits, TT, C::kMinChunk);
  const bool direct = n_act == 1;  // as in the token-split kernel
  uint32_t qa[D / 16][4];
  WarpState<D> st;
  st.init();
  KV* wsm = reinterpret_cast<KV*>(smem_raw) + warp * ST * Tile<KV, D, TT>::kStageElems;
  stream_tiles<T, KV, D, TT, ST>(st, qa, wsm, p, b, kvh, start, TT, (end - start + TT - 1) / TT,
                                 end, len - 1, lane, [&] {
                                   grid_dependency_wait();
                                   load_q<T, D, kFp8>(qa, p, b, head0, n_rows, lane);
                                 });

  const int r0 = lane >> 2, c0 = o_col0<kFp8>(lane);
  const float lsum[2] = {quad_sum(st.l[0]), quad_sum(st.l[1])};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + h * 8;
    if (row >= n_rows) continue;
    const float inv = 1.f / lsum[h];
    if (direct) {
      T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + (head0 + row) * p.out_stride_h + c0;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        int off;
        const float2 v = o_pair<kFp8, D>(st, dn, h, off);
        *reinterpret_cast<uint32_t*>(dst + off) = Dtype<T>::pack(v.x * inv, v.y * inv);
      }
    } else {
      const int64_t prow = (static_cast<int64_t>(b) * p.num_q_heads + head0 + row) * p.s_cap + split;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        int off;
        const float2 v = o_pair<kFp8, D>(st, dn, h, off);
        *reinterpret_cast<float2*>(p.o_part + prow * D + off + c0) = make_float2(v.x * inv, v.y * inv);
      }
      if ((lane & 3) == 0) *reinterpret_cast<float2*>(p.ml_part + prow * 2) = make_float2(st.m[h], lsum[h]);
    }
  }
  if (!direct && p.counters != nullptr) {  // per warp: each owns its unit
    __threadfence();
    __syncwarp();
    const bool last = __shfl_sync(0xffffffffu, lane == 0 && count_split(p, b, unit, n_act), 0);
    if (last) {
      __threadfence();
      for (int r = 0; r < n_rows; ++r) combine_head<T, D>(p, b, head0 + r, n_act, lane);
    }
  }
}

// One warp per (request, q head): merges the active splits' normalized partials.
template <typename T, int D>
__global__ void __launch_bounds__(128) decode_combine_kernel(const DecodeParams p, int tile,
                                                             int min_chunk) {
  grid_dependency_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int idx = blockIdx.x * 4 + warp;
  if (idx >= p.batch * p.num_q_heads) return;
  const int b = idx / p.num_q_heads, qh = idx % p.num_q_heads;
  const int len = p.kv.seq_lens[b];
  const int n_act = active_splits(len, p.num_splits, tile, min_chunk);
  if (n_act != 1) combine_head<T, D>(p, b, qh, n_act, lane);  // one split wrote out itself
}

// Splits one cluster may hold (16: Hopper's non-portable cluster size), and whether the
// token-split layout merges through clusters (KVRAY_DECODE_CLUSTER=0: the counters' merge,
// for measuring).
constexpr int kMaxClusterSplits = 16;
bool clusters_enabled() {
  static const bool enabled = hopper_feature_on("KVRAY_DECODE_CLUSTER");
  return enabled;
}

// Static facts of one kernel instantiation: shared memory, threads, resident blocks/SM,
// and how many (kv head, head chunk) units one block covers.
struct KernelInfo {
  int smem, threads, tile, min_chunk, blocks_per_sm, units_per_block;
};

enum class Layout { kSplit, kHead };

template <Layout L, typename T, typename KV, int D, int NW, int TT, int ST>
constexpr auto kernel_fn() {
  if constexpr (L == Layout::kSplit) {
    return decode_split_kernel<T, KV, D, NW, TT, ST>;
  } else {
    return decode_head_kernel<T, KV, D, NW, TT, ST>;
  }
}

template <Layout L, typename T, typename KV, int D, int NW, int TT, int ST>
const KernelInfo& info() {
  static const KernelInfo ki = [] {
    using C = Cfg<KV, D, NW, TT, ST>;
    constexpr int smem = L == Layout::kSplit ? C::kSmem : C::kStageBytes;
    auto kern = kernel_fn<L, T, KV, D, NW, TT, ST>();
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (L == Layout::kSplit && clusters_enabled())  // an error here would surface at launch
      cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    int blocks = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kern, NW * 32, smem);
    return KernelInfo{smem, NW * 32, TT, C::kMinChunk, blocks > 0 ? blocks : 1,
                      L == Layout::kSplit ? 1 : NW};
  }();
  return ki;
}

template <Layout L, typename T, typename KV, int D, int NW, int TT, int ST>
cudaError_t run(const DecodeParams& p, cudaStream_t stream) {
  const KernelInfo& ki = info<L, T, KV, D, NW, TT, ST>();
  const int group = p.num_q_heads / p.num_kv_heads;
  const int units = p.num_kv_heads * ((group + kRows - 1) / kRows);
  dim3 grid(p.num_splits, (units + ki.units_per_block - 1) / ki.units_per_block, p.batch);
  if (L == Layout::kSplit && p.counters != nullptr && p.num_splits > 1 &&
      p.num_splits <= kMaxClusterSplits && clusters_enabled()) {
    DecodeParams q = p;
    q.cluster = true;
    launch_clustered(kernel_fn<L, T, KV, D, NW, TT, ST>(), grid, ki.threads, ki.smem, stream,
                     static_cast<unsigned>(p.num_splits), q);
    return cudaGetLastError();
  }
  launch(kernel_fn<L, T, KV, D, NW, TT, ST>(), grid, ki.threads, ki.smem, stream, p);
  if (p.num_splits > 1 && p.counters == nullptr) {
    const int pairs = p.batch * p.num_q_heads;
    launch(decode_combine_kernel<T, D>, (pairs + 3) / 4, 128, 0, stream, p, ki.tile, ki.min_chunk);
  }
  return cudaGetLastError();
}

// Tiling variants. 0 = automatic: head-major (5) once the batch gives every SM a block
// without splitting, token-split (1) below that, where head-major leaves SMs idle. 1 and 5 are compiled for every
// dtype, head_dim and cache type; the others for bf16 / head_dim 128 only, for the benchmark's sweep.
//   1: token-split, 4 warps, 16-token tiles, 3 stages   2: token-split, 4 warps, 2 stages
//   3: token-split, 8 warps, 2 stages                   4: head-major, 4 warps, 3 stages
//   5: head-major, 4 warps, 2 stages                    6: head-major, 8 warps, 2 stages
constexpr int kNumVariants = 7;
constexpr int kAutoSplit = 1, kAutoHead = 5, kHeadUnitsPerBlock = 4;

#define KVRAY_SWEEP_VARIANTS(X) \
  X(2, Layout::kSplit, 4, 16, 2) \
  X(3, Layout::kSplit, 8, 16, 2) \
  X(4, Layout::kHead, 4, 16, 3)  \
  X(6, Layout::kHead, 8, 16, 2)

template <typename T, typename KV, int D>
constexpr bool kSweepCompiled = D == 128 && std::is_same_v<T, __nv_bfloat16> && std::is_same_v<KV, T>;

template <typename T, typename KV, int D>
const KernelInfo* variant_info(int variant) {
  if (variant == kAutoSplit) return &info<Layout::kSplit, T, KV, D, 4, 16, 3>();
  if (variant == kAutoHead) return &info<Layout::kHead, T, KV, D, kHeadUnitsPerBlock, 16, 2>();
  if constexpr (kSweepCompiled<T, KV, D>) {
#define KVRAY_INFO(V, L, NW, TT, ST) \
  if (variant == V) return &info<L, T, KV, D, NW, TT, ST>();
    KVRAY_SWEEP_VARIANTS(KVRAY_INFO)
#undef KVRAY_INFO
  }
  return nullptr;
}

template <typename T, typename KV, int D>
cudaError_t dispatch_variant(const DecodeParams& p, cudaStream_t stream) {
  if (p.variant == kAutoSplit) return run<Layout::kSplit, T, KV, D, 4, 16, 3>(p, stream);
  if (p.variant == kAutoHead) return run<Layout::kHead, T, KV, D, kHeadUnitsPerBlock, 16, 2>(p, stream);
  if constexpr (kSweepCompiled<T, KV, D>) {
#define KVRAY_RUN(V, L, NW, TT, ST) \
  if (p.variant == V) return run<L, T, KV, D, NW, TT, ST>(p, stream);
    KVRAY_SWEEP_VARIANTS(KVRAY_RUN)
#undef KVRAY_RUN
  }
  return cudaErrorInvalidValue;
}

// An FP8 cache is read with bf16 activations only (worker/config.py checks it).
const KernelInfo* find_info(DType dtype, bool kv_fp8, int head_dim, int variant) {
  if (kv_fp8) {
    if (dtype != DType::kBF16) return nullptr;
    if (head_dim == 128) return variant_info<__nv_bfloat16, __nv_fp8_e4m3, 128>(variant);
    if (head_dim == 64) return variant_info<__nv_bfloat16, __nv_fp8_e4m3, 64>(variant);
  } else if (dtype == DType::kBF16) {
    if (head_dim == 128) return variant_info<__nv_bfloat16, __nv_bfloat16, 128>(variant);
    if (head_dim == 64) return variant_info<__nv_bfloat16, __nv_bfloat16, 64>(variant);
  } else {
    if (head_dim == 128) return variant_info<__half, __half, 128>(variant);
    if (head_dim == 64) return variant_info<__half, __half, 64>(variant);
  }
  return nullptr;
}

// KVRAY_DECODE_LAYOUT=split or head: every automatic launch in that layout, for measuring
// decode_resolve_variant's rule against either on a GPU (0 when unset or anything else).
int forced_layout() {
  static const int forced = [] {
    const char* value = std::getenv("KVRAY_DECODE_LAYOUT");
    if (value == nullptr) return 0;
    if (std::string(value) == "split") return kAutoSplit;
    return std::string(value) == "head" ? kAutoHead : 0;
  }();
  return forced;
}

}  // namespace

int decode_num_variants() { return kNumVariants; }

int decode_resolve_variant(int variant, int batch, int num_q_heads, int num_kv_heads,
                           int num_sms) {
  if (variant != 0 || num_kv_heads <= 0) return variant;
  if (forced_layout() != 0) return forced_layout();
  const int group = num_q_heads / num_kv_heads;
  const int units = num_kv_heads * ((group + kRows - 1) / kRows);
  const int head_blocks = batch * ((units + kHeadUnitsPerBlock - 1) / kHeadUnitsPerBlock);
  return head_blocks >= num_sms ? kAutoHead : kAutoSplit;
}

int decode_blocks_per_sm(DType dtype, bool kv_fp8, int head_dim, int variant) {
  const KernelInfo* ki = find_info(dtype, kv_fp8, head_dim, variant);
  return ki == nullptr ? 0 : ki->blocks_per_sm;
}

int decode_num_splits(int batch, int num_q_heads, int num_kv_heads, int head_dim, DType dtype,
                      bool kv_fp8, int variant, int num_sms, int s_cap) {
  const KernelInfo* ki = find_info(dtype, kv_fp8, head_dim, variant);
  if (ki == nullptr || batch <= 0 || num_kv_heads <= 0) return 1;
  const int group = num_q_heads / num_kv_heads;
  const int units = num_kv_heads * ((group + kRows - 1) / kRows);
  const int per_split = batch * ((units + ki->units_per_block - 1) / ki->units_per_block);
  // One wave of resident blocks: more splits only add partials and a deeper combine.
  const int resident = num_sms * ki->blocks_per_sm;
  return std::max(1, std::min(s_cap, resident / per_split));
}

cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.kv_fp8) {
    if (p.dtype != DType::kBF16) return cudaErrorInvalidValue;
    if (p.head_dim == 128) return dispatch_variant<__nv_bfloat16, __nv_fp8_e4m3, 128>(p, stream);
    if (p.head_dim == 64) return dispatch_variant<__nv_bfloat16, __nv_fp8_e4m3, 64>(p, stream);
  } else if (p.dtype == DType::kBF16) {
    if (p.head_dim == 128) return dispatch_variant<__nv_bfloat16, __nv_bfloat16, 128>(p, stream);
    if (p.head_dim == 64) return dispatch_variant<__nv_bfloat16, __nv_bfloat16, 64>(p, stream);
  } else {
    if (p.head_dim == 128) return dispatch_variant<__half, __half, 128>(p, stream);
    if (p.head_dim == 64) return dispatch_variant<__half, __half, 64>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvray
