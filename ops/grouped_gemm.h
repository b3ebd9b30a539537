#pragma once
// Grouped GEMM ops: the three products of a grouped linear layer over row-splits of one input.
//
// This layer validates arguments, allocates outputs and makes the one device/dtype/backend decision
// (select_backend); the kernels below it see raw pointers only. Group g owns rows
// [offset_g, offset_g + m_splits[g]) of every row-grouped operand, offset_g = Σ_{h<g} m_splits[h].
//
// Split sizes come on the host or as a CUDA tensor. Host sizes are checked to sum to the rows.
// Device sizes are read by the sm90 kernel itself (no device-to-host copy, CUDA-graph safe) and
// cannot be checked without a sync: there each group is clamped to the buffer (a sum above the
// row count truncates the last groups; negative sizes count as 0), and rows past the last group
// are neither read nor written, which is what capacity-padded inputs need. Backends that need
// host sizes copy device sizes to the host first (one sync).

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace torchmoe::ops {

// Where a grouped GEMM runs.
enum class GemmBackend {
  kReference,  // CPU: per-group ATen matmuls, any floating dtype (reference quality)
  kCublasLt,   // CUDA fp32/fp16/bf16: per-group cuBLASLt calls spread over a small pool of streams
  kSm90,       // CUDA bf16/fp16 on sm_90: torchmoe's one-launch grouped kernel, device splits
};

// What a caller asks for. kAuto follows the decision table in select_backend (itself overridden
// by TORCHMOE_GROUPED_GEMM_BACKEND=auto|cublaslt|sm90); the others force a backend and fail with
// NotImplementedError where it cannot run.
enum class GemmBackendChoice { kAuto, kCublasLt, kSm90 };

// What select_backend looks at besides the operand's device and dtype.
struct GemmShape {
  int64_t n = 0;  // out_features
  int64_t k = 0;  // in_features
  size_t groups = 0;
  bool aligned = true;  // every operand's data pointer is 16-byte aligned
};

// The dispatch table:
//   CPU, floating dtype                      -> kReference (a forced CUDA backend is an error)
//   CUDA fp32                                -> kCublasLt
//   CUDA bf16/fp16, choice kCublasLt         -> kCublasLt
//   CUDA bf16/fp16, sm_90 device, n and k multiples of 8 (> 0), groups <= 1024, aligned
//                                            -> kSm90 (one launch, no host sync; at or above
//                                               per-group cuBLASLt on the measured shapes)
//   CUDA bf16/fp16 otherwise                 -> kCublasLt (kAuto); NotImplementedError (kSm90)
//   anything else                            -> NotImplementedError
GemmBackend select_backend(const at::Tensor& operand, const GemmShape& shape,
                           GemmBackendChoice choice = GemmBackendChoice::kAuto);

// Rows per group, on the host or as a 1-D integer tensor. A CPU tensor is read at once; a CUDA
// tensor is kept on the device.
class GroupSplits {
 public:
  GroupSplits(c10::IntArrayRef sizes) : host_(sizes.vec()) {}
  GroupSplits(const std::vector<int64_t>& sizes) : host_(sizes) {}
  GroupSplits(std::initializer_list<int64_t> sizes) : host_(sizes) {}
  GroupSplits(const at::Tensor& sizes);

  bool on_device() const { return device_.defined(); }
  size_t size() const;
  // The host sizes; only without device sizes.
  c10::IntArrayRef host() const;
  // The device sizes (int32 or int64, contiguous); only with on_device().
  const at::Tensor& device() const { return device_; }
  // The sizes on the host: one device-to-host copy for device sizes.
  std::vector<int64_t> to_host() const;

 private:
  std::vector<int64_t> host_;
  at::Tensor device_;
};

// The splits a sequence of grouped GEMMs on these operands should carry: device sizes stay on the
// device when select_backend picks kSm90, otherwise they are copied to the host once here rather
// than in every GEMM.
GroupSplits resolve_splits(const GroupSplits& m_splits, const at::Tensor& input,
                           at::TensorList weights, GemmBackendChoice choice);

// y[rows of g] = x[rows of g] · W_gᵀ + b_g.
//   input [rows, in] contiguous; weights: G tensors [out, in]; biases: empty or G tensors [out].
// Returns y [rows, out] in the input's dtype.
at::Tensor grouped_linear_forward(const at::Tensor& input, const GroupSplits& m_splits,
                                  at::TensorList weights, at::TensorList biases,
                                  GemmBackendChoice choice = GemmBackendChoice::kAuto);

// dx[rows of g] = dy[rows of g] · W_g. grad_output [rows, out]; returns dx [rows, in].
at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const GroupSplits& m_splits,
                                at::TensorList weights,
                                GemmBackendChoice choice = GemmBackendChoice::kAuto);

// dW_g = dy_gᵀ · x_g into the caller's buffers (the module's .grad tensors or fp32 main-grad):
//   weight_grads_out: G tensors [out, in] of the input's dtype or float32; overwritten, or added to
//   when `accumulate` (fp32/fp64 buffers only; an empty group then leaves its buffer untouched,
//   else zero-fills it).
//   bias_grads_out: empty or G tensors [out] of the input's dtype, always overwritten with Σ_rows
//   dy_g.
void grouped_linear_wgrad(const at::Tensor& input, const at::Tensor& grad_output,
                          const GroupSplits& m_splits, at::TensorList weight_grads_out,
                          bool accumulate, at::TensorList bias_grads_out,
                          GemmBackendChoice choice = GemmBackendChoice::kAuto);

// db_g = Σ_rows dy_g into bias_grads_out (G tensors [out]); used when the wgrad GEMM is deferred.
void grouped_bias_grad(const at::Tensor& grad_output, const GroupSplits& m_splits,
                       at::TensorList bias_grads_out);

}  // namespace torchmoe::ops
