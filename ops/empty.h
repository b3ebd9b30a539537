#pragma once
// The ops' uninitialised tensors: outputs, gradients and workspaces their kernels write.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace torchmoe::ops {

// at::empty(sizes, options), contiguous, without the dispatcher on CUDA: at::detail::empty_cuda is
// the allocation at::empty's CUDA kernel makes (host time on an H100 host, in turns: 2.4 µs
// against 4.6; docs/performance.md), and an op allocates 2-8 tensors a call. It leaves out that
// kernel's NaN fill under deterministic algorithms, which nothing here needs: the ops write what
// they return. Host tensors (pinned or not) take at::empty.
at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

// One tensor of new_empty_packed: its sizes and dtype.
struct EmptySpec {
  at::IntArrayRef sizes;
  at::ScalarType dtype;
};

// The piece of one allocation that new_empty_packed gives each tensor starts on a multiple of this
// many bytes (cudaMalloc's alignment: vector loads and TMA need 16).
constexpr int64_t kPackedAlignment = 256;

// Small tensors that live and die together (an op's outputs and scratch) as contiguous tensors
// over one new_empty allocation, in the order of `specs`, each on its own kPackedAlignment-aligned
// piece: one caching-allocator call instead of one per tensor (the routing map's six: its host
// time 24-30 -> 15-18 us on an H100 host). Each is a tensor of its own (its own version counter,
// no view tracking), made without the dispatcher (alias_storage). The memory is freed when the
// last of them is, so large tensors or ones that outlive the others take new_empty.
std::vector<at::Tensor> new_empty_packed(std::initializer_list<EmptySpec> specs, at::Device device);

// A tensor of `dtype`, `sizes` and `strides` over `base`'s storage from element `offset` (in
// dtype's elements), with base's dispatch keys and a version counter of its own: a plain alias
// made without the dispatcher or its view tracking (LibTorch's select and as_strided cost
// microseconds of host time each). It must lie inside the storage (an internal assert); the caller
// owns what aliasing means for writes.
at::Tensor alias_storage(const at::Tensor& base, at::ScalarType dtype, at::IntArrayRef sizes,
                         at::IntArrayRef strides, int64_t offset);

}  // namespace torchmoe::ops
