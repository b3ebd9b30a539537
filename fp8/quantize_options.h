#pragma once
// The one reading of a recipe for the ops (internal, not installed): what FP8 runs in a grouped
// linear layer call (ops::Fp8GemmOptions: each tensor's quantize options, each product's
// accumulation), which ops::plan_grouped_gemms takes and keeps in the plan; and the
// delayed-scaling update of a tensor's state (fp8/state.cpp). Nothing else interprets a recipe.

#include <optional>

#include "torchmoe/fp8/recipe.h"
#include "torchmoe/ops/fp8_options.h"
#include "torchmoe/ops/quantize.h"

namespace torchmoe::fp8 {

/// What `recipe` asks of a layer call's FP8 products: per tensor its format (e5m2 gradients under
/// kHybrid), scaling (kDelayed, kCurrent, or the role's block shape), power-of-2 scales and amax
/// epsilon, both copies asked for; per product split accumulation (CurrentScaling's fields,
/// DelayedScaling TE's fixed choice: fprop no, dgrad and wgrad yes; BlockScaling always, its
/// scales applying per 128-deep block).
ops::Fp8GemmOptions gemm_options(const Recipe& recipe);

/// gemm_options of the recipe of the enclosing fp8::Autocast, or none outside one: what a module
/// hands ops::plan_grouped_gemms.
std::optional<ops::Fp8GemmOptions> current_gemm_options();

/// ops::update_delayed_scaling's options for `role`'s state under `recipe`.
ops::DelayedScalingUpdateOptions delayed_update_options(const DelayedScaling& recipe,
                                                        TensorRole role);

}  // namespace torchmoe::fp8
