#include "torchmoe/fp8/quantize_options.h"

#include "torchmoe/fp8/autocast.h"

namespace torchmoe::fp8 {
namespace {

// The FP8 dtype of `role`'s tensors under `format`.
ops::Fp8Format tensor_format(Format format, TensorRole role) {
  return format == Format::kHybrid && role == TensorRole::kGradOutput ? ops::Fp8Format::kE5M2
                                                                      : ops::Fp8Format::kE4M3;
}

ops::QuantizeScaling block_scaling(BlockShape shape) {
  return shape == BlockShape::k1x128 ? ops::QuantizeScaling::kBlock1x128
                                     : ops::QuantizeScaling::kBlock128x128;
}

ops::SplitQuantizeOptions split_quantize_options(const Recipe& recipe, TensorRole role) {
  ops::SplitQuantizeOptions o;
  o.format = tensor_format(recipe_format(recipe), role);
  if (std::holds_alternative<DelayedScaling>(recipe)) {
    o.scaling = ops::QuantizeScaling::kDelayed;
  } else if (const auto* current = std::get_if<CurrentScaling>(&recipe)) {
    o.scaling = ops::QuantizeScaling::kCurrent;
    o.power_of_2_scales = current->power_of_2_scales();
    o.amax_epsilon = current->amax_epsilon();
  } else {
    const auto& block = std::get<BlockScaling>(recipe);
    o.scaling = block_scaling(block.block(role));
    o.power_of_2_scales = block.power_of_2_scales();
    o.amax_epsilon = block.amax_epsilon();
  }
  return o;
}

}  // namespace

ops::Fp8GemmOptions gemm_options(const Recipe& recipe) {
  validate(recipe);
  ops::Fp8GemmOptions o;
  o.input = split_quantize_options(recipe, TensorRole::kInput);
  o.weight = split_quantize_options(recipe, TensorRole::kWeight);
  o.grad_output = split_quantize_options(recipe, TensorRole::kGradOutput);
  if (const auto* current = std::get_if<CurrentScaling>(&recipe)) {
    o.fprop_split_accumulator = current->fprop_split_accumulator();
    o.dgrad_split_accumulator = current->dgrad_split_accumulator();
    o.wgrad_split_accumulator = current->wgrad_split_accumulator();
  } else {
    o.fprop_split_accumulator = std::holds_alternative<BlockScaling>(recipe);
    o.dgrad_split_accumulator = true;
    o.wgrad_split_accumulator = true;
  }
  return o;
}

std::optional<ops::Fp8GemmOptions> current_gemm_options() {
  const std::optional<Recipe> recipe = current();
  if (!recipe) return std::nullopt;
  return gemm_options(*recipe);
}

ops::DelayedScalingUpdateOptions delayed_update_options(const DelayedScaling& recipe,
                                                        TensorRole role) {
  ops::DelayedScalingUpdateOptions o;
  o.format = tensor_format(recipe.format(), role);
  o.margin = static_cast<double>(recipe.margin());
  o.algo = recipe.amax_compute_algo();
  return o;
}

}  // namespace torchmoe::fp8
