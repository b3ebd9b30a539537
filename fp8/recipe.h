#pragma once
// FP8 training recipes: how each tensor of a GroupedLinear's three GEMMs is scaled to FP8. They
// follow TransformerEngine's transformer_engine.common.recipe (DelayedScaling,
// Float8CurrentScaling, Float8BlockScaling): same fields, defaults and refusals, so that a recipe
// reads the same in both. Values with checked setters; docs/fp8.md, "Recipes".

#include <torch/arg.h>

#include <cstdint>
#include <variant>

#include "torchmoe/kernels/types.h"

namespace torchmoe::fp8 {

/// Which FP8 format each tensor takes (TE's recipe.Format). E5M2 alone is not offered: TE rejects
/// it for every recipe, forward tensors need E4M3's precision.
enum class Format {
  kE4M3,    ///< every tensor e4m3 (max 448)
  kHybrid,  ///< forward tensors (input, weight) e4m3, gradients e5m2 (max 57344)
};

/// The tensors a grouped linear layer quantizes: fprop reads input and weight, dgrad grad_output
/// and weight, wgrad grad_output and input. TE's slots of GEMM i are forward input 3i, weight
/// 3i+1, output 3i+2 and backward grad_output 2i, grad_input 2i+1; output and grad_input are never
/// quantized by its GroupedLinear, so they have no role here.
enum class TensorRole { kInput, kWeight, kGradOutput };
constexpr int kNumTensorRoles = 3;

/// "input", "weight" or "grad_output": buffer names and messages.
const char* role_name(TensorRole role);

/// Per-tensor scales from a history of amaxes (TE's DelayedScaling, its default on Hopper):
/// scale = fp8_max · 2^-margin / amax, amax the history's max or its newest entry. The quantize
/// casts with the scale of the previous update and records this step's amax; the scale follows
/// the data one update late, which is what lets the cast run in one pass. Each layer keeps the
/// histories and scales as buffers (GroupedLinearOptions::fp8_amax_history_len, fp8/state.h).
class DelayedScaling {
 public:
  /// Scale margin in powers of two: scale = fp8_max · 2^-margin / amax. In [0, 127].
  DelayedScaling& margin(int64_t value);
  int64_t margin() const { return margin_; }
  /// Steps of amax history per tensor (TE's default 1024). >= 1.
  DelayedScaling& amax_history_len(int64_t value);
  int64_t amax_history_len() const { return amax_history_len_; }
  /// kMax: the history's largest amax sets the scale; kMostRecent: the newest one.
  TORCH_ARG(AmaxComputeAlgo, amax_compute_algo) = AmaxComputeAlgo::kMax;
  TORCH_ARG(Format, format) = Format::kHybrid;
  /// Take the max of every rank's amaxes (the group of data-parallel replicas) before the update,
  /// so that all replicas keep the same scales (TE's default). Applied by the updates that are
  /// given a process group (fp8::update_delayed_scaling's `group`, fp8/state.h): one all-reduce per
  /// pass; without a group each process keeps its own amaxes.
  TORCH_ARG(bool, reduce_amax) = true;

 private:
  int64_t margin_ = 0;
  int64_t amax_history_len_ = 1024;
};

/// Per-tensor scales from the tensor itself (TE's Float8CurrentScaling): scale = fp8_max / amax of
/// this call's data, per expert. No state; costs a second read of the input (docs/fp8.md).
class CurrentScaling {
 public:
  TORCH_ARG(Format, format) = Format::kHybrid;
  /// Round scales down to powers of two (exact scale_inv; TE's force_pow_2_scales).
  TORCH_ARG(bool, power_of_2_scales) = false;
  /// Split accumulation per product (TE's fp8_gemm_fprop/dgrad/wgrad MMParams'
  /// use_split_accumulator, with its defaults): each 128-deep block of the reduction is summed by
  /// the tensor cores and added to fp32 accumulators. Off, the tensor cores accumulate the whole
  /// reduction themselves: faster, with several times the error (docs/fp8.md, "Accumulation").
  TORCH_ARG(bool, fprop_split_accumulator) = false;
  TORCH_ARG(bool, dgrad_split_accumulator) = true;
  TORCH_ARG(bool, wgrad_split_accumulator) = true;

 public:  // TORCH_ARG leaves the access private
  /// amaxes below this are raised to it (keeps the scale of tiny tensors bounded). Finite, >= 0.
  CurrentScaling& amax_epsilon(double value);
  double amax_epsilon() const { return amax_epsilon_; }

 private:
  double amax_epsilon_ = 0.0;
};

/// The blocks that share one scale: 128 consecutive elements of a row (1x128), or a 128×128 tile.
enum class BlockShape { k1x128, k128x128 };

/// Per-block scales, DeepSeek-V3 style (TE's Float8BlockScaling): 1x128 blocks for activations
/// and gradients, 128×128 for weights, power-of-2 scales. No state. E4M3 for every tensor by
/// default (the per-block scales cover the gradients' range); kHybrid makes gradients e5m2.
class BlockScaling {
 public:
  TORCH_ARG(Format, format) = Format::kE4M3;
  TORCH_ARG(bool, power_of_2_scales) = true;

 public:  // TORCH_ARG leaves the access private
  BlockScaling& amax_epsilon(double value);
  double amax_epsilon() const { return amax_epsilon_; }
  /// Block shape per tensor (TE's x/w/grad_block_scaling_dim 1 or 2). At most one of the three may
  /// be 128×128: every pair of them meets in one GEMM (fprop input·weight, dgrad
  /// grad_output·weight, wgrad grad_output·input), and cuBLASLt multiplies 1x128 by 1x128 or
  /// 128×128 blocks, never 128×128 by 128×128 (checked by validate()).
  TORCH_ARG(BlockShape, input_block) = BlockShape::k1x128;
  TORCH_ARG(BlockShape, weight_block) = BlockShape::k128x128;
  TORCH_ARG(BlockShape, grad_block) = BlockShape::k1x128;

 public:
  /// The checks between fields (the block shapes); fp8::Autocast runs it.
  void validate() const;
  /// The block shape of `role`'s tensors.
  BlockShape block(TensorRole role) const;

 private:
  double amax_epsilon_ = 0.0;
};

/// One of the three recipes. A value: copied into fp8::Autocast, and by the FP8 forward into its
/// autograd node, so backward sees the forward's recipe (docs/fp8.md).
using Recipe = std::variant<DelayedScaling, CurrentScaling, BlockScaling>;

/// Checks `recipe` (the cross-field checks; single fields are checked by their setters).
void validate(const Recipe& recipe);
/// The recipe's format.
Format recipe_format(const Recipe& recipe);
/// "DelayedScaling", "CurrentScaling" or "BlockScaling".
const char* recipe_name(const Recipe& recipe);

}  // namespace torchmoe::fp8
