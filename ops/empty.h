#pragma once
// The ops' uninitialised tensors: outputs, gradients and workspaces their kernels write.

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>

namespace torchmoe::ops {

// at::empty(sizes, options), contiguous, without the dispatcher on CUDA: at::detail::empty_cuda is
// the allocation at::empty's CUDA kernel makes (host time on an H100 host, in turns: 2.4 µs
// against 4.6; docs/performance.md), and an op allocates 2-8 tensors a call. It leaves out that
// kernel's NaN fill under deterministic algorithms, which nothing here needs: the ops write what
// they return. Host tensors (pinned or not) take at::empty.
at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace torchmoe::ops
