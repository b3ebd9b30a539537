#include "torchmoe/modules/module_load.h"

#include <utility>
#include <vector>

namespace torchmoe::detail {

void load_all_or_nothing(torch::nn::Module& module, const std::function<void()>& load) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> before;  // (the tensor, a copy of it)
  {
    const torch::NoGradGuard no_grad;
    for (const torch::Tensor& t : module.parameters()) before.emplace_back(t, t.detach().clone());
    for (const torch::Tensor& t : module.buffers()) before.emplace_back(t, t.clone());
  }
  try {
    load();
  } catch (...) {
    const torch::NoGradGuard no_grad;
    for (auto& [tensor, copy] : before) {
      // The children's own loads copy into their tensors; set_data covers one that replaced them.
      if (tensor.sizes() == copy.sizes() && tensor.dtype() == copy.dtype() &&
          tensor.device() == copy.device()) {
        tensor.copy_(copy);
      } else {
        tensor.set_data(copy);
      }
    }
    throw;
  }
}

}  // namespace torchmoe::detail
