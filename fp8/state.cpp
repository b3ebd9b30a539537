#include "torchmoe/fp8/state.h"

#include <ATen/ATen.h>
#include <torch/utils.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "torchmoe/distributed/collectives.h"
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

void check_recipe(const Fp8StateOptions& options, const DelayedScaling& recipe) {
  TORCH_CHECK(recipe.amax_history_len() == options.amax_history_len(), kModule,
              "::update: the recipe's amax_history_len must be the state's ",
              options.amax_history_len(), " (the layer's fp8_amax_history_len), got ",
              recipe.amax_history_len());
}

// The FP8 states in `model`, in apply's (registration) order: the same order on every rank that
// built the same model, which is what lets their amaxes share one collective buffer.
std::vector<Fp8StateImpl*> states_in(torch::nn::Module& model) {
  std::vector<Fp8StateImpl*> states;
  model.apply([&](torch::nn::Module& module) {
    if (auto* state = dynamic_cast<Fp8StateImpl*>(&module)) states.push_back(state);
  });
  return states;
}

// Row 0 of the histories of `pass`'s roles of `states`, maxed over the group in one all-reduce:
// of the row itself when there is one (a contiguous view), else of their concatenation, copied
// back with one multi-tensor copy. TE likewise reduces all amaxes of a step as one buffer: the
// collective's latency, not its few bytes, is its cost.
void reduce_rows(const char* fn, const std::vector<Fp8StateImpl*>& states, Pass pass,
                 const ProcessGroupOptions& group) {
  TORCH_CHECK(group.group(), fn, ": the process group must be defined, got a null group");
  if (states.empty() || group.group()->getSize() == 1) return;
  std::vector<torch::Tensor> rows;
  for (const Fp8StateImpl* state : states) {
    for (TensorRole role : pass_roles(pass)) rows.push_back(state->tensors(role).amax_history[0]);
  }
  const torch::Device device = rows.front().device();
  for (const torch::Tensor& row : rows) {
    TORCH_CHECK(row.device() == device, fn, ": every FP8 state must be on one device, got ", device,
                " and ", row.device());
  }
  torch::NoGradGuard no_grad;
  if (rows.size() == 1) {
    distributed::all_reduce_max_(rows.front(), group);
    return;
  }
  torch::Tensor buffer = torch::cat(rows);
  distributed::all_reduce_max_(buffer, group);
  std::vector<int64_t> sizes;
  for (const torch::Tensor& row : rows) sizes.push_back(row.numel());
  at::_foreach_copy_(rows, buffer.split_with_sizes(sizes));
}

}  // namespace

Fp8StateOptions::Fp8StateOptions(int64_t num_gemms, int64_t amax_history_len)
    : num_gemms_(num_gemms), amax_history_len_(amax_history_len) {}

Fp8StateImpl::Fp8StateImpl(Fp8StateOptions options_) : options(std::move(options_)) { reset(); }

void Fp8StateImpl::reset() {
  // As GroupedLinear::reset: buffers cannot be registered twice, and the tensors the quantize
  // writes must stay the registered ones.
  TORCH_CHECK(named_buffers(/*recurse=*/false).is_empty(), kModule,
              "::reset: the state is built already; build a new one or clone() it");
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

void Fp8StateImpl::update(const DelayedScaling& recipe, Pass pass,
                          const std::optional<ProcessGroupOptions>& group) {
  check_recipe(options, recipe);
  if (group && recipe.reduce_amax()) reduce_amax(pass, *group);
  for (TensorRole role : pass_roles(pass)) {
    const DelayedScalingTensors& t = tensors(role);
    // Row 0 is this step's amax; the op reads it before rolling the history over it.
    ops::update_delayed_scaling(t.amax_history, t.amax_history[0], t.scale, t.scale_inv,
                                delayed_update_options(recipe, role));
  }
}

void Fp8StateImpl::reduce_amax(Pass pass, const ProcessGroupOptions& group) {
  reduce_rows("fp8::Fp8State::reduce_amax", {this}, pass, group);
}

void Fp8StateImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
}

void Fp8StateImpl::to(torch::Dtype /*dtype*/, bool /*non_blocking*/) {}

std::vector<std::pair<std::string, torch::Tensor>> Fp8StateImpl::named_state() const {
  std::vector<std::pair<std::string, torch::Tensor>> buffers;
  for (TensorRole role : kRoles) {
    for (auto& entry : named(role, tensors(role))) buffers.push_back(std::move(entry));
  }
  return buffers;
}

void Fp8StateImpl::check_state_dict(const std::unordered_map<std::string, torch::Tensor>& state,
                                    const std::string& key_prefix) const {
  const auto buffers = named_state();
  for (const auto& [key, value] : state) {
    const bool known = std::any_of(buffers.begin(), buffers.end(),
                                   [&](const auto& buffer) { return buffer.first == key; });
    TORCH_CHECK(known, kModule, "::load_state_dict: unexpected key '", key_prefix, key, "'");
  }
  for (const auto& [name, target] : buffers) {
    const auto it = state.find(name);
    TORCH_CHECK(it == state.end() || it->second.sizes() == target.sizes(), kModule, ": '",
                key_prefix, name, "' must have shape ", target.sizes(),
                " (num_gemms=", options.num_gemms(),
                ", amax_history_len=", options.amax_history_len(), "), got ", it->second.sizes());
  }
}

void Fp8StateImpl::load_state_dict(const std::unordered_map<std::string, torch::Tensor>& state) {
  // Everything is checked before anything is copied: a rejected checkpoint leaves the state whole.
  check_state_dict(state);
  torch::NoGradGuard no_grad;
  for (auto& [name, target] : named_state()) {
    if (const auto it = state.find(name); it != state.end()) target.copy_(it->second);
  }
}

std::unordered_map<std::string, torch::Tensor> Fp8StateImpl::read(
    torch::serialize::InputArchive& archive) const {
  std::unordered_map<std::string, torch::Tensor> state;
  for (const auto& [name, target] : named_state()) {
    torch::Tensor value;
    if (archive.try_read(name, value, /*is_buffer=*/true)) state.emplace(name, value);
  }
  return state;
}

void Fp8StateImpl::load(torch::serialize::InputArchive& archive) { load_state_dict(read(archive)); }

int64_t update_delayed_scaling(torch::nn::Module& model, const DelayedScaling& recipe, Pass pass,
                               const std::optional<ProcessGroupOptions>& group) {
  const std::vector<Fp8StateImpl*> states = states_in(model);
  // Every state's recipe is checked before the collective: a bad recipe fails before any rank
  // communicates, and leaves every state as it was.
  for (const Fp8StateImpl* state : states) check_recipe(state->options, recipe);
  if (group && recipe.reduce_amax()) reduce_rows("fp8::reduce_amax", states, pass, *group);
  for (Fp8StateImpl* state : states) state->update(recipe, pass);
  return static_cast<int64_t>(states.size());
}

int64_t reduce_amax(torch::nn::Module& model, Pass pass, const ProcessGroupOptions& group) {
  const std::vector<Fp8StateImpl*> states = states_in(model);
  reduce_rows("fp8::reduce_amax", states, pass, group);
  return static_cast<int64_t>(states.size());
}

}  // namespace torchmoe::fp8
