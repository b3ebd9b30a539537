// The grouped GEMM ops' products: argument checks and output allocation, then a switch on the
// plan's backend for the product (grouped_gemm_backends.h). The plan is grouped_gemm_plan.cpp's.

#include "torchmoe/ops/grouped_gemm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/grouped_gemm_backends.h"

namespace torchmoe::ops {
namespace {

using detail::check_groups;
using detail::check_host_splits;
using detail::CheckedGroups;

// ---- argument checks ---------------------------------------------------------------------------

// An FP8 plan chose its engine for FP8 operands (the sm90 kernel, e.g., without the 16-bit dtype
// check): its products are the grouped_linear_*_fp8 ops.
void check_16bit_plan(const char* op, const GemmPlan& plan) {
  TORCH_CHECK(!plan.fp8, op, ": plan must be a 16-bit plan (plan_grouped_gemms without FP8 ",
              "options), got an FP8 plan, whose products are the grouped_linear_*_fp8 ops");
}

void check_rows_operand(const char* op, const char* name, const at::Tensor& t,
                        const GemmPlan& plan) {
  TORCH_CHECK(t.defined() && t.dim() == 2, op, ": ", name, " must be a 2-D [rows, features] tensor",
              t.defined() ? ", got " + std::to_string(t.dim()) + "-D" : std::string());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.size(0) == plan.rows, op, ": ", name, " must have the plan's ", plan.rows,
              " rows, got ", t.size(0));
  TORCH_CHECK(t.device() == plan.device && t.scalar_type() == plan.dtype, op, ": ", name,
              " must be a ", plan.dtype, " tensor on ", plan.device,
              " like the planned input, got ", t.scalar_type(), " on ", t.device());
}

// An input read through gather_rows: any row count (at least one row when rows are gathered).
void check_gathered_input(const char* op, const at::Tensor& input, const at::Tensor& gather_rows,
                          const GemmPlan& plan) {
  TORCH_CHECK(input.defined() && input.dim() == 2, op,
              ": input must be a 2-D [rows, features] tensor",
              input.defined() ? ", got " + std::to_string(input.dim()) + "-D" : std::string());
  TORCH_CHECK(input.is_contiguous(), op, ": input must be contiguous");
  TORCH_CHECK(input.device() == plan.device && input.scalar_type() == plan.dtype, op,
              ": input must be a ", plan.dtype, " tensor on ", plan.device,
              " like the planned input, got ", input.scalar_type(), " on ", input.device());
  detail::check_gather_rows(op, gather_rows, input);
  TORCH_CHECK(gather_rows.size(0) == plan.rows, op, ": gather_rows must have the plan's ",
              plan.rows, " rows, got ", gather_rows.size(0));
  TORCH_CHECK(input.size(0) > 0 || plan.rows == 0, op, ": gather_rows names ", plan.rows,
              " rows of an input that has none");
}

// The input's rows as the grouped operand: the input itself, or its gathered copy (the backends
// other than sm90 read no row map), where a -1 entry (a padding row) is a zero row as the sm90
// kernel reads it.
at::Tensor gathered(const at::Tensor& input, const at::Tensor& gather_rows) {
  if (!gather_rows.defined()) return input;
  return input.index_select(0, gather_rows.clamp_min(0))
      .masked_fill_((gather_rows < 0).unsqueeze(1), 0);
}

// A scattered output's map: [plan rows] int32/int64, contiguous, on the output's device; a
// non-negative row count.
void check_scatter(const char* op, const RowScatter& scatter, const GemmPlan& plan) {
  const at::Tensor& rows = scatter.rows;
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == plan.rows, op, ": scatter.rows must be a 1-D ",
              "tensor of the plan's ", plan.rows, " rows, got ", rows.sizes());
  detail::check_row_index(op, "scatter.rows", rows, plan.device);
  TORCH_CHECK(scatter.target_rows >= 0, op, ": scatter.target_rows must be >= 0, got ",
              scatter.target_rows);
}

// The buffer forward or dgrad writes: the sm90 kernel adds scattered rows into zeros of the
// output's shape, which its launch writes (a memset: no fill kernel queued here) when there are
// rows to launch for; the other backends write [rows, cols] first (zeros past the last group,
// which they leave unwritten, when the rows are added up after: summed_rows).
at::Tensor new_output(const GemmPlan& plan, const RowScatter& scatter, GemmBackend backend,
                      int64_t cols, const at::TensorOptions& options) {
  if (!scatter.defined()) return new_empty({plan.rows, cols}, options);
  if (backend == GemmBackend::kSm90) {
    return plan.rows > 0 ? new_empty({scatter.target_rows, cols}, options)
                         : at::zeros({scatter.target_rows, cols}, options);
  }
  return at::zeros({plan.rows, cols}, options);
}

