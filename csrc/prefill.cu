// Paged ragged causal prefill attention (FlashAttention-2 style on m16n8k16 MMAs).
//
// Query token i of sequence b sits at position seq_lens[b] - q_len_b + i and sees keys
// 0..that position, so the same kernel serves whole prompts, prompts behind a prefix-cache
// hit, and prefill chunks (kv_len >= q_len). One block per (query tile, q head); each of
// its NW warps owns MT 16-row MMA tiles of the query tile. K/V tiles of 64 tokens are
// gathered page by page from the paged cache through a two-stage cp.async ring shared by
// the block.
//
// Tilings (variants): 1 = 64-query tiles, 4 warps of 16 rows, Q fragments in registers;
// 2 = 128-query tiles, 4 warps of 32 rows (each K/V fragment read from shared memory feeds
// two MMAs); 3 = 128-query tiles, 8 warps of 16 rows. K/V tiles hold 64 keys. 0 picks one
// from the batch's shape (prefill_resolve_variant).
//
// The grid is (q heads, ceil(T / BM) + B tiles), an upper bound on the tiles of any split
// of T tokens into B sequences, so it depends on shapes only; each block finds its
// (sequence, tile) from qo_indptr and surplus blocks exit. Blocks take tiles from the last
// one backwards: a sequence's last tiles see the most keys, and starting the heaviest
// first shortens the tail of the launch.
#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

constexpr int kBN = 64, kST = 2;  // keys per K/V tile, K/V tiles in flight

// Maps a linear tile index to (sequence, tile within it) by a warp-wide prefix sum of
// ceil(q_len / BM) over qo_indptr. Returns false when the index is past the last tile.
template <int BM>
__device__ bool find_tile(const int32_t* qo_indptr, int batch, int x, int lane, int& seq,
                          int& tile) {
  int base = 0;
  for (int b0 = 0; b0 < batch; b0 += 32) {
    const int b = b0 + lane;
    const int t = b < batch ? (qo_indptr[b + 1] - qo_indptr[b] + BM - 1) / BM : 0;
    int incl = t;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += n;
    }
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    if (x < base + total) {
      const unsigned hit = __ballot_sync(0xffffffffu, base + incl > x);
      const int src = __ffs(hit) - 1;
      const int before = __shfl_sync(0xffffffffu, incl - t, src);
      seq = b0 + src;
      tile = x - base - before;
      return true;
    }
    base += total;
  }
  return false;
}

template <int D, int MT, int NW>
struct Tiling {
  static constexpr int kBM = 16 * MT * NW;  // query rows per block
  static constexpr int kThreads = NW * 32;
  static constexpr int kSmem = (kBM + kST * 2 * kBN) * D * 2;
};

