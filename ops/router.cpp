#include "torchmoe/ops/router.h"

#include <ATen/ATen.h>

namespace torchmoe::ops {
namespace {

constexpr const char* kOp = "torchmoe::ops::router_logits";

// fp32, or fp64 when either operand is fp64.
at::ScalarType logits_type(const at::Tensor& x, const at::Tensor& weight) {
  return at::promote_types(at::promote_types(x.scalar_type(), weight.scalar_type()), at::kFloat);
}

// Both operands of one 16-bit dtype on CUDA: tensor cores with fp32 accumulation and output
// (at::mm's out_dtype).
bool tensor_core_path(const at::Tensor& x, const at::Tensor& weight) {
  return x.is_cuda() && x.scalar_type() == weight.scalar_type() &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}

}  // namespace

at::Tensor router_logits(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.defined() && x.dim() == 2, kOp, ": x must be 2-D [tokens, hidden], got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  TORCH_CHECK(weight.defined() && weight.dim() == 2 && weight.size(1) == x.size(1), kOp,
              ": weight must be [experts, hidden=", x.size(1), "], got ",
              weight.defined() ? weight.sizes() : at::IntArrayRef{});
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && at::isFloatingType(weight.scalar_type()), kOp,
              ": x and weight must have floating dtypes, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.device() == weight.device(), kOp, ": x and weight must be on one device, got ",
              x.device(), " and ", weight.device());
  if (tensor_core_path(x, weight)) return at::mm(x, weight.t(), at::kFloat);
  const at::ScalarType compute = logits_type(x, weight);
  return at::mm(x.to(compute), weight.to(compute).t());
}

RouterLogitsGrads router_logits_backward(const at::Tensor& grad_logits, const at::Tensor& x,
                                         const at::Tensor& weight, bool need_grad_x,
                                         bool need_grad_weight) {
  TORCH_CHECK(grad_logits.defined() && grad_logits.dim() == 2 && grad_logits.size(0) == x.size(0) &&
                  grad_logits.size(1) == weight.size(0),
              kOp, ": grad_logits must be [tokens=", x.size(0), ", experts=", weight.size(0),
              "], got ", grad_logits.defined() ? grad_logits.sizes() : at::IntArrayRef{});
  RouterLogitsGrads grads;
  // bf16 only: fp16's narrow exponent range makes the small halves of small gradients subnormal.
  if (tensor_core_path(x, weight) && x.scalar_type() == at::kBFloat16) {
    const at::Tensor g = grad_logits.to(at::kFloat);
    const at::Tensor hi = g.to(x.scalar_type());
    const at::Tensor lo = (g - hi.to(at::kFloat)).to(x.scalar_type());
    if (need_grad_x) grads.grad_x = at::mm(at::cat({hi, lo}, 1), at::cat({weight, weight}, 0));
    if (need_grad_weight) {
      grads.grad_weight =
          (at::mm(hi.t(), x, at::kFloat) + at::mm(lo.t(), x, at::kFloat)).to(weight.scalar_type());
    }
    return grads;
  }
  const at::ScalarType compute = logits_type(x, weight);
  const at::Tensor g = grad_logits.to(compute);
  if (need_grad_x) grads.grad_x = at::mm(g, weight.to(compute)).to(x.scalar_type());
  if (need_grad_weight) grads.grad_weight = at::mm(g.t(), x.to(compute)).to(weight.scalar_type());
  return grads;
}

}  // namespace torchmoe::ops
