#include "torchmoe/ops/glu.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>

#include <cmath>
#include <vector>

#include "torchmoe/kernels/glu.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

constexpr const char* kOp = "torchmoe::glu";

enum class GluBackend {
  kReference,  // CPU: ATen ops in fp32 (fp64 for fp64 input)
  kCuda,       // fused kernels/scaled_glu.cu
};

// The dispatch table; throws NotImplementedError for valid but unsupported device/dtype pairs.
GluBackend select_glu_backend(const at::Tensor& input) {
  const at::ScalarType dtype = input.scalar_type();
  if (input.is_cpu()) return GluBackend::kReference;
  if (input.is_cuda() && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) {
    return GluBackend::kCuda;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, kOp, ": no backend for ", input.device(), " tensors of dtype ",
                              dtype,
                              " (supported: CPU floating dtypes; CUDA float32, float16, bfloat16)");
}

// Validates input/scales/options and returns H.
int64_t check_inputs(const at::Tensor& input, const at::Tensor& scales, const GluOptions& o) {
  TORCH_CHECK(input.defined() && input.dim() >= 1, kOp,
              ": input must be a tensor of at least 1 dimension [..., 2H], got ",
              input.defined() ? c10::str(input.dim(), " dimensions") : "an undefined tensor");
  TORCH_CHECK(at::isFloatingType(input.scalar_type()), kOp,
              ": input must have a floating dtype, got ", input.scalar_type());
  TORCH_CHECK(input.size(-1) % 2 == 0 && input.size(-1) > 0, kOp,
              ": input's last dimension must be even and positive (2H: act half and gate half), ",
              "got ", input.size(-1));
  TORCH_CHECK(input.is_contiguous(), kOp, ": input must be contiguous");
  const int64_t hidden = input.size(-1) / 2;
  check_glu_options(kOp, o, hidden);
  if (scales.defined()) {
    const auto expected = input.sizes().slice(0, input.dim() - 1);
    TORCH_CHECK(scales.sizes() == expected, kOp, ": scales must have shape ", expected,
                " (the input's without the last dimension), got ", scales.sizes());
    TORCH_CHECK(scales.device() == input.device(), kOp, ": scales must be on ", input.device(),
                " like the input, got ", scales.device());
    TORCH_CHECK(at::isFloatingType(scales.scalar_type()), kOp,
                ": scales must have a floating dtype, got ", scales.scalar_type());
    TORCH_CHECK(!input.is_cuda() || scales.scalar_type() == at::kFloat ||
                    scales.scalar_type() == input.scalar_type(),
                kOp, ": scales must be float32 or the input's dtype ", input.scalar_type(),
                " on CUDA, got ", scales.scalar_type());
  }
  return hidden;
}

std::vector<int64_t> output_shape(const at::Tensor& input, int64_t hidden) {
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = hidden;
  return shape;
}

// ---- CPU reference ---------------------------------------------------------------------------

struct Halves {
  at::Tensor a, b;  // [rows, H] in the compute dtype
};

// Works for both layouts: plain halves are the interleaved layout with G = H.
Halves split_halves(const at::Tensor& input, int64_t hidden, int64_t interleave,
                    at::ScalarType compute) {
  const int64_t block = interleave ? interleave : hidden;
  const at::Tensor x = input.to(compute).reshape({-1, hidden / block, 2, block});
  return {x.select(2, 0).reshape({-1, hidden}), x.select(2, 1).reshape({-1, hidden})};
}

struct Terms {
  at::Tensor value, d_a, d_b;  // act·gate and its partial derivatives, [rows, H]
};

Terms glu_terms(const Halves& h, const GluOptions& o) {
  if (o.activation == GluActivation::kSwiGLU) {
    const at::Tensor s = at::sigmoid(h.a);
    const at::Tensor act = h.a * s;
    return {act * h.b, (s + act * (1 - s)) * h.b, act};
  }
  const at::Tensor ac = h.a.clamp_max(o.limit);
  const at::Tensor s = at::sigmoid(o.alpha * ac);
  const at::Tensor act = ac * s;
  const at::Tensor gate = h.b.clamp(-o.limit, o.limit) + o.offset;
  const at::Tensor d_act = at::where(h.a <= o.limit, s + o.alpha * act * (1 - s), 0.0);
  const at::Tensor d_gate = ((h.b >= -o.limit) & (h.b <= o.limit)).to(act.scalar_type());
  return {act * gate, d_act * gate, act * d_gate};
}

at::ScalarType compute_type(const at::Tensor& input) {
  return input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor row_scales(const at::Tensor& scales, at::ScalarType compute) {
  return scales.defined() ? scales.to(compute).reshape({-1, 1}) : at::Tensor();
}

kernels::GluParams kernel_params(const at::Tensor& input, const at::Tensor& scales,
                                 const GluOptions& o, int64_t hidden) {
  kernels::GluParams p;
  p.activation = o.activation;
  p.limit = static_cast<float>(o.limit);
  p.alpha = static_cast<float>(o.alpha);
  p.offset = static_cast<float>(o.offset);
  p.rows = c10::multiply_integers(input.sizes().slice(0, input.dim() - 1));  // hidden may be 0
  p.hidden = hidden;
  p.interleave = o.interleave;
  p.data_type = kernel_type(input.scalar_type());
  p.scale_type =
      scales.defined() ? kernel_type(scales.scalar_type()) : kernels::ScalarType::kFloat32;
  p.input = input.const_data_ptr();
  p.scales = scales.defined() ? scales.const_data_ptr() : nullptr;
  return p;
}

}  // namespace

