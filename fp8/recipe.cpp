#include "torchmoe/fp8/recipe.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace torchmoe::fp8 {
namespace {

void check_amax_epsilon(const char* recipe, double value) {
  TORCH_CHECK(std::isfinite(value) && value >= 0.0, recipe,
              ": amax_epsilon must be finite and >= 0, got ", value);
}

const char* block_name(BlockShape shape) {
  return shape == BlockShape::k1x128 ? "1x128" : "128x128";
}

}  // namespace

const char* role_name(TensorRole role) {
  switch (role) {
    case TensorRole::kInput:
      return "input";
    case TensorRole::kWeight:
      return "weight";
    case TensorRole::kGradOutput:
      return "grad_output";
  }
  TORCH_CHECK(false, "fp8::role_name: unknown TensorRole ", static_cast<int>(role));
}

DelayedScaling& DelayedScaling::margin(int64_t value) {
  // The scale targets fp8_max · 2^-margin, a float, which must stay a normal number (a target of 0
  // would make a zero scale and an infinite scale_inv): 127 keeps it one in both formats, with room
  // (e4m3's target leaves the normal range past 134, e5m2's past 141).
  TORCH_CHECK(value >= 0 && value <= 127, "DelayedScaling: margin must be in [0, 127], got ",
              value);
  margin_ = value;
  return *this;
}

DelayedScaling& DelayedScaling::amax_history_len(int64_t value) {
  TORCH_CHECK(value >= 1, "DelayedScaling: amax_history_len must be >= 1, got ", value);
  amax_history_len_ = value;
  return *this;
}

CurrentScaling& CurrentScaling::amax_epsilon(double value) {
  check_amax_epsilon("CurrentScaling", value);
  amax_epsilon_ = value;
  return *this;
}

BlockScaling& BlockScaling::amax_epsilon(double value) {
  check_amax_epsilon("BlockScaling", value);
  amax_epsilon_ = value;
  return *this;
}

void BlockScaling::validate() const {
  const int tiles = (input_block() == BlockShape::k128x128) +
                    (weight_block() == BlockShape::k128x128) +
                    (grad_block() == BlockShape::k128x128);
  TORCH_CHECK(tiles <= 1,
              "BlockScaling: at most one of input_block, weight_block and grad_block may be "
              "128x128 (each pair meets in one GEMM, and cuBLASLt has no 128x128 by 128x128 "
              "mode), got input_block=",
              block_name(input_block()), ", weight_block=", block_name(weight_block()),
              ", grad_block=", block_name(grad_block()));
}

BlockShape BlockScaling::block(TensorRole role) const {
  switch (role) {
    case TensorRole::kInput:
      return input_block();
    case TensorRole::kWeight:
      return weight_block();
    case TensorRole::kGradOutput:
      return grad_block();
  }
  TORCH_CHECK(false, "BlockScaling::block: unknown TensorRole ", static_cast<int>(role));
}

void validate(const Recipe& recipe) {
  // Values cast from integers: the quantize options would read any unknown one as a known one.
  const Format format = recipe_format(recipe);
  TORCH_CHECK(format == Format::kE4M3 || format == Format::kHybrid, recipe_name(recipe),
              ": format must be Format::kE4M3 or Format::kHybrid, got the value ",
              static_cast<int>(format));
  if (const auto* delayed = std::get_if<DelayedScaling>(&recipe)) {
    const AmaxComputeAlgo algo = delayed->amax_compute_algo();
    TORCH_CHECK(algo == AmaxComputeAlgo::kMax || algo == AmaxComputeAlgo::kMostRecent,
                "DelayedScaling: amax_compute_algo must be kMax or kMostRecent, got the value ",
                static_cast<int>(algo));
  }
  if (const auto* block = std::get_if<BlockScaling>(&recipe)) {
    for (const TensorRole role :
         {TensorRole::kInput, TensorRole::kWeight, TensorRole::kGradOutput}) {
      const BlockShape shape = block->block(role);
      TORCH_CHECK(shape == BlockShape::k1x128 || shape == BlockShape::k128x128,
                  "BlockScaling: the ", role_name(role),
                  " block must be k1x128 or k128x128, got the value ", static_cast<int>(shape));
    }
    block->validate();
  }
}

Format recipe_format(const Recipe& recipe) {
  return std::visit([](const auto& r) { return r.format(); }, recipe);
}

const char* recipe_name(const Recipe& recipe) {
  switch (recipe.index()) {
    case 0:
      return "DelayedScaling";
    case 1:
      return "CurrentScaling";
    default:
      return "BlockScaling";
  }
}

}  // namespace torchmoe::fp8
