// The CPU reference backend: one ATen matmul per group (any floating dtype), and the host-split
// bias gradient every backend falls back to.

#include <ATen/ATen.h>

#include "torchmoe/ops/grouped_gemm_backends.h"

namespace torchmoe::ops::detail {

void host_bias_grad(c10::IntArrayRef m_splits, const at::Tensor& grad_output,
                    const CheckedGroups& bias_grads) {
  for_each_group(m_splits, [&](size_t g, int64_t first, int64_t rows) {
    at::Tensor out_g = bias_grads.tensors[g];
    at::sum_out(out_g, grad_output.narrow(0, first, rows), {0});
  });
}

void reference_forward(const GemmPlan& plan, const at::Tensor& input, const CheckedGroups& weights,
                       const CheckedGroups& biases, at::Tensor& output) {
  for_each_group(plan.m_splits.host(), [&](size_t g, int64_t first, int64_t rows) {
    if (rows == 0) return;
    at::Tensor out_g = output.narrow(0, first, rows);
    const at::Tensor in_g = input.narrow(0, first, rows);
    if (biases.empty()) {
      at::mm_out(out_g, in_g, weights.tensors[g].t());
    } else {
      at::addmm_out(out_g, biases.tensors[g], in_g, weights.tensors[g].t());
    }
  });
}

void reference_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                     const CheckedGroups& weights, at::Tensor& grad_input) {
  for_each_group(plan.m_splits.host(), [&](size_t g, int64_t first, int64_t rows) {
    if (rows == 0) return;
    at::Tensor out_g = grad_input.narrow(0, first, rows);
    at::mm_out(out_g, grad_output.narrow(0, first, rows), weights.tensors[g]);
  });
}

void reference_wgrad(const GemmPlan& plan, const at::Tensor& input, const at::Tensor& grad_output,
                     const CheckedGroups& weight_grads, bool accumulate) {
  // Multiply in the wider of the operand and buffer types, so that fp32 main-grad receives one
  // rounding, as on the GPU.
  const at::ScalarType compute_type =
      at::promote_types(input.scalar_type(), weight_grads.tensors[0].scalar_type());
  for_each_group(plan.m_splits.host(), [&](size_t g, int64_t first, int64_t rows) {
    if (rows == 0 && accumulate) return;
    at::Tensor out_g = weight_grads.tensors[g];
    const at::Tensor product = at::mm(grad_output.narrow(0, first, rows).t().to(compute_type),
                                      input.narrow(0, first, rows).to(compute_type));
    accumulate ? out_g.add_(product) : out_g.copy_(product);
  });
}

}  // namespace torchmoe::ops::detail