void check_glu_options(const char* op, const GluOptions& o, int64_t hidden) {
  TORCH_CHECK(o.interleave == 0 || (o.interleave > 0 && hidden % o.interleave == 0), op,
              ": glu_interleave_size must be a positive divisor of H=", hidden, ", got ",
              o.interleave);
  TORCH_CHECK(o.activation != GluActivation::kClampedSwiGLU ||
                  (std::isfinite(o.limit) && o.limit > 0 && std::isfinite(o.alpha) &&
                   std::isfinite(o.offset)),
              op, ": the clamped SwiGLU needs a finite positive limit and a finite alpha and ",
              "offset, got limit ", o.limit, ", alpha ", o.alpha, ", offset ", o.offset);
}

kernels::GluParams detail::glu_kernel_params(const at::Tensor& input, const at::Tensor& scales,
                                             const GluOptions& o) {
  const int64_t hidden = check_inputs(input, scales, o);
  // The CUDA kernels' types, checked on every device so that the errors are testable on the CPU
  // (check_inputs lets the CPU reference take any floating dtype).
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, kOp,
              ": input must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(!scales.defined() || scales.scalar_type() == at::kFloat ||
                  scales.scalar_type() == input.scalar_type(),
              kOp, ": scales must be float32 or the input's dtype ", input.scalar_type(), ", got ",
              scales.scalar_type());
  TORCH_INTERNAL_ASSERT(!scales.defined() || scales.is_contiguous(),
                        "glu_kernel_params: scales must be contiguous");
  return kernel_params(input, scales, o, hidden);
}

at::Tensor glu_forward(const at::Tensor& input, const at::Tensor& scales, const GluOptions& o) {
  const int64_t hidden = check_inputs(input, scales, o);
  switch (select_glu_backend(input)) {
    case GluBackend::kReference: {
      const at::ScalarType compute = compute_type(input);
      at::Tensor y = glu_terms(split_halves(input, hidden, o.interleave, compute), o).value;
      if (scales.defined()) y = y * row_scales(scales, compute);
      return y.to(input.scalar_type()).reshape(output_shape(input, hidden));
    }
    case GluBackend::kCuda: {
      const c10::cuda::CUDAGuard guard(input.device());
      const at::Tensor scales_c = scales.defined() ? scales.contiguous() : scales;
      at::Tensor output = new_empty(output_shape(input, hidden), input.options());
      kernels::GluParams p = kernel_params(input, scales_c, o, hidden);
      p.output = output.data_ptr();
      kernels::launch_glu_forward(p, at::cuda::getCurrentCUDAStream().stream());
      return output;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GluBackend");
}

GluGrads glu_backward(const at::Tensor& grad_output, const at::Tensor& input,
                      const at::Tensor& scales, const GluOptions& o, bool grad_scales) {
  const int64_t hidden = check_inputs(input, scales, o);
  TORCH_CHECK(!grad_scales || scales.defined(), kOp, ": grad_scales needs scales");
  const std::vector<int64_t> y_shape = output_shape(input, hidden);
  TORCH_CHECK(grad_output.defined() && grad_output.sizes() == at::IntArrayRef(y_shape), kOp,
              ": grad_output must have shape ", at::IntArrayRef(y_shape), ", got ",
              grad_output.defined() ? grad_output.sizes() : at::IntArrayRef{});
  TORCH_CHECK(
      grad_output.scalar_type() == input.scalar_type() && grad_output.device() == input.device(),
      kOp, ": grad_output must match the input's dtype and device");
  TORCH_CHECK(grad_output.is_contiguous(), kOp, ": grad_output must be contiguous");
  switch (select_glu_backend(input)) {
    case GluBackend::kReference: {
      const at::ScalarType compute = compute_type(input);
      const Terms t = glu_terms(split_halves(input, hidden, o.interleave, compute), o);
      const at::Tensor dy = grad_output.to(compute).reshape({-1, hidden});
      const at::Tensor g = scales.defined() ? dy * row_scales(scales, compute) : dy;
      const int64_t block = o.interleave ? o.interleave : hidden;
      auto blocks = [&](const at::Tensor& t) { return t.reshape({-1, hidden / block, block}); };
      GluGrads grads;
      grads.grad_input = at::stack({blocks(g * t.d_a), blocks(g * t.d_b)}, 2)
                             .to(input.scalar_type())
                             .reshape(input.sizes());
      if (grad_scales) {
        grads.grad_scales = (dy * t.value).sum(-1).to(scales.scalar_type()).reshape(scales.sizes());
      }
      return grads;
    }
    case GluBackend::kCuda: {
      const c10::cuda::CUDAGuard guard(input.device());
      const at::Tensor scales_c = scales.defined() ? scales.contiguous() : scales;
      GluGrads grads;
      grads.grad_input = new_empty(input.sizes(), input.options());
      if (grad_scales) grads.grad_scales = new_empty(scales_c.sizes(), scales_c.options());
      kernels::GluParams p = kernel_params(input, scales_c, o, hidden);
      p.grad_output = grad_output.const_data_ptr();
      p.grad_input = grads.grad_input.data_ptr();
      p.grad_scales = grad_scales ? grads.grad_scales.data_ptr() : nullptr;
      kernels::launch_glu_backward(p, at::cuda::getCurrentCUDAStream().stream());
      return grads;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GluBackend");
}

}  // namespace torchmoe::ops
