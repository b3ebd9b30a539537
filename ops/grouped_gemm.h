#pragma once
// Grouped GEMM ops: the three products of a grouped linear layer over row-splits of one input.
//
// This layer validates arguments, allocates outputs and makes the one device/dtype/backend decision
// (select_backend); the kernels below it see raw pointers only. Group g owns rows
// [offset_g, offset_g + m_splits[g]) of every row-grouped operand, offset_g = Σ_{h<g} m_splits[h].

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace torchmoe::ops {

// Where a grouped GEMM runs. Chosen per call by select_backend from the operands' device and dtype.
enum class GemmBackend {
  kReference,  // CPU: per-group ATen matmuls, any floating dtype (reference quality)
  kCublasLt,   // CUDA fp32/fp16/bf16: per-group cuBLASLt calls spread over a small pool of streams
};

// The dispatch table; throws NotImplementedError for a valid but unsupported device/dtype.
GemmBackend select_backend(const at::Tensor& operand);

// Split sizes given as a 1-D integer tensor on any device, copied to the host (one device-to-host
// copy when the tensor is on a GPU).
std::vector<int64_t> splits_to_host(const at::Tensor& m_splits);

// y[rows of g] = x[rows of g] · W_gᵀ + b_g.
//   input [rows, in] contiguous; weights: G tensors [out, in]; biases: empty or G tensors [out].
// Returns y [rows, out] in the input's dtype.
at::Tensor grouped_linear_forward(const at::Tensor& input, c10::IntArrayRef m_splits,
                                  at::TensorList weights, at::TensorList biases);

// dx[rows of g] = dy[rows of g] · W_g. grad_output [rows, out]; returns dx [rows, in].
at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, c10::IntArrayRef m_splits,
                                at::TensorList weights);

// dW_g = dy_gᵀ · x_g into the caller's buffers (the module's .grad tensors or fp32 main-grad):
//   weight_grads_out: G tensors [out, in] of the input's dtype or float32; overwritten, or added to
//   when `accumulate` (fp32/fp64 buffers only; an empty group then leaves its buffer untouched,
//   else zero-fills it).
//   bias_grads_out: empty or G tensors [out] of the input's dtype, always overwritten with Σ_rows
//   dy_g.
void grouped_linear_wgrad(const at::Tensor& input, const at::Tensor& grad_output,
                          c10::IntArrayRef m_splits, at::TensorList weight_grads_out,
                          bool accumulate, at::TensorList bias_grads_out);

// db_g = Σ_rows dy_g into bias_grads_out (G tensors [out]); used when the wgrad GEMM is deferred.
void grouped_bias_grad(const at::Tensor& grad_output, c10::IntArrayRef m_splits,
                       at::TensorList bias_grads_out);

}  // namespace torchmoe::ops
