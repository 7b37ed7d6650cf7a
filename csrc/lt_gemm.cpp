// cuBLASLt for the GEMMs that cuBLAS runs in a decode step, with the algorithm picked by
// timing among the heuristic's candidates instead of its first guess: `kvray bench kernels
// --only gemm` shows cuBLAS's default slower at some batch sizes than at larger ones (8B down
// projection on an H100: 62.5 us at 192 rows, 57.0 at 256). Which candidate a shape runs is
// the engine's choice (worker/model/gemm_tuning.py). A shape's plan (descriptors and
// candidates) is built on its first call and kept for the process, like cuBLAS's handles.
#include "lt_gemm.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace kvray {
namespace {

constexpr int kMaxAlgos = 32;

// Messages are std::string built with std::to_string, as ops.cpp's KV_CHECK says why.
void lt_require(bool ok, const std::string& msg) { TORCH_CHECK(ok, ("kvray: lt_gemm: " + msg).c_str()); }

void lt_call(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    lt_require(false, std::string(what) + " failed: " + cublasLtGetStatusString(status));
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, out = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
};

// dtype, device, M, N, K, x's row stride, out's row stride, bias, the alignments of x, w and
// out (the heuristic only offers algorithms those pointers satisfy), workspace bytes
using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int, int, int, int64_t>;

std::mutex mutex;
std::map<Key, std::unique_ptr<Plan>> plans;
std::map<int, cublasLtHandle_t> handles;

uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

cublasLtHandle_t handle(int device) {
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  lt_call(cublasLtCreate(&h), "cublasLtCreate");
  handles[device] = h;
  return h;
}

void check(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
           const at::Tensor& out, const at::Tensor& workspace) {
  lt_require(x.is_cuda() && x.dim() == 2 && w.dim() == 2 && out.dim() == 2,
             "x [M, K], w [N, K] and out [M, N] must be 2-D CUDA tensors");
  lt_require(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
             "x must be bfloat16 or float16");
  lt_require(w.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
             "x, w and out must share a dtype");
  for (const at::Tensor* t : {&w, &out, &workspace})
    lt_require(t->is_cuda() && t->get_device() == x.get_device(), "every tensor must be on x's device");
  lt_require(w.is_contiguous() && w.size(1) == x.size(1), "w must be contiguous [N, K]");
  lt_require(x.stride(1) == 1 && out.stride(1) == 1, "x and out must have contiguous rows");
  lt_require(out.size(0) == x.size(0) && out.size(1) == w.size(0), "out must be [M, N]");
  lt_require(workspace.scalar_type() == at::kByte && workspace.is_contiguous(),
             "workspace must be a contiguous uint8 tensor");
  if (bias.has_value()) {
    lt_require(bias->is_cuda() && bias->get_device() == x.get_device() && bias->dim() == 1 &&
                   bias->size(0) == w.size(0) && bias->is_contiguous() &&
                   bias->scalar_type() == x.scalar_type(),
               "bias must be a contiguous [N] tensor of x's dtype on its device");
  }
}

// The plan of this call's shape, built (descriptors, then the heuristic's candidates) on first use.
Plan& plan_for(const at::Tensor& x, const at::Tensor& w, bool has_bias, const at::Tensor& out,
               const at::Tensor& workspace) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t ws_bytes = workspace.numel();
  const uint32_t ax = alignment(x.data_ptr()), aw = alignment(w.data_ptr()), ao = alignment(out.data_ptr());
  const Key key{bf16, x.get_device(), m, n, k, x.stride(0), out.stride(0), has_bias,
                static_cast<int>(ax), static_cast<int>(aw), static_cast<int>(ao), ws_bytes};
  auto it = plans.find(key);
  if (it != plans.end()) return *it->second;

  // Column-major terms: out^T [N, M] = w [N, K] (stored as K x N, transposed) @ x^T [K, M].
  auto p = std::make_unique<Plan>();
  const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_16F;
  lt_call(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  lt_call(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)),
          "setting TRANSA");
  lt_call(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)),
          "setting TRANSB");
  if (has_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    lt_call(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                           sizeof(epilogue)),
            "setting the bias epilogue");
  }
  lt_call(cublasLtMatrixLayoutCreate(&p->w, type, k, n, k), "cublasLtMatrixLayoutCreate(w)");
  lt_call(cublasLtMatrixLayoutCreate(&p->x, type, k, m, x.stride(0)), "cublasLtMatrixLayoutCreate(x)");
  lt_call(cublasLtMatrixLayoutCreate(&p->out, type, n, m, out.stride(0)), "cublasLtMatrixLayoutCreate(out)");

  cublasLtMatmulPreference_t pref = nullptr;
  lt_call(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t max_ws = static_cast<uint64_t>(ws_bytes);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof(aw));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof(ax));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ao, sizeof(ao));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ao, sizeof(ao));
  cublasLtMatmulHeuristicResult_t results[kMaxAlgos];
  int returned = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle(x.get_device()), p->desc, p->w, p->x, p->out, p->out,
                                     pref, kMaxAlgos, results, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < returned; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS) p->algos.push_back(results[i]);
  }
  Plan& ref = *p;
  plans.emplace(key, std::move(p));
  return ref;
}

}  // namespace

int64_t lt_gemm_algos(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      const at::Tensor& out, const at::Tensor& workspace, int64_t max_algos) {
  check(x, w, bias, out, workspace);
  const c10::cuda::CUDAGuard guard(x.device());
  const std::lock_guard<std::mutex> lock(mutex);
  const auto n = static_cast<int64_t>(plan_for(x, w, bias.has_value(), out, workspace).algos.size());
  return n < max_algos ? n : max_algos;
}

void lt_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
             const at::Tensor& out, const at::Tensor& workspace, int64_t algo) {
  check(x, w, bias, out, workspace);
  const c10::cuda::CUDAGuard guard(x.device());
  const std::lock_guard<std::mutex> lock(mutex);
  Plan& p = plan_for(x, w, bias.has_value(), out, workspace);
  lt_require(algo >= 0 && algo < static_cast<int64_t>(p.algos.size()),
             "algorithm " + std::to_string(algo) + " of " + std::to_string(p.algos.size()) +
                 " offered for this shape");
  if (bias.has_value()) {
    const void* b = bias->data_ptr();
    lt_call(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof(b)),
            "setting the bias");
  }
  const float alpha = 1.0f, beta = 0.0f;
  lt_call(cublasLtMatmul(handle(x.get_device()), p.desc, &alpha, w.data_ptr(), p.w, x.data_ptr(), p.x,
                         &beta, out.data_ptr(), p.out, out.data_ptr(), p.out, &p.algos[algo].algo,
                         workspace.data_ptr(), static_cast<size_t>(workspace.numel()),
                         c10::cuda::getCurrentCUDAStream()),
          "cublasLtMatmul");
}

}  // namespace kvray
