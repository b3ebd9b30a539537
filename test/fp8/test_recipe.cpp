// FP8 recipes: TransformerEngine's defaults, the checks with their messages, and what each recipe
// asks of a layer call's FP8 products (fp8::gemm_options: each tensor's split-quantize, each
// product's accumulation) and of the delayed-scaling update per tensor role.

#include <torchmoe/fp8/quantize_options.h>
#include <torchmoe/fp8/recipe.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

using namespace torchmoe::fp8;
using Catch::Matchers::Contains;
using torchmoe::AmaxComputeAlgo;
using torchmoe::ops::Fp8Format;
using torchmoe::ops::QuantizeScaling;

namespace {

// gemm_options' quantize options for `role`'s tensor.
torchmoe::ops::SplitQuantizeOptions options_for(const Recipe& recipe, TensorRole role) {
  const torchmoe::ops::Fp8GemmOptions o = gemm_options(recipe);
  return role == TensorRole::kInput    ? o.input
         : role == TensorRole::kWeight ? o.weight
                                       : o.grad_output;
}

}  // namespace

TEST_CASE("FP8 recipes default to TransformerEngine's values", "[fp8][recipe]") {
  const DelayedScaling delayed;
  CHECK(delayed.margin() == 0);
  CHECK(delayed.amax_history_len() == 1024);
  CHECK(delayed.amax_compute_algo() == AmaxComputeAlgo::kMax);
  CHECK(delayed.format() == Format::kHybrid);
  CHECK(delayed.reduce_amax());
  const CurrentScaling current;
  CHECK(current.format() == Format::kHybrid);
  CHECK_FALSE(current.power_of_2_scales());
  CHECK(current.amax_epsilon() == 0.0);
  CHECK_FALSE(current.fprop_split_accumulator());
  CHECK(current.dgrad_split_accumulator());
  CHECK(current.wgrad_split_accumulator());
  const BlockScaling block;
  CHECK(block.format() == Format::kE4M3);
  CHECK(block.power_of_2_scales());
  CHECK(block.amax_epsilon() == 0.0);
  CHECK(block.input_block() == BlockShape::k1x128);
  CHECK(block.weight_block() == BlockShape::k128x128);
  CHECK(block.grad_block() == BlockShape::k1x128);
  CHECK_NOTHROW(block.validate());
}

TEST_CASE("FP8 recipe setters chain and keep their values", "[fp8][recipe]") {
  const auto delayed = DelayedScaling()
                           .margin(2)
                           .amax_history_len(16)
                           .amax_compute_algo(AmaxComputeAlgo::kMostRecent)
                           .format(Format::kE4M3)
                           .reduce_amax(false);
  CHECK(delayed.margin() == 2);
  CHECK(delayed.amax_history_len() == 16);
  CHECK(delayed.amax_compute_algo() == AmaxComputeAlgo::kMostRecent);
  CHECK(delayed.format() == Format::kE4M3);
  CHECK_FALSE(delayed.reduce_amax());
  const auto current = CurrentScaling().power_of_2_scales(true).amax_epsilon(1e-12);
  CHECK(current.power_of_2_scales());
  CHECK(current.amax_epsilon() == 1e-12);
  const Recipe recipe = BlockScaling().weight_block(BlockShape::k1x128);
  CHECK(std::string(recipe_name(recipe)) == "BlockScaling");
  CHECK(recipe_format(recipe) == Format::kE4M3);
  CHECK(std::string(recipe_name(Recipe(delayed))) == "DelayedScaling");
  CHECK(std::string(recipe_name(Recipe(current))) == "CurrentScaling");
}

