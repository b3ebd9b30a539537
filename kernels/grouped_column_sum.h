#pragma once
// Per-group column sums with the split sizes on the device: the bias gradient of a grouped linear
// layer, db_g[n] = Σ over the rows of group g of dy (fp32 sums, one rounding). Groups are clamped
// to the buffer as in the sm90 grouped GEMM (grouped_gemm_sm90.h); an empty group gets zeros.
// Deterministic: one thread block per (group, column chunk) walks the rows in a fixed order.
//
// Kernel layer: raw pointers, sizes and a stream. Validation: ops/grouped_gemm_sm90.cpp.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

struct GroupedColumnSumParams {
  ScalarType type = ScalarType::kBFloat16;  // dy and the sums
  int num_groups = 0;
  int64_t rows = 0;
  int64_t n = 0;  // even
  const void* m_splits = nullptr;
  bool splits_int32 = false;
  const void* grad_output = nullptr;  // [rows, n]
  GroupAddress bias_grad;             // db_g [n]
};

void launch_grouped_column_sum(const GroupedColumnSumParams& params, cudaStream_t stream);

}  // namespace torchmoe::kernels
