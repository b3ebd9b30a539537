#pragma once
// A composite module's torch::load, all or nothing (used by GroupedMLP and MoELayer; not
// installed). Module::load loads the children one after the other, each checking its own entries
// (GroupedLinear, TopKRouter): a refusal by a later child would leave the earlier ones loaded.

#include <torch/nn/module.h>

#include <functional>

namespace torchmoe::detail {

// Runs `load`; if it throws, every parameter and buffer of `module` gets back the values (and
// shape and dtype) it held before, and the exception goes on.
void load_all_or_nothing(torch::nn::Module& module, const std::function<void()>& load);

}  // namespace torchmoe::detail
