#pragma once
// The FP8 state a layer keeps across steps for the delayed-scaling recipe: per quantized tensor
// (input, weight, grad_output) and per expert, an amax history and the scale that the next cast
// uses. A module of buffers, registered as a layer's child, so that it is saved and loaded with
// the layer (torch::save / torch::load, named_buffers) and follows ->to(device).
// docs/fp8.md, "FP8 state and checkpoints".

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <unordered_map>

#include "torchmoe/distributed/process_group.h"
#include "torchmoe/fp8/recipe.h"

namespace torchmoe::fp8 {

/// The delayed-scaling state of one tensor role, one column per expert.
struct DelayedScalingTensors {
  /// [amax_history_len, num_gemms] float32. Row 0 collects this step's amax (the quantize maxes
  /// into it across micro-batches); an update makes it the newest entry and zeroes row 0
  /// (docs/fp8.md has the order).
  torch::Tensor amax_history;
  torch::Tensor scale;      ///< [num_gemms] float32: what the next cast multiplies by (starts at 1)
  torch::Tensor scale_inv;  ///< [num_gemms] float32: 1 / scale, what the GEMMs dequantize with
};

/// Which tensors an update covers: kForward input and weight (TE updates them when the autocast
/// region that ran the forward ends), kBackward grad_output (after the backward).
enum class Pass { kForward, kBackward };

struct Fp8StateOptions {
  Fp8StateOptions(int64_t num_gemms, int64_t amax_history_len);

  TORCH_ARG(int64_t, num_gemms);
  /// The DelayedScaling recipe's amax_history_len; updates check that they agree.
  TORCH_ARG(int64_t, amax_history_len);
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

/// Buffers `<role>_amax_history`, `<role>_scale`, `<role>_scale_inv` for role in input, weight,
/// grad_output. TE keeps the same numbers per module (its scaling_fwd / scaling_bwd meta: slot 3g
/// is expert g's input, 3g+1 its weight, backward slot 2g its grad_output), pickled as one
/// `_extra_state` entry; here they are plain named tensors.
class Fp8StateImpl : public torch::nn::Cloneable<Fp8StateImpl> {
 public:
  explicit Fp8StateImpl(Fp8StateOptions options);

  /// Checks the options and registers the buffers: histories 0, scales 1 (TE's initial state).
  void reset() override;
  /// Prints `torchmoe::fp8::Fp8State(num_gemms=…, amax_history_len=…)`.
  void pretty_print(std::ostream& stream) const override;

  /// The state of `role`'s tensors (the registered buffers, not copies).
  const DelayedScalingTensors& tensors(TensorRole role) const;

  /// Runs the delayed-scaling update of `pass`'s roles in place (one launch per role): row 0
  /// becomes the newest history entry and the scales follow `recipe`. With `group` and the recipe's
  /// reduce_amax (TE's default), row 0 is first maxed over the group's ranks (reduce_amax below),
  /// so that replicas keep equal scales; without a group, or with reduce_amax false, each rank
  /// keeps its own amaxes. CUDA only: on the CPU it is the op's NotImplementedError (raised after
  /// the reduction). The recipe's amax_history_len must be the state's.
  void update(const DelayedScaling& recipe, Pass pass,
              const std::optional<ProcessGroupOptions>& group = std::nullopt);

  /// All-reduces this step's amaxes of `pass`'s roles (row 0 of their histories) with MAX over
  /// `group`'s ranks, in place and in one collective; the other rows and the scales are left as
  /// they are. Every rank of the group must call it, with a state of the same num_gemms. A group
  /// of one rank reduces nothing. CPU (Gloo) and CUDA (NCCL, waited for by the current stream).
  void reduce_amax(Pass pass, const ProcessGroupOptions& group);

  /// The state stays float32 whatever dtype its layer is converted to: the scales are fp32 in
  /// every FP8 GEMM, and a bf16 amax history would round the scales.
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;

  /// Copies the buffers found in `state` (keys as the buffer names) into place; a checkpoint
  /// without them (a run without FP8) leaves the initial state. Shapes must match: a different
  /// amax_history_len or expert count is an error, not a silent resize.
  void load_state_dict(const std::unordered_map<std::string, torch::Tensor>& state);
  /// load_state_dict's checks alone (keys and shapes), so that a layer loading its own tensors
  /// too can check everything before it copies anything. `key_prefix` is what the caller's state
  /// dict names these keys with (GroupedLinear's "fp8_state."), for the error messages.
  void check_state_dict(const std::unordered_map<std::string, torch::Tensor>& state,
                        const std::string& key_prefix = "") const;
  /// The buffers an archive of this state holds, by name (for load_state_dict).
  std::unordered_map<std::string, torch::Tensor> read(
      torch::serialize::InputArchive& archive) const;
  /// torch::load support, with load_state_dict's rules.
  void load(torch::serialize::InputArchive& archive) override;

  Fp8StateOptions options;

 private:
  // The buffers by name, in registration order (so that a mismatch names the same one each time).
  std::vector<std::pair<std::string, torch::Tensor>> named_state() const;

  std::array<DelayedScalingTensors, kNumTensorRoles> roles_;
};

/// A `ModuleHolder` subclass for `Fp8StateImpl`.
TORCH_MODULE(Fp8State);

/// Runs Fp8StateImpl::update on every FP8 state in `model` (itself and all its descendants:
/// GroupedLinear, GroupedMLP, MoELayer or a user's model) and returns how many it updated. With
/// `group` and the recipe's reduce_amax, the amaxes of all of them are maxed over the group's
/// ranks first, in one collective for the whole model (fp8::reduce_amax).
int64_t update_delayed_scaling(torch::nn::Module& model, const DelayedScaling& recipe, Pass pass,
                               const std::optional<ProcessGroupOptions>& group = std::nullopt);

/// Fp8StateImpl::reduce_amax for every FP8 state in `model`, as one all-reduce of one buffer (row
/// 0 of each state's `pass` histories, in module order) rather than one per layer; returns how
/// many states it reduced. Every rank of the group must call it with the same model structure
/// (the same FP8 layers with the same num_gemms, in the same order), and all the states must be
/// on one device. A group of one rank, or a model without FP8 state, runs no collective.
int64_t reduce_amax(torch::nn::Module& model, Pass pass, const ProcessGroupOptions& group);

}  // namespace torchmoe::fp8
