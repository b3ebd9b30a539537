#include "torchmoe/fp8/state.h"

#include <torch/utils.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "torchmoe/fp8/quantize_options.h"

namespace torchmoe::fp8 {
namespace {

constexpr const char* kModule = "fp8::Fp8State";
constexpr std::array<TensorRole, kNumTensorRoles> kRoles = {TensorRole::kInput, TensorRole::kWeight,
                                                            TensorRole::kGradOutput};

std::vector<TensorRole> pass_roles(Pass pass) {
  if (pass == Pass::kForward) return {TensorRole::kInput, TensorRole::kWeight};
  return {TensorRole::kGradOutput};
}

// The buffers of one role with their names, in registration order.
std::array<std::pair<std::string, torch::Tensor>, 3> named(TensorRole role,
                                                           const DelayedScalingTensors& t) {
  const std::string prefix = role_name(role);
  return {{{prefix + "_amax_history", t.amax_history},
           {prefix + "_scale", t.scale},
           {prefix + "_scale_inv", t.scale_inv}}};
}

}  // namespace

Fp8StateOptions::Fp8StateOptions(int64_t num_gemms, int64_t amax_history_len)
    : num_gemms_(num_gemms), amax_history_len_(amax_history_len) {}

Fp8StateImpl::Fp8StateImpl(Fp8StateOptions options_) : options(std::move(options_)) { reset(); }

void Fp8StateImpl::reset() {
  TORCH_CHECK(options.num_gemms() > 0, kModule, ": num_gemms must be positive, got ",
              options.num_gemms());
  TORCH_CHECK(options.amax_history_len() >= 1, kModule, ": amax_history_len must be >= 1, got ",
              options.amax_history_len());
  const auto fp32 = torch::TensorOptions().dtype(torch::kFloat32).device(options.device());
  for (TensorRole role : kRoles) {
    DelayedScalingTensors& t = roles_[static_cast<int>(role)];
    t.amax_history = torch::zeros({options.amax_history_len(), options.num_gemms()}, fp32);
    t.scale = torch::ones({options.num_gemms()}, fp32);
    t.scale_inv = torch::ones({options.num_gemms()}, fp32);
    for (auto& [name, tensor] : named(role, t)) register_buffer(name, tensor);
  }
}

void Fp8StateImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmoe::fp8::Fp8State(num_gemms=" << options.num_gemms()
         << ", amax_history_len=" << options.amax_history_len() << ")";
}

const DelayedScalingTensors& Fp8StateImpl::tensors(TensorRole role) const {
  return roles_[static_cast<int>(role)];
}

void Fp8StateImpl::update(const DelayedScaling& recipe, Pass pass) {
  TORCH_CHECK(recipe.amax_history_len() == options.amax_history_len(), kModule,
              "::update: the recipe's amax_history_len must be the state's ",
              options.amax_history_len(), " (the layer's fp8_amax_history_len), got ",
              recipe.amax_history_len());
  for (TensorRole role : pass_roles(pass)) {
    const DelayedScalingTensors& t = tensors(role);
    // Row 0 is this step's amax; the op reads it before rolling the history over it.
    ops::update_delayed_scaling(t.amax_history, t.amax_history[0], t.scale, t.scale_inv,
                                delayed_update_options(recipe, role));
  }
}

void Fp8StateImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
}

void Fp8StateImpl::to(torch::Dtype /*dtype*/, bool /*non_blocking*/) {}

void Fp8StateImpl::load_state_dict(const std::unordered_map<std::string, torch::Tensor>& state) {
  // In registration order, so that a mismatch names the same buffer every time.
  std::vector<std::pair<std::string, torch::Tensor>> buffers;
  for (TensorRole role : kRoles) {
    for (auto& entry : named(role, tensors(role))) buffers.push_back(std::move(entry));
  }
  for (const auto& [key, value] : state) {
    const bool known = std::any_of(buffers.begin(), buffers.end(),
                                   [&](const auto& buffer) { return buffer.first == key; });
    TORCH_CHECK(known, kModule, "::load_state_dict: unexpected key '", key, "'");
  }
  // Every shape is checked before anything is copied: a rejected checkpoint leaves the state whole.
  for (const auto& [name, target] : buffers) {
    const auto it = state.find(name);
    TORCH_CHECK(it == state.end() || it->second.sizes() == target.sizes(), kModule, ": '", name,
                "' must have shape ", target.sizes(), " (num_gemms=", options.num_gemms(),
                ", amax_history_len=", options.amax_history_len(), "), got ", it->second.sizes());
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, target] : buffers) {
    if (const auto it = state.find(name); it != state.end()) target.copy_(it->second);
  }
}

void Fp8StateImpl::load(torch::serialize::InputArchive& archive) {
  std::unordered_map<std::string, torch::Tensor> state;
  for (TensorRole role : kRoles) {
    for (const auto& entry : named(role, tensors(role))) {
      torch::Tensor value;
      if (archive.try_read(entry.first, value, /*is_buffer=*/true)) {
        state.emplace(entry.first, value);
      }
    }
  }
  load_state_dict(state);
}

int64_t update_delayed_scaling(torch::nn::Module& model, const DelayedScaling& recipe, Pass pass) {
  int64_t updated = 0;
  model.apply([&](torch::nn::Module& module) {
    if (auto* state = dynamic_cast<Fp8StateImpl*>(&module)) {
      state->update(recipe, pass);
      ++updated;
    }
  });
  return updated;
}

}  // namespace torchmoe::fp8