template <typename T, int D, int MT, int NW>
__global__ void __launch_bounds__(NW * 32) prefill_kernel(const PrefillParams p) {
  grid_dependency_wait();
  using Tl = Tiling<D, MT, NW>;
  constexpr int kBM = Tl::kBM, kThreads = Tl::kThreads;
  constexpr int kChunks = D / 8;
  constexpr int kTile = kBN * D;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* kvs = qs + kBM * D;  // [kST][K | V][kBN][D]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int qh = blockIdx.x;
  const int kvh = qh / (p.num_q_heads / p.num_kv_heads);

  int b, qt;
  if (!find_tile<kBM>(p.qo_indptr, p.batch, gridDim.y - 1 - blockIdx.y, lane, b, qt)) return;
  const int q0 = p.qo_indptr[b], q_len = p.qo_indptr[b + 1] - q0;
  const int kv_len = p.kv.seq_lens[b];
  const int offset = kv_len - q_len;  // position of query 0
  const int row0 = qt * kBM;
  const int rows = min(kBM, q_len - row0);
  const int kv_end = min(kv_len, offset + row0 + rows);  // keys the tile's last query sees
  const int n_kv_tiles = (kv_end + kBN - 1) / kBN;
  const int32_t* rt_row =
      p.kv.req_to_token + static_cast<int64_t>(p.kv.req_pool_indices[b]) * p.kv.rt_stride;
  const T* kbase = static_cast<const T*>(p.kv.k) + kvh * D;
  const T* vbase = static_cast<const T*>(p.kv.v) + kvh * D;
  const T* qbase = static_cast<const T*>(p.q) + qh * p.q_stride_h;

  for (int i = tid; i < kBM * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = r < rows;
    const T* src = qbase + static_cast<int64_t>(q0 + row0 + (valid ? r : 0)) * p.q_stride_t + c * 8;
    cp_async16(qs + swz<D>(r, c), src, valid);
  }
  cp_async_commit();

  auto issue = [&](int j) {
    T* ks = kvs + (j % kST) * 2 * kTile;
    T* vs = ks + kTile;
    for (int i = tid; i < kBN * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int pos = j * kBN + r;
      const bool valid = pos < kv_end;
      const int64_t off = valid ? slot_of(rt_row, pos, p.kv.page_size) * p.kv.slot_stride + c * 8 : 0;
      cp_async16(ks + swz<D>(r, c), kbase + off, valid);
      cp_async16(vs + swz<D>(r, c), vbase + off, valid);
    }
  };
  issue(0);
  cp_async_commit();

  // ldmatrix element offsets of this lane within a 16-row group of a swizzled tile, at
  // chunk pair 0; chunk pair kk is `off ^ (kk << 4)` (swz_step), 16 rows on is `+ 16 * D`.
  const int q_off = swz<D>(lane & 15, lane >> 4);                          // Q: A operand
  const int k_off = swz<D>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);  // K: B operand
  const int v_off = swz<D>((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);  // V: B, transposed
  const uint32_t qs_addr = smem_addr(qs) + 2 * (warp * 16 * MT * D);

  const int r0 = lane >> 2, c0 = (lane & 3) * 2;
  const int wrow0 = row0 + warp * 16 * MT;  // first query row of this warp in the sequence
  const bool warp_active = wrow0 < q_len;
  const int wpos_min = offset + wrow0;
  const int wpos_max = offset + min(wrow0 + 16 * MT - 1, q_len - 1);

  // With one row tile per warp, its Q fragments stay in registers (loaded at j == 0).
  uint32_t qreg[MT == 1 ? D / 16 : 1][4];
  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;

  for (int j = 0; j < n_kv_tiles; ++j) {
    if (j + 1 < n_kv_tiles) issue(j + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if constexpr (MT == 1) {
      if (j == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qreg[kk], qs_addr + 2 * swz_step(q_off, kk));
      }
    }
    const int kv0 = j * kBN;
    if (warp_active && kv0 <= wpos_max) {
      const uint32_t ks_addr = smem_addr(kvs + (j % kST) * 2 * kTile);
      const uint32_t vs_addr = ks_addr + 2 * kTile;
      float s[MT][kBN / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (MT == 1) {
            qa[mt][0] = qreg[kk][0], qa[mt][1] = qreg[kk][1], qa[mt][2] = qreg[kk][2], qa[mt][3] = qreg[kk][3];
          } else {
            ldsm_x4(qa[mt], qs_addr + 2 * (swz_step(q_off, kk) + mt * 16 * D));
          }
        }
        const int kk_off = swz_step(k_off, kk);
#pragma unroll
        for (int np = 0; np < kBN / 16; ++np) {
          uint32_t bk[4];
          ldsm_x4(bk, ks_addr + 2 * (kk_off + np * 16 * D));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Dtype<T>::mma(s[mt][2 * np], qa[mt], bk[0], bk[1]);
            Dtype<T>::mma(s[mt][2 * np + 1], qa[mt], bk[2], bk[3]);
          }
        }
      }
      const bool need_mask = kv0 + kBN - 1 > wpos_min || kv0 + kBN > kv_end;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = kv0 + nt * 8 + c0 + (e & 1);
            const int qpos = wpos_min + mt * 16 + r0 + (e >> 1) * 8;
            const bool valid = !need_mask || (key <= qpos && key < kv_end);
            s[mt][nt][e] = valid ? s[mt][nt][e] * p.scale_log2 : -INFINITY;
            mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][nt][e]);
          }
        }
        // Every row saw key 0 in tile 0, so m is finite from then on and a fully masked
        // row of a later tile gets exp2(-inf - m) = 0.
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_new = fmaxf(m[mt][h], quad_max(mx[h]));
          corr[h] = rescale(m[mt][h], m_new);
          m[mt][h] = m_new;
          l[mt][h] *= corr[h];
        }
#pragma unroll
        for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[mt][nt][e] = fast_exp2(s[mt][nt][e] - m[mt][e >> 1]);
            l[mt][e >> 1] += s[mt][nt][e];
          }
        }
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          o[mt][dn][0] *= corr[0];
          o[mt][dn][1] *= corr[0];
          o[mt][dn][2] *= corr[1];
          o[mt][dn][3] *= corr[1];
        }
      }