TEST_CASE("FP8 recipes choose each product's accumulation as TransformerEngine's",
          "[fp8][recipe]") {
  // TE's fixed _2X_ACC_FPROP/DGRAD/WGRAD for delayed scaling, Float8CurrentScaling's MMParams
  // defaults, and block scales (applied per 128-deep block) always split.
  for (const Recipe& recipe : {Recipe(DelayedScaling()), Recipe(CurrentScaling())}) {
    INFO(recipe_name(recipe));
    const torchmoe::ops::Fp8GemmOptions o = gemm_options(recipe);
    CHECK_FALSE(o.fprop_split_accumulator);
    CHECK(o.dgrad_split_accumulator);
    CHECK(o.wgrad_split_accumulator);
  }
  const torchmoe::ops::Fp8GemmOptions block = gemm_options(BlockScaling());
  CHECK(block.fprop_split_accumulator);
  CHECK(block.dgrad_split_accumulator);
  CHECK(block.wgrad_split_accumulator);
  const torchmoe::ops::Fp8GemmOptions flipped = gemm_options(CurrentScaling()
                                                                 .fprop_split_accumulator(true)
                                                                 .dgrad_split_accumulator(false)
                                                                 .wgrad_split_accumulator(false));
  CHECK(flipped.fprop_split_accumulator);
  CHECK_FALSE(flipped.dgrad_split_accumulator);
  CHECK_FALSE(flipped.wgrad_split_accumulator);
  const torchmoe::ops::Fp8GemmOptions dgrad_only =
      gemm_options(CurrentScaling().wgrad_split_accumulator(false));
  CHECK(dgrad_only.dgrad_split_accumulator);
  CHECK_FALSE(dgrad_only.wgrad_split_accumulator);
}

TEST_CASE("FP8 recipes reject bad values with clear errors", "[fp8][recipe][errors]") {
  CHECK_THROWS_WITH(DelayedScaling().amax_history_len(0),
                    Contains("DelayedScaling: amax_history_len must be >= 1, got 0"));
  CHECK_THROWS_WITH(DelayedScaling().margin(-1),
                    Contains("DelayedScaling: margin must be in [0, 127], got -1"));
  // 127 is the bound that keeps fp8_max · 2^-margin a normal float in both formats, with room.
  CHECK_THROWS_WITH(DelayedScaling().margin(128),
                    Contains("DelayedScaling: margin must be in [0, 127], got 128"));
  CHECK_NOTHROW(DelayedScaling().margin(127));
  CHECK_THROWS_WITH(CurrentScaling().amax_epsilon(-1.0),
                    Contains("CurrentScaling: amax_epsilon must be finite and >= 0, got -1"));
  CHECK_THROWS_WITH(CurrentScaling().amax_epsilon(std::numeric_limits<double>::quiet_NaN()),
                    Contains("CurrentScaling: amax_epsilon must be finite and >= 0, got "));
  CHECK_THROWS_WITH(BlockScaling().amax_epsilon(std::numeric_limits<double>::infinity()),
                    Contains("BlockScaling: amax_epsilon must be finite and >= 0, got inf"));
  // A rejected value leaves the recipe as it was.
  DelayedScaling delayed;
  CHECK_THROWS(delayed.amax_history_len(-3));
  CHECK(delayed.amax_history_len() == 1024);

  // 128x128 blocks on two tensors that meet in a GEMM: fprop (input, weight), wgrad
  // (grad_output, input), dgrad (grad_output, weight).
  const BlockScaling two_tiles = BlockScaling().input_block(BlockShape::k128x128);
  CHECK_THROWS_WITH(two_tiles.validate(),
                    Contains("BlockScaling: at most one of input_block, weight_block and "
                             "grad_block may be 128x128"));
  CHECK_THROWS_WITH(validate(two_tiles), Contains("got input_block=128x128, weight_block=128x128, "
                                                  "grad_block=1x128"));
  CHECK_THROWS(gemm_options(two_tiles));
  CHECK_THROWS(BlockScaling()
                   .weight_block(BlockShape::k1x128)
                   .input_block(BlockShape::k128x128)
                   .grad_block(BlockShape::k128x128)
                   .validate());
  // Only the order of the setters' calls differs: the check is on the finished recipe.
  CHECK_NOTHROW(
      BlockScaling().input_block(BlockShape::k128x128).weight_block(BlockShape::k1x128).validate());
  // Enum values cast from integers, which the quantize options would read as known ones.
  CHECK_THROWS_WITH(validate(DelayedScaling().format(static_cast<Format>(7))),
                    Contains("DelayedScaling: format must be Format::kE4M3 or Format::kHybrid, "
                             "got the value 7"));
  CHECK_THROWS_WITH(
      gemm_options(DelayedScaling().amax_compute_algo(static_cast<torchmoe::AmaxComputeAlgo>(5))),
      Contains("amax_compute_algo must be kMax or kMostRecent, got the value 5"));
  CHECK_THROWS_WITH(validate(BlockScaling().grad_block(static_cast<BlockShape>(9))),
                    Contains("BlockScaling: the grad_output block must be k1x128 or k128x128, got "
                             "the value 9"));
}

