// Paged ragged causal prefill attention (FlashAttention-2 style on m16n8k16 MMAs).
//
// Query token i of sequence b sits at position seq_lens[b] - q_len_b + i and sees keys
// 0..that position, so the same kernel serves whole prompts, prompts behind a prefix-cache
// hit, and prefill chunks (kv_len >= q_len). One block per (64-query tile, q head), four
// warps of 16 query rows each; K/V tiles of 64 tokens are gathered page by page from the
// paged cache through a two-stage cp.async ring shared by the block.
//
// The grid is ceil(T / 64) + B tiles wide (an upper bound on the tiles of any split of T
// tokens into B sequences), so it depends on shapes only; each block finds its
// (sequence, tile) from qo_indptr and surplus blocks exit.
#include "common.cuh"
#include "launch.h"

namespace kvray {
namespace {

constexpr int kBM = 64, kBN = 64, kNW = 4, kST = 2;

// Maps a linear tile index to (sequence, tile within it) by a warp-wide prefix sum of
// ceil(q_len / kBM) over qo_indptr. Returns false when the index is past the last tile.
__device__ bool find_tile(const int32_t* qo_indptr, int batch, int x, int lane, int& seq,
                          int& tile) {
  int base = 0;
  for (int b0 = 0; b0 < batch; b0 += 32) {
    const int b = b0 + lane;
    const int t = b < batch ? (qo_indptr[b + 1] - qo_indptr[b] + kBM - 1) / kBM : 0;
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

template <typename T, int D>
__global__ void __launch_bounds__(kNW * 32) prefill_kernel(const PrefillParams p) {
  constexpr int kChunks = D / 8;
  constexpr int kTile = kBN * D;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);
  T* kvs = qs + kBM * D;  // [kST][K | V][kBN][D]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int qh = blockIdx.y;
  const int kvh = qh / (p.num_q_heads / p.num_kv_heads);

  int b, qt;
  if (!find_tile(p.qo_indptr, p.batch, blockIdx.x, lane, b, qt)) return;
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

  for (int i = tid; i < kBM * kChunks; i += kNW * 32) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = r < rows;
    const T* src = qbase + static_cast<int64_t>(q0 + row0 + (valid ? r : 0)) * p.q_stride_t + c * 8;
    cp_async16(qs + swz<D>(r, c), src, valid);
  }
  cp_async_commit();

  auto issue = [&](int j) {
    T* ks = kvs + (j % kST) * 2 * kTile;
    T* vs = ks + kTile;
    for (int i = tid; i < kBN * kChunks; i += kNW * 32) {
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

  const int r0 = lane >> 2, c0 = (lane & 3) * 2;
  const int wrow0 = row0 + warp * 16;  // first query row of this warp in the sequence
  const bool warp_active = wrow0 < q_len;
  const int wpos_min = offset + wrow0;
  const int wpos_max = offset + min(wrow0 + 15, q_len - 1);

  uint32_t qa[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int j = 0; j < n_kv_tiles; ++j) {
    if (j + 1 < n_kv_tiles) issue(j + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldsm_x4(qa[kk], qs + swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    }
    const int kv0 = j * kBN;
    if (warp_active && kv0 <= wpos_max) {
      const T* ks = kvs + (j % kST) * 2 * kTile;
      const T* vs = ks + kTile;
      float s[kBN / 8][4];
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < kBN / 16; ++np) {
          uint32_t bk[4];
          ldsm_x4(bk, ks + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                  kk * 2 + ((lane >> 3) & 1)));
          Dtype<T>::mma(s[2 * np], qa[kk], bk[0], bk[1]);
          Dtype<T>::mma(s[2 * np + 1], qa[kk], bk[2], bk[3]);
        }
      }
      const bool need_mask = kv0 + kBN - 1 > wpos_min || kv0 + kBN > kv_end;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kv0 + nt * 8 + c0 + (e & 1);
          const int qpos = wpos_min + r0 + (e >> 1) * 8;
          const bool valid = !need_mask || (key <= qpos && key < kv_end);
          s[nt][e] = valid ? s[nt][e] * p.scale_log2 : -INFINITY;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
        }
      }
      float corr[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m[h], quad_max(mx[h]));
        corr[h] = rescale(m[h], m_new);
        m[h] = m_new;
        l[h] *= corr[h];
      }
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] = fast_exp2(s[nt][e] - m[e >> 1]);
          l[e >> 1] += s[nt][e];
        }
      }
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        o[dn][0] *= corr[0];
        o[dn][1] *= corr[0];
        o[dn][2] *= corr[1];
        o[dn][3] *= corr[1];
      }
#pragma unroll
      for (int ks16 = 0; ks16 < kBN / 16; ++ks16) {
        uint32_t pa[4];
        pa[0] = Dtype<T>::pack(s[2 * ks16][0], s[2 * ks16][1]);
        pa[1] = Dtype<T>::pack(s[2 * ks16][2], s[2 * ks16][3]);
        pa[2] = Dtype<T>::pack(s[2 * ks16 + 1][0], s[2 * ks16 + 1][1]);
        pa[3] = Dtype<T>::pack(s[2 * ks16 + 1][2], s[2 * ks16 + 1][3]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t bv[4];
          ldsm_x4_trans(bv, vs + swz<D>(ks16 * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                        dp * 2 + (lane >> 4)));
          Dtype<T>::mma(o[2 * dp], pa, bv[0], bv[1]);
          Dtype<T>::mma(o[2 * dp + 1], pa, bv[2], bv[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  if (!warp_active) return;
  const float inv[2] = {1.f / quad_sum(l[0]), 1.f / quad_sum(l[1])};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = wrow0 + r0 + h * 8;
    if (row >= q_len) continue;
    T* dst = static_cast<T*>(p.out) + static_cast<int64_t>(q0 + row) * p.out_stride_t +
             qh * p.out_stride_h + c0;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      *reinterpret_cast<uint32_t*>(dst + dn * 8) =
          Dtype<T>::pack(o[dn][2 * h] * inv[h], o[dn][2 * h + 1] * inv[h]);
    }
  }
}

template <typename T, int D>
cudaError_t run(const PrefillParams& p, cudaStream_t stream) {
  constexpr int smem = (kBM + kST * 2 * kBN) * D * 2;
  static const bool configured = [] {
    cudaFuncSetAttribute(prefill_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    return true;
  }();
  (void)configured;
  dim3 grid((p.num_tokens + kBM - 1) / kBM + p.batch, p.num_q_heads);
  prefill_kernel<T, D><<<grid, kNW * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_tokens == 0) return cudaSuccess;
  if (p.dtype == DType::kBF16) {
    if (p.head_dim == 128) return run<__nv_bfloat16, 128>(p, stream);
    if (p.head_dim == 64) return run<__nv_bfloat16, 64>(p, stream);
  } else {
    if (p.head_dim == 128) return run<__half, 128>(p, stream);
    if (p.head_dim == 64) return run<__half, 64>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvray
