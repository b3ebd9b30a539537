#pragma once
// The op-level description of the gated-activation options (internal: modules/glu.cpp and
// GroupedMLP's fused path; not installed).

#include "torchmoe/modules/glu.h"
#include "torchmoe/ops/glu.h"

namespace torchmoe {

ops::GluOptions glu_options(const SwiGLUOptions& options);
ops::GluOptions glu_options(const ClampedSwiGLUOptions& options);

}  // namespace torchmoe
