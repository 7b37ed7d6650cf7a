// Device helpers shared by the kvray attention kernels: dtype traits, the m16n8k16
// tensor-core MMA, ldmatrix, cp.async and the swizzled shared-memory tile layout.
// Plain CUDA only (no torch headers) so that the .cu files compile quickly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "launch.h"

namespace kvray {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarp = 32;

// Programmatic dependent launch (Hopper and later): `launch` lets a kernel's blocks be
// scheduled while the kernel before it in the stream finishes, hiding most of the launch
// gap between the many small kernels of a decode step. Every kernel it launches first
// waits, before touching memory, until the grid before it has completed and flushed, then
// lets the next one be scheduled, so the order of effects is the stream's as before.
// KVRAY_PDL=0 turns it off (launches as plain `<<<>>>` ones).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Device code using thread-block clusters compiles only for Hopper and later (KVRAY_CLUSTERS);
// the launchers form clusters only on such a device (hopper_feature_on), so before Hopper
// that code is never reached.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVRAY_CLUSTERS 1
#else
#define KVRAY_CLUSTERS 0
#endif

// A Hopper feature: on for compute capability 9 and later unless the variable `env` is 0.
inline bool hopper_feature_on(const char* env) {
  const char* value = std::getenv(env);
  if (value != nullptr && value[0] == '0') return false;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  return major >= 9;
}

inline bool pdl_enabled() {
  static const bool enabled = hopper_feature_on("KVRAY_PDL");
  return enabled;
}

// `launch` with the grid's blocks grouped into clusters of cluster_x consecutive blocks
// along x (Hopper thread-block clusters: co-scheduled, sharing their shared memory); 0: none.
template <typename... Params, typename... Args>
inline cudaError_t launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, unsigned cluster_x, const Args&... args) {
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = cluster_x;
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = cluster_x > 0 ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <typename... Params, typename... Args>
inline cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, const Args&... args) {
  return launch_clustered(kernel, grid, block, smem, stream, 0u, args...);
}

// Per-dtype operations: packing two floats into one 32-bit MMA operand, and the MMA.
template <typename T>
struct Dtype;

template <>
struct Dtype<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  }
  // c += a * b for one 16x8x16 tile: a is 16x16 row-major, b 16x8 column-major, c f32.
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Dtype<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t v) {
    return __half22float2(*reinterpret_cast<__half2*>(&v));
  }
  static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Scalar conversions to and from float32 (round to nearest), for the element-wise kernels.
template <typename T>
struct Num;

template <>
struct Num<float> {
  static __device__ __forceinline__ float to_f(float v) { return v; }
  static __device__ __forceinline__ float from_f(float v) { return v; }
};

template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Num<__half> {
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
};

// fp32 value of x after a round trip through T: the rounding torch applies after each op.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return Num<T>::to_f(Num<T>::from_f(x));
}

// The tensor-core decode GEMMs' dispatch (skinny.cu, tiled.cu): f(T{}, integral_constant<MT>)
// for x's dtype T (a value as its tag) and MT, its count of 16-row tiles (1-4); nothing to do
// for an empty x or w.
template <typename F>
cudaError_t dispatch_gemm(const GemvParams& p, F&& f) {
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  const auto by_tiles = [&](auto dtype) -> cudaError_t {
    switch ((p.m + 15) / 16) {
      case 1: return f(dtype, std::integral_constant<int, 1>{});
      case 2: return f(dtype, std::integral_constant<int, 2>{});
      case 3: return f(dtype, std::integral_constant<int, 3>{});
      case 4: return f(dtype, std::integral_constant<int, 4>{});
      default: return cudaErrorInvalidValue;
    }
  };
  if (p.dtype == DType::kBF16) return by_tiles(__nv_bfloat16{});
  if (p.dtype == DType::kFP16) return by_tiles(__half{});
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous global->shared copy; when !valid the destination is zero-filled
// (src-size 0) so masked rows never carry stale or NaN data into the MMAs.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(valid ? 16 : 0));
}

// 4-byte asynchronous copy (through L1: .cg takes 16 bytes only); zero-filled when !valid.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ldmatrix x4 from a shared-memory address (smem_addr) or a generic pointer into shared memory.
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void* smem) { ldsm_x4(r, smem_addr(smem)); }

__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const void* smem) {
  ldsm_x4_trans(r, smem_addr(smem));
}

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows][D] 16-bit tile whose
// chunks are XOR-swizzled by the row's low three bits: the eight rows one ldmatrix reads
// then sit in eight different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// swz<D>(row, 2 * kk + c) for c in {0, 1}, from off = swz<D>(row, c): the row's own bits
// (row * D, D >= 64) sit above the chunk field and XOR-ing chunk pairs commutes with the
// swizzle, so one offset per lane serves every chunk pair of every row with the same
// row & 7 (rows 16 apart: add 16 * D). Keeps ldmatrix addressing to one XOR per load.
__device__ __forceinline__ int swz_step(int off, int kk) { return off ^ (kk << 4); }

// Byte offset of 16-byte chunk `chunk` of row `row` in a [rows][D] tile of one-byte (e4m3)
// elements, swizzled so that the eight rows one ldmatrix reads sit in eight bank groups:
// 128-byte rows XOR the chunk with row & 7 (as swz), 64-byte rows (two per bank line) with
// (row >> 1) & 3.
template <int D>
__device__ __forceinline__ int swz_fp8(int row, int chunk) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  const int x = D == 128 ? (row & 7) : ((row >> 1) & 3);
  return row * D + ((chunk ^ x) << 4);
}

// Two e4m3 bytes of w as a bf16x2 operand whose values are the e4m3 values times 2^-120:
// `sel` (prmt) puts each byte in the low half of a 16-bit lane with its sign replicated
// above it; shifted left by 4 and masked, sign, exponent and mantissa land in bf16's
// fields with the exponent bias 7 kept (so zero and subnormals convert exactly too).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2_raw(uint32_t w, uint32_t sel) {
  uint32_t x;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(x) : "r"(w), "r"(0u), "r"(sel));
  return (x << 4) & 0x87F087F0u;
}

// Slot of position `pos` of a request whose page table row is `rt_row`: pages are
// contiguous in slot space, so only the entry at the page's first position is read.
__device__ __forceinline__ int64_t slot_of(const int32_t* rt_row, int pos, int page_size) {
  int page_start = (pos / page_size) * page_size;
  return static_cast<int64_t>(__ldg(rt_row + page_start)) + (pos - page_start);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Scale with -inf awareness: a state whose max is -inf carries no mass.
__device__ __forceinline__ float rescale(float m_old, float m_new) {
  return m_old == -INFINITY ? 0.f : fast_exp2(m_old - m_new);
}

}  // namespace kvray
