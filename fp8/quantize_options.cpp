#include "torchmoe/fp8/quantize_options.h"

namespace torchmoe::fp8 {
namespace {

ops::QuantizeScaling block_scaling(BlockShape shape) {
  return shape == BlockShape::k1x128 ? ops::QuantizeScaling::kBlock1x128
                                     : ops::QuantizeScaling::kBlock128x128;
}

}  // namespace

ops::SplitQuantizeOptions split_quantize_options(const Recipe& recipe, TensorRole role) {
  validate(recipe);
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

ops::DelayedScalingUpdateOptions delayed_update_options(const DelayedScaling& recipe,
                                                        TensorRole role) {
  ops::DelayedScalingUpdateOptions o;
  o.format = tensor_format(recipe.format(), role);
  o.margin = static_cast<double>(recipe.margin());
  o.algo = recipe.amax_compute_algo();
  return o;
}

}  // namespace torchmoe::fp8