TEST_CASE("FP8 formats per tensor role", "[fp8][recipe]") {
  for (TensorRole role : {TensorRole::kInput, TensorRole::kWeight, TensorRole::kGradOutput}) {
    INFO(role_name(role));
    CHECK(options_for(CurrentScaling().format(Format::kE4M3), role).format == Fp8Format::kE4M3);
    CHECK(options_for(CurrentScaling().format(Format::kHybrid), role).format ==
          (role == TensorRole::kGradOutput ? Fp8Format::kE5M2 : Fp8Format::kE4M3));
  }
  CHECK(std::string(role_name(TensorRole::kGradOutput)) == "grad_output");
}

TEST_CASE("FP8 recipes map to split-quantize options", "[fp8][recipe]") {
  SECTION("delayed") {
    const Recipe recipe = DelayedScaling();
    const auto input = options_for(recipe, TensorRole::kInput);
    CHECK(input.scaling == QuantizeScaling::kDelayed);
    CHECK(input.format == Fp8Format::kE4M3);
    CHECK(input.rowwise);
    CHECK(input.columnwise);
    CHECK_FALSE(input.power_of_2_scales);
    CHECK(options_for(recipe, TensorRole::kGradOutput).format == Fp8Format::kE5M2);
  }
  SECTION("current") {
    const Recipe recipe = CurrentScaling().power_of_2_scales(true).amax_epsilon(0.5);
    for (TensorRole role : {TensorRole::kInput, TensorRole::kWeight, TensorRole::kGradOutput}) {
      INFO(role_name(role));
      const auto o = options_for(recipe, role);
      CHECK(o.scaling == QuantizeScaling::kCurrent);
      CHECK(o.power_of_2_scales);
      CHECK(o.amax_epsilon == 0.5);
      CHECK(o.format == (role == TensorRole::kGradOutput ? Fp8Format::kE5M2 : Fp8Format::kE4M3));
    }
  }
  SECTION("block") {
    const Recipe recipe = BlockScaling().amax_epsilon(0.25);
    const auto input = options_for(recipe, TensorRole::kInput);
    const auto weight = options_for(recipe, TensorRole::kWeight);
    const auto grad = options_for(recipe, TensorRole::kGradOutput);
    CHECK(input.scaling == QuantizeScaling::kBlock1x128);
    CHECK(weight.scaling == QuantizeScaling::kBlock128x128);
    CHECK(grad.scaling == QuantizeScaling::kBlock1x128);
    CHECK(grad.format == Fp8Format::kE4M3);
    CHECK(weight.power_of_2_scales);
    CHECK(weight.amax_epsilon == 0.25);
    const Recipe hybrid = BlockScaling().format(Format::kHybrid).grad_block(BlockShape::k1x128);
    CHECK(options_for(hybrid, TensorRole::kGradOutput).format == Fp8Format::kE5M2);
  }
  SECTION("delayed-scaling update") {
    const auto recipe = DelayedScaling().margin(3).amax_compute_algo(AmaxComputeAlgo::kMostRecent);
    const auto weight = delayed_update_options(recipe, TensorRole::kWeight);
    CHECK(weight.format == Fp8Format::kE4M3);
    CHECK(weight.margin == 3.0);
    CHECK(weight.algo == AmaxComputeAlgo::kMostRecent);
    CHECK(delayed_update_options(recipe, TensorRole::kGradOutput).format == Fp8Format::kE5M2);
    CHECK(delayed_update_options(DelayedScaling(recipe).format(Format::kE4M3),
                                 TensorRole::kGradOutput)
              .format == Fp8Format::kE4M3);
  }
}
