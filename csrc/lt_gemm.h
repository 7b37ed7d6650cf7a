// cuBLASLt GEMMs with a chosen algorithm (lt_gemm.cpp); bound in ops.cpp.
#pragma once

#include <torch/extension.h>

#include <optional>

namespace kvray {

// How many algorithms cuBLASLt's heuristic offers for out = x @ w.T (+ bias) at these
// shapes, strides and alignments, at most max_algos; 0 where it offers none.
int64_t lt_gemm_algos(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      const at::Tensor& out, const at::Tensor& workspace, int64_t max_algos);

// out = x @ w.T (+ bias) with the heuristic's algorithm number `algo` (0: its first choice),
// on the current stream; workspace: a byte tensor the algorithm may use.
void lt_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
             const at::Tensor& out, const at::Tensor& workspace, int64_t algo);

}  // namespace kvray