#pragma unroll
      for (int ks16 = 0; ks16 < kBN / 16; ++ks16) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = Dtype<T>::pack(s[mt][2 * ks16][0], s[mt][2 * ks16][1]);
          pa[mt][1] = Dtype<T>::pack(s[mt][2 * ks16][2], s[mt][2 * ks16][3]);
          pa[mt][2] = Dtype<T>::pack(s[mt][2 * ks16 + 1][0], s[mt][2 * ks16 + 1][1]);
          pa[mt][3] = Dtype<T>::pack(s[mt][2 * ks16 + 1][2], s[mt][2 * ks16 + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t bv[4];
          ldsm_x4_trans(bv, vs_addr + 2 * (swz_step(v_off, dp) + ks16 * 16 * D));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Dtype<T>::mma(o[mt][2 * dp], pa[mt], bv[0], bv[1]);
            Dtype<T>::mma(o[mt][2 * dp + 1], pa[mt], bv[2], bv[3]);
          }
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  if (!warp_active) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float inv[2] = {1.f / quad_sum(l[mt][0]), 1.f / quad_sum(l[mt][1])};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = wrow0 + mt * 16 + r0 + h * 8;
      if (row >= q_len) continue;
      T* dst = static_cast<T*>(p.out) + static_cast<int64_t>(q0 + row) * p.out_stride_t +
               qh * p.out_stride_h + c0;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        *reinterpret_cast<uint32_t*>(dst + dn * 8) =
            Dtype<T>::pack(o[mt][dn][2 * h] * inv[h], o[mt][dn][2 * h + 1] * inv[h]);
      }
    }
  }
}

struct PrefillInfo {
  int smem, threads, tile_m, blocks_per_sm, num_regs, local_bytes;
};

template <typename T, int D, int MT, int NW>
const PrefillInfo& info() {
  static const PrefillInfo pi = [] {
    using Tl = Tiling<D, MT, NW>;
    auto kern = prefill_kernel<T, D, MT, NW>;
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, Tl::kSmem);
    int blocks = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kern, Tl::kThreads, Tl::kSmem);
    cudaFuncAttributes attr{};
    cudaFuncGetAttributes(&attr, kern);
    return PrefillInfo{Tl::kSmem, Tl::kThreads, Tl::kBM, blocks,
                       attr.numRegs, static_cast<int>(attr.localSizeBytes)};
  }();
  return pi;
}

template <typename T, int D, int MT, int NW>
cudaError_t run(const PrefillParams& p, cudaStream_t stream) {
  const PrefillInfo& pi = info<T, D, MT, NW>();
  dim3 grid(p.num_q_heads, (p.num_tokens + pi.tile_m - 1) / pi.tile_m + p.batch);
  launch(prefill_kernel<T, D, MT, NW>, grid, pi.threads, pi.smem, stream, p);
  return cudaGetLastError();
}

constexpr int kNumVariants = 4;  // 0 (automatic) and the tilings 1..3

template <typename T, int D>
cudaError_t dispatch(const PrefillParams& p, cudaStream_t stream) {
  switch (p.variant) {
    case 1: return run<T, D, 1, 4>(p, stream);
    case 2: return run<T, D, 2, 4>(p, stream);
    case 3: return run<T, D, 1, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int D>
const PrefillInfo* variant_info(int variant) {
  switch (variant) {
    case 1: return &info<T, D, 1, 4>();
    case 2: return &info<T, D, 2, 4>();
    case 3: return &info<T, D, 1, 8>();
    default: return nullptr;
  }
}

}  // namespace

int prefill_num_variants() { return kNumVariants; }

// 32-row warps (2) once the 128-query tiles fill the GPU one and a half times over, since
// below that their fewer, heavier blocks leave SMs idle at the end; 3, which shares each K/V
// tile among 8 warps, while sequences average 64 queries or more; shorter ones (prompt
// chunks next to decodes) keep 64-query tiles.
int prefill_resolve_variant(int variant, int batch, int num_tokens, int num_q_heads, int num_sms,
                            int blocks_per_sm_2) {
  if (variant != 0) return variant;
  if (num_tokens < 64 * batch) return 1;
  const int64_t tiles = static_cast<int64_t>((num_tokens + 127) / 128) * num_q_heads;
  if (num_tokens >= 128 * batch && 2 * tiles >= 3 * static_cast<int64_t>(num_sms) * blocks_per_sm_2)
    return 2;
  return 3;
}

bool prefill_kernel_info(DType dtype, int head_dim, int variant, int out[4]) {
  const PrefillInfo* pi = nullptr;
  const bool bf16 = dtype == DType::kBF16;
  if (head_dim == 128) pi = bf16 ? variant_info<__nv_bfloat16, 128>(variant) : variant_info<__half, 128>(variant);
  if (head_dim == 64) pi = bf16 ? variant_info<__nv_bfloat16, 64>(variant) : variant_info<__half, 64>(variant);
  if (pi == nullptr) return false;
  out[0] = pi->tile_m, out[1] = pi->blocks_per_sm, out[2] = pi->num_regs, out[3] = pi->local_bytes;
  return true;
}

cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_tokens == 0) return cudaSuccess;
  if (p.dtype == DType::kBF16) {
    if (p.head_dim == 128) return dispatch<__nv_bfloat16, 128>(p, stream);
    if (p.head_dim == 64) return dispatch<__nv_bfloat16, 64>(p, stream);
  } else {
    if (p.head_dim == 128) return dispatch<__half, 128>(p, stream);
    if (p.head_dim == 64) return dispatch<__half, 64>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvray
