#include "torchmoe/modules/glu.h"

#include "torchmoe/autograd/glu_function.h"
#include "torchmoe/modules/glu_options.h"

namespace torchmoe {
namespace {

// nullopt means plain halves (the ops' 0); an explicit size must be a real block size.
int64_t interleave_of(const std::optional<int64_t>& size) {
  TORCH_CHECK(!size || *size > 0, "glu_interleave_size must be positive when given, got ", *size);
  return size.value_or(0);
}

void print_interleave(std::ostream& stream, const std::optional<int64_t>& interleave) {
  if (interleave) stream << "glu_interleave_size=" << *interleave;
}

void print_clamped(std::ostream& stream, const char* name, const ClampedSwiGLUOptions& o) {
  stream << "torchmoe::" << name << "(limit=" << o.limit() << ", alpha=" << o.alpha()
         << ", offset=" << o.offset();
  if (o.glu_interleave_size()) stream << ", ";
  print_interleave(stream, o.glu_interleave_size());
  stream << ")";
}

// Checked before the autograd Function, which cannot take an undefined input.
torch::Tensor apply_glu(const char* op, const torch::Tensor& input,
                        const std::optional<torch::Tensor>& scales, const ops::GluOptions& o) {
  TORCH_CHECK(input.defined(), op, ": input must be a defined tensor [..., 2H]");
  return autograd::GluFunction::apply(input, scales, o);
}

}  // namespace

ops::GluOptions glu_options(const SwiGLUOptions& o) {
  ops::GluOptions g;
  g.interleave = interleave_of(o.glu_interleave_size());
  return g;
}

ops::GluOptions glu_options(const ClampedSwiGLUOptions& o) {
  ops::GluOptions g;
  g.activation = GluActivation::kClampedSwiGLU;
  g.limit = o.limit();
  g.alpha = o.alpha();
  g.offset = o.offset();
  g.interleave = interleave_of(o.glu_interleave_size());
  return g;
}

namespace functional {

torch::Tensor swiglu(const torch::Tensor& input, const SwiGLUOptions& options) {
  return apply_glu("swiglu", input, std::nullopt, glu_options(options));
}

torch::Tensor clamped_swiglu(const torch::Tensor& input, const ClampedSwiGLUOptions& options) {
  return apply_glu("clamped_swiglu", input, std::nullopt, glu_options(options));
}

torch::Tensor scaled_swiglu(const torch::Tensor& input, const torch::Tensor& scales,
                            const SwiGLUOptions& options) {
  TORCH_CHECK(scales.defined(), "scaled_swiglu: scales must be a defined tensor");
  return apply_glu("scaled_swiglu", input, scales, glu_options(options));
}

torch::Tensor scaled_clamped_swiglu(const torch::Tensor& input, const torch::Tensor& scales,
                                    const ClampedSwiGLUOptions& options) {
  TORCH_CHECK(scales.defined(), "scaled_clamped_swiglu: scales must be a defined tensor");
  return apply_glu("scaled_clamped_swiglu", input, scales, glu_options(options));
}

}  // namespace functional

torch::Tensor SwiGLUImpl::forward(const torch::Tensor& input) {
  return functional::swiglu(input, options);
}
torch::Tensor ClampedSwiGLUImpl::forward(const torch::Tensor& input) {
  return functional::clamped_swiglu(input, options);
}
torch::Tensor ScaledSwiGLUImpl::forward(const torch::Tensor& input, const torch::Tensor& scales) {
  return functional::scaled_swiglu(input, scales, options);
}
torch::Tensor ScaledClampedSwiGLUImpl::forward(const torch::Tensor& input,
                                               const torch::Tensor& scales) {
  return functional::scaled_clamped_swiglu(input, scales, options);
}

void SwiGLUImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmoe::SwiGLU(";
  print_interleave(stream, options.glu_interleave_size());
  stream << ")";
}
void ScaledSwiGLUImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmoe::ScaledSwiGLU(";
  print_interleave(stream, options.glu_interleave_size());
  stream << ")";
}
void ClampedSwiGLUImpl::pretty_print(std::ostream& stream) const {
  print_clamped(stream, "ClampedSwiGLU", options);
}
void ScaledClampedSwiGLUImpl::pretty_print(std::ostream& stream) const {
  print_clamped(stream, "ScaledClampedSwiGLU", options);
}

}  // namespace torchmoe