// The other backends' scattered output: `rows` added with index_add_, entries -1 or past the
// output into a spare row past its end. At most two adds per output row make the result
// independent of their order (on CUDA index_add_'s atomics), as the sm90 kernel's.
at::Tensor summed_rows(const at::Tensor& rows, const RowScatter& scatter) {
  if (!scatter.defined()) return rows;
  const int64_t target = scatter.target_rows;
  const at::Tensor index = scatter.rows.to(at::kLong);
  const at::Tensor spare = (index < 0).logical_or_(index >= target);
  at::Tensor padded = at::zeros({target + 1, rows.size(1)}, rows.options());
  padded.index_add_(0, index.masked_fill(spare, target), rows);
  return padded.narrow(0, 0, target);  // the leading rows: contiguous
}

CheckedGroups check_weights(const char* op, const GemmPlan& plan, const GroupedTensors& weights,
                            const at::Tensor& like) {
  return check_groups(op, "weights", weights, plan.shape.groups, like, {plan.shape.n, plan.shape.k},
                      like.scalar_type(), "the input's dtype");
}

// Biases or their gradients: none, or G × [n] of the operand's dtype.
CheckedGroups check_vectors(const char* op, const char* what, const GemmPlan& plan,
                            const GroupedTensors& vectors, const at::Tensor& like) {
  if (vectors.empty()) return {};
  return check_groups(op, what, vectors, plan.shape.groups, like, {plan.shape.n},
                      like.scalar_type(), "the input's dtype");
}

}  // namespace

at::Tensor grouped_linear_forward(const GemmPlan& plan, const at::Tensor& input,
                                  const GroupedTensors& weights, const GroupedTensors& biases,
                                  const at::Tensor& gather_rows, const RowScatter& scatter) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_forward";
  check_16bit_plan(op, plan);
  if (gather_rows.defined()) {
    check_gathered_input(op, input, gather_rows, plan);
  } else {
    check_rows_operand(op, "input", input, plan);
  }
  TORCH_CHECK(input.size(1) == plan.shape.k, op, ": input must have ", plan.shape.k,
              " features, got ", input.size(1));
  const CheckedGroups w = check_weights(op, plan, weights, input);
  const CheckedGroups b = check_vectors(op, "biases", plan, biases, input);
  if (scatter.defined()) check_scatter(op, scatter, plan);
  at::Tensor output = new_output(plan, scatter, plan.backend, plan.shape.n, input.options());
  switch (plan.backend) {
    case GemmBackend::kSm90:
      detail::sm90_forward(plan, input, gather_rows, w, b, output, scatter);
      return output;
    case GemmBackend::kReference:
      detail::reference_forward(plan, gathered(input, gather_rows), w, b, output);
      return summed_rows(output, scatter);
    case GemmBackend::kCublasLt:
      detail::cublaslt_forward(plan, gathered(input, gather_rows), w, b, output);
      return summed_rows(output, scatter);
    case GemmBackend::kCublasLtGrouped:
      detail::cublaslt_grouped_forward(plan, gathered(input, gather_rows), w, b, output);
      return summed_rows(output, scatter);
    case GemmBackend::kAuto:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "a plan's backend is never kAuto");
}

at::Tensor grouped_linear_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                                const GroupedTensors& weights, const RowScatter& scatter) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_dgrad";
  check_16bit_plan(op, plan);
  check_rows_operand(op, "grad_output", grad_output, plan);
  TORCH_CHECK(grad_output.size(1) == plan.shape.n, op, ": grad_output must have ", plan.shape.n,
              " features, got ", grad_output.size(1));
  const CheckedGroups w = check_weights(op, plan, weights, grad_output);
  if (scatter.defined()) check_scatter(op, scatter, plan);
  at::Tensor grad_input =
      new_output(plan, scatter, plan.dgrad_backend, plan.shape.k, grad_output.options());
  switch (plan.dgrad_backend) {
    case GemmBackend::kSm90:
      detail::sm90_dgrad(plan, grad_output, w, grad_input, scatter);
      return grad_input;
    case GemmBackend::kReference:
      detail::reference_dgrad(plan, grad_output, w, grad_input);
      return summed_rows(grad_input, scatter);
    case GemmBackend::kCublasLt:
      detail::cublaslt_dgrad(plan, grad_output, w, grad_input);
      return summed_rows(grad_input, scatter);
    case GemmBackend::kCublasLtGrouped:
      detail::cublaslt_grouped_dgrad(plan, grad_output, w, grad_input);
      return summed_rows(grad_input, scatter);
    case GemmBackend::kAuto:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "a plan's backend is never kAuto");
}

