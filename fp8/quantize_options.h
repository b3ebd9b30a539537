#pragma once
// What a recipe asks of the split-quantize ops for each tensor of a grouped linear layer: the
// bridge between the public recipes (fp8/recipe.h) and ops/quantize.h. Not installed: the FP8
// autograd Function and fp8/state.cpp call it.

#include "torchmoe/fp8/recipe.h"
#include "torchmoe/ops/quantize.h"

namespace torchmoe::fp8 {

/// ops::split_quantize's options for `role`'s tensors under `recipe`: its format (e5m2 gradients
/// under kHybrid), scaling (kDelayed, kCurrent, or the role's block shape), power-of-2 scales and
/// amax epsilon. Both copies are asked for; the caller drops the one its GEMMs do not read.
ops::SplitQuantizeOptions split_quantize_options(const Recipe& recipe, TensorRole role);

/// ops::update_delayed_scaling's options for `role`'s state under `recipe`.
ops::DelayedScalingUpdateOptions delayed_update_options(const DelayedScaling& recipe,
                                                        TensorRole role);

}  // namespace torchmoe::fp8
