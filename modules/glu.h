#pragma once
// Gated activations of MoE expert MLPs as modules and functions: SwiGLU, ClampedSwiGLU (GPT-OSS),
// and their Scaled variants, whose output rows are multiplied by per-row scales (the routing
// probabilities) that receive a gradient. The nonlinearity goes to the FIRST half of the input's
// last dimension (TransformerEngine's convention; torch::nn::GLU gates with the second half).

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <optional>
#include <ostream>

namespace torchmoe {

/// Options for `SwiGLU` and `ScaledSwiGLU`.
///
/// Example:
/// ```
/// torchmoe::ScaledSwiGLU act(torchmoe::SwiGLUOptions().glu_interleave_size(32));
/// torch::Tensor y = act(fc1_out, probs);  // [M, 2H] -> [M, H]
/// ```
struct SwiGLUOptions {
  /// Input rows interleave act and gate halves in blocks of this size (any positive size dividing
  /// H: 1 alternates a and b column by column, as GPT-OSS's gate_up_proj); nullopt: plain halves
  /// [a | b].
  TORCH_ARG(std::optional<int64_t>, glu_interleave_size) = std::nullopt;
};
using ScaledSwiGLUOptions = SwiGLUOptions;

/// Options for `ClampedSwiGLU` and `ScaledClampedSwiGLU`:
/// y = min(a, limit)·σ(alpha·min(a, limit)) · (clamp(b, -limit, limit) + offset).
///
/// Example:
/// ```
/// torchmoe::ClampedSwiGLU act(torchmoe::ClampedSwiGLUOptions().limit(7.0).alpha(1.702));
/// ```
struct ClampedSwiGLUOptions {
  TORCH_ARG(double, limit) = 7.0;
  TORCH_ARG(double, alpha) = 1.702;
  TORCH_ARG(double, offset) = 1.0;
  /// As SwiGLUOptions' (GPT-OSS: 1).
  TORCH_ARG(std::optional<int64_t>, glu_interleave_size) = std::nullopt;
};
using ScaledClampedSwiGLUOptions = ClampedSwiGLUOptions;

namespace functional {

/// y = silu(a) · b over input [..., 2H] -> [..., H].
torch::Tensor swiglu(const torch::Tensor& input, const SwiGLUOptions& options = {});
/// GPT-OSS clamped SwiGLU.
torch::Tensor clamped_swiglu(const torch::Tensor& input, const ClampedSwiGLUOptions& options = {});
/// scales[...] · silu(a) · b; scales has the input's shape without the last dimension.
torch::Tensor scaled_swiglu(const torch::Tensor& input, const torch::Tensor& scales,
                            const SwiGLUOptions& options = {});
/// scales[...] · clamped SwiGLU.
torch::Tensor scaled_clamped_swiglu(const torch::Tensor& input, const torch::Tensor& scales,
                                    const ClampedSwiGLUOptions& options = {});

}  // namespace functional

/// SwiGLU: y = silu(a) · b.
class SwiGLUImpl : public torch::nn::Cloneable<SwiGLUImpl> {
 public:
  explicit SwiGLUImpl(SwiGLUOptions options_ = {}) : options(options_) {}
  void reset() override {}
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input);
  SwiGLUOptions options;
};
TORCH_MODULE(SwiGLU);

/// ClampedSwiGLU (GPT-OSS).
class ClampedSwiGLUImpl : public torch::nn::Cloneable<ClampedSwiGLUImpl> {
 public:
  explicit ClampedSwiGLUImpl(ClampedSwiGLUOptions options_ = {}) : options(options_) {}
  void reset() override {}
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input);
  ClampedSwiGLUOptions options;
};
TORCH_MODULE(ClampedSwiGLU);

/// ScaledSwiGLU: y[r] = scales[r] · silu(a[r]) · b[r], with the gradient of the scales.
class ScaledSwiGLUImpl : public torch::nn::Cloneable<ScaledSwiGLUImpl> {
 public:
  explicit ScaledSwiGLUImpl(ScaledSwiGLUOptions options_ = {}) : options(options_) {}
  void reset() override {}
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& scales);
  ScaledSwiGLUOptions options;
};
TORCH_MODULE(ScaledSwiGLU);

/// ScaledClampedSwiGLU: scales[r] · ClampedSwiGLU(input[r]).
class ScaledClampedSwiGLUImpl : public torch::nn::Cloneable<ScaledClampedSwiGLUImpl> {
 public:
  explicit ScaledClampedSwiGLUImpl(ScaledClampedSwiGLUOptions options_ = {}) : options(options_) {}
  void reset() override {}
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& scales);
  ScaledClampedSwiGLUOptions options;
};
TORCH_MODULE(ScaledClampedSwiGLU);

}  // namespace torchmoe