void grouped_bias_grad(const GemmPlan& plan, const at::Tensor& grad_output,
                       const GroupedTensors& bias_grads_out) {
  constexpr const char* op = "torchmoe::ops::grouped_bias_grad";
  check_rows_operand(op, "grad_output", grad_output, plan);
  TORCH_CHECK(grad_output.size(1) == plan.shape.n, op, ": grad_output must have ", plan.shape.n,
              " features, got ", grad_output.size(1));
  TORCH_CHECK(!bias_grads_out.empty(), op, ": bias_grads_out must hold one tensor per group");
  const CheckedGroups b = check_vectors(op, "bias_grads_out", plan, bias_grads_out, grad_output);
  if (detail::reads_device_splits(plan.wgrad_backend)) {
    detail::device_bias_grad(plan, grad_output, b);
  } else {
    detail::host_bias_grad(plan.m_splits.host(), grad_output, b);
  }
}

void grouped_linear_wgrad(const GemmPlan& plan, const at::Tensor& input,
                          const at::Tensor& grad_output, const GroupedTensors& weight_grads_out,
                          bool accumulate, const GroupedTensors& bias_grads_out,
                          const at::Tensor& gather_rows) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_wgrad";
  check_16bit_plan(op, plan);
  if (gather_rows.defined()) {
    check_gathered_input(op, input, gather_rows, plan);
  } else {
    check_rows_operand(op, "input", input, plan);
  }
  check_rows_operand(op, "grad_output", grad_output, plan);
  TORCH_CHECK(input.size(1) == plan.shape.k && grad_output.size(1) == plan.shape.n, op,
              ": input and grad_output must have ", plan.shape.k, " and ", plan.shape.n,
              " features, got ", input.size(1), " and ", grad_output.size(1));
  TORCH_CHECK(!weight_grads_out.empty(), op, ": weight_grads_out must hold one tensor per group");
  const at::ScalarType grad_type = weight_grads_out[0].scalar_type();
  TORCH_CHECK(grad_type == input.scalar_type() || grad_type == at::kFloat, op,
              ": weight_grads_out must have the input's dtype ", input.scalar_type(),
              " or float32, got ", grad_type);
  // Adding into a 16-bit buffer would round twice (cuBLASLt's beta = 1 epilogue was measured
  // rounding the product before the add); accumulation is for fp32 main-grad buffers.
  TORCH_CHECK(!accumulate || grad_type == at::kFloat || grad_type == at::kDouble, op,
              ": accumulate requires float32 (or float64) weight_grads_out, got ", grad_type);
  const CheckedGroups dw =
      check_groups(op, "weight_grads_out", weight_grads_out, plan.shape.groups, input,
                   {plan.shape.n, plan.shape.k}, grad_type, "weight_grads_out[0]'s dtype");
  const CheckedGroups db = check_vectors(op, "bias_grads_out", plan, bias_grads_out, input);
  switch (plan.wgrad_backend) {
    case GemmBackend::kSm90:
      detail::sm90_wgrad(plan, input, gather_rows, grad_output, dw, accumulate);
      if (!db.empty()) detail::device_bias_grad(plan, grad_output, db);
      return;
    case GemmBackend::kReference:
      detail::reference_wgrad(plan, gathered(input, gather_rows), grad_output, dw, accumulate);
      if (!db.empty()) detail::host_bias_grad(plan.m_splits.host(), grad_output, db);
      return;
    case GemmBackend::kCublasLt:
      detail::cublaslt_wgrad(plan, gathered(input, gather_rows), grad_output, dw, accumulate, db);
      return;
    case GemmBackend::kCublasLtGrouped:
      detail::cublaslt_grouped_wgrad(plan, gathered(input, gather_rows), grad_output, dw,
                                     accumulate);
      if (!db.empty()) detail::device_bias_grad(plan, grad_output, db);
      return;
    case GemmBackend::kAuto:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "a plan's backend is never kAuto");
}

}  // namespace torchmoe::ops
