#pragma once
// The types a torchmoe user names besides the modules and their options: split sizes, the grouped
// GEMM backend choice and the gated activation's kind. They live here, at the lowest layer that
// takes them, so that modules, autograd and ops share one definition of each; they are in namespace
// torchmoe because they are public. Installed (modules include it).

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "torchmoe/kernels/types.h"

namespace torchmoe {

/// Rows per group (expert) of a grouped linear layer, given on the host (a vector, brace list or
/// IntArrayRef), as a 1-D integer tensor, or both. A CPU tensor is read at once; a CUDA tensor
/// stays on the device, where the sm90 grouped GEMM reads it without a host sync (CUDA-graph
/// safe). Backends that loop over groups on the host copy device sizes to the host once per
/// layer call. Given both (as permute_tokens returns them), each backend takes the copy it reads
/// and nothing is copied.
class SplitSizes {
 public:
  SplitSizes(c10::IntArrayRef sizes) : host_(sizes.vec()), has_host_(true) {}
  SplitSizes(const std::vector<int64_t>& sizes) : host_(sizes), has_host_(true) {}
  SplitSizes(std::initializer_list<int64_t> sizes) : host_(sizes), has_host_(true) {}
  SplitSizes(const at::Tensor& sizes);
  /// The same sizes on the host and on the device; the caller guarantees that they agree.
  SplitSizes(std::vector<int64_t> host, const at::Tensor& device);
  /// `groups` groups of `rows` rows each: on the host, and on `device` too when it is a GPU.
  static SplitSizes uniform(int64_t groups, int64_t rows, const at::Device& device);

  size_t size() const;
  bool has_host() const { return has_host_; }
  bool has_device() const { return device_.defined(); }
  /// The host sizes; only with has_host().
  c10::IntArrayRef host() const;
  /// The device sizes (1-D int32 or int64, contiguous); only with has_device().
  const at::Tensor& device() const { return device_; }

 private:
  std::vector<int64_t> host_;
  bool has_host_ = false;
  at::Tensor device_;
};

/// Tokens grouped by expert, as functional::permute_tokens returns them.
struct PermutedTokens {
  at::Tensor tokens;  // [N, H]: expert e's rows contiguous, experts in order
  // [N]: each row's routing probability (when probs were given). For float32 probabilities what
  // the routing map wrote, returned by RowProbsFunction: not to be changed in place.
  at::Tensor probs;
  // [T, k] int64: the permuted row of each (token, choice) slot, -1 where dropped.
  at::Tensor row_map;
  // [N] int64: the slot t·k + j of each permuted row (row_map's inverse).
  at::Tensor sorted_slots;
  // [N] int64: the token t of each permuted row (sorted_slots / k), as the routing map wrote it;
  // for received rows (top-k 1) their sorted_slots; undefined in the capacity map.
  at::Tensor row_tokens;
  // Rows per expert: on the host, and for CUDA tokens on the device too. MoELayer's dropless
  // routing keeps them on the device only (no host sync; GEMM backends that loop over groups on
  // the host copy them when planning).
  SplitSizes m_splits{std::vector<int64_t>{}};
};

/// What runs a grouped GEMM: the one enum of the choice a user makes (GroupedLinearOptions::
/// gemm_backend) and of what a call's plan decided per product. kAuto takes, per product
/// (fprop, dgrad, wgrad), the fastest backend that can run the call, from a table measured on the
/// H100 (docs/performance.md): the sm90 kernel on H100/H200 bf16/fp16, then the cuBLASLt grouped
/// matmul when the process loaded cuBLASLt >= 13.8, else per-group cuBLASLt; the CPU runs
/// kReference (per-group ATen matmuls).
/// TORCHMOE_GROUPED_GEMM_BACKEND=auto|cublaslt|sm90|cublaslt_grouped overrides kAuto for CUDA
/// tensors; the others force one backend for all three products and fail with NotImplementedError
/// where it cannot run. docs/architecture.md has the decision table.
enum class GemmBackend {
  kAuto,             ///< a choice only: planning picks one of the others per product
  kCublasLt,         ///< CUDA: per-group cuBLASLt matmuls over a small pool of streams, host sizes
  kSm90,             ///< CUDA sm_90: torchmoe's one-launch grouped kernel, device sizes
  kCublasLtGrouped,  ///< CUDA sm_90+, cuBLASLt >= 13.8 loaded: one grouped matmul, device sizes
  kReference,        ///< CPU: per-group ATen matmuls, any floating dtype (reference quality); last,
                     ///< so that the values before it keep their numbers
};

/// The cuBLASLt this process loaded (LoadedCublasLt, in kernels/types.h) and whether
/// GemmBackend::kCublasLtGrouped can use it.
LoadedCublasLt loaded_cublaslt();

}  // namespace torchmoe
