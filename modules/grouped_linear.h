#pragma once
// GroupedLinear: G independent linear maps applied to G consecutive row blocks of one input,
// y[rows of g] = x[rows of g] · W_gᵀ + b_g, the C++ counterpart of TransformerEngine's
// te.pytorch.GroupedLinear.

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/types.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <unordered_map>
#include <vector>

#include "torchmoe/fp8/state.h"
#include "torchmoe/ops/types.h"
#include "torchmoe/optim/fp8_weight_target.h"

namespace torchmoe {
namespace detail {
struct GroupedLinearState;  // modules/grouped_linear_calls.h (internal)
struct GroupedLinearCalls;
}  // namespace detail

class GroupedMLPImpl;

// Tensor-parallel layout of the layer (shapes and metadata only; no communication happens here).
enum class ParallelMode { kNone, kRow, kColumn };

/// Options for the `GroupedLinear` module.
///
/// Example:
/// ```
/// torchmoe::GroupedLinear fc1(torchmoe::GroupedLinearOptions(/*num_gemms=*/8, 1024, 4096)
///                                 .params_dtype(torch::kBFloat16)
///                                 .device(torch::kCUDA)
///                                 .fuse_wgrad_accumulation(true));
/// ```
struct GroupedLinearOptions {
  GroupedLinearOptions(int64_t num_gemms, int64_t in_features, int64_t out_features);

  /// Number of experts (independent GEMMs).
  TORCH_ARG(int64_t, num_gemms);
  /// Size of each input row (before tensor-parallel partitioning).
  TORCH_ARG(int64_t, in_features);
  /// Size of each output row (before tensor-parallel partitioning).
  TORCH_ARG(int64_t, out_features);
  /// Learn an additive bias per expert.
  TORCH_ARG(bool, bias) = true;
  /// dtype of the parameters at construction (`->to(dtype)` changes it later); the input must have
  /// the parameters' dtype.
  TORCH_ARG(torch::Dtype, params_dtype) = torch::kFloat32;
  /// Device of the parameters.
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// Called once per expert with its [out, in] weight (under no-grad); replaces the default
  /// (kaiming_uniform_ with a = sqrt(5), as torch::nn::Linear).
  TORCH_ARG(std::function<void(torch::Tensor&)>, init_method) = nullptr;
  /// Add weight gradients into fp32 main-grad buffers (main_grads()) instead of `.grad`.
  TORCH_ARG(bool, fuse_wgrad_accumulation) = false;
  /// backward computes the input and bias gradients only; backward_dw() runs the weight gradients.
  TORCH_ARG(bool, delay_wgrad_compute) = false;
  /// Store all weights as one parameter `weight` [G, out, in] instead of `weight0..weight{G-1}`.
  TORCH_ARG(bool, single_grouped_weight) = false;
  /// Store all biases as one parameter `bias` [G, out] instead of `bias0..bias{G-1}`.
  TORCH_ARG(bool, single_grouped_bias) = false;
  /// Which grouped GEMM runs the layer (see GemmBackend).
  TORCH_ARG(GemmBackend, gemm_backend) = GemmBackend::kAuto;
  /// Row: in_features is split over tp_size ranks; column: out_features is.
  TORCH_ARG(ParallelMode, parallel_mode) = ParallelMode::kNone;
  /// Tensor-parallel world size.
  TORCH_ARG(int64_t, tp_size) = 1;
  /// > 0: keep FP8 delayed-scaling state (fp8_state()) with this many steps of amax history, the
  /// DelayedScaling recipe's amax_history_len. Registered at construction, so that torch::load
  /// into a freshly built layer restores it. 0: no FP8 state and no extra buffers.
  TORCH_ARG(int64_t, fp8_amax_history_len) = 0;
  /// Under DelayedScaling, a FusedAdamW that steps all of the layer's weights (as its float32
  /// parameters, or as the model copies of its float32 masters) writes their FP8 copies with each
  /// update (fp8_weight_target, which says what it needs), and forwards read them instead of
  /// casting the weights: the layer offers them at its first forward under DelayedScaling, the
  /// optimizer takes them at its next step. false: forwards cast the weights unless a target is
  /// given to FusedAdamW::set_fp8_weights.
  TORCH_ARG(bool, fp8_weights_from_optimizer) = true;
};

/// Megatron-style tensor-parallel attributes of one parameter.
struct TensorParallelAttributes {
  bool is_parallel = false;
  int64_t partition_dim = -1;
  int64_t partition_stride = 1;
};

/// See the file comment. Parameters are named as in TransformerEngine (`weight0..`, `bias0..`, or
/// `weight` / `bias` with the single grouped layouts), so checkpoints map one to one.
class GroupedLinearImpl : public torch::nn::Cloneable<GroupedLinearImpl> {
 public:
  GroupedLinearImpl(int64_t num_gemms, int64_t in_features, int64_t out_features)
      : GroupedLinearImpl(GroupedLinearOptions(num_gemms, in_features, out_features)) {}
  explicit GroupedLinearImpl(GroupedLinearOptions options);

  /// Validates the options and (re)creates parameters and main-grad buffers.
  void reset() override;
  /// Re-initialises the parameters in place.
  void reset_parameters();

  /// Prints `torchmoe::GroupedLinear(num_gemms=…, in_features=…, out_features=…, bias=…)`.
  void pretty_print(std::ostream& stream) const override;

  /// input [..., in_features] (any strides); m_splits: rows per expert (host sizes or an integer
  /// tensor), summing to the number of rows (input.numel() / in_features); zeros are allowed.
  /// Sizes that stay on the device are not checked: a sum below the rows (capacity padding) leaves
  /// the output rows past it unwritten (docs/grouped_linear.md, "Behaviour", Splits).
  /// Returns [..., out_features]. is_first_microbatch == true makes fused main-grad accumulation
  /// overwrite instead of add.
  torch::Tensor forward(const torch::Tensor& input, const SplitSizes& m_splits,
                        std::optional<bool> is_first_microbatch = std::nullopt);

  /// Runs the oldest queued weight-gradient computation (delay_wgrad_compute) and adds its result
  /// into `.grad` (or the main-grad buffers) exactly as backward would have.
  void backward_dw();
  /// Number of weight-gradient computations waiting for backward_dw().
  int64_t pending_wgrad_count() const;
  /// Throws naming `where` when delayed weight-gradient work is queued: what to() and clone()
  /// refuse (the queued work writes into this layer's main grads on its device).
  void check_no_queued_wgrad(const char* where) const;

  /// fp32 main-grad buffers: G tensors [out, in], or one [G, out, in] with single_grouped_weight.
  /// Empty unless fuse_wgrad_accumulation.
  std::vector<torch::Tensor> main_grads() const;
  /// Replaces the main-grad buffers (e.g. with views into one flat buffer). Shapes as main_grads(),
  /// float32, contiguous, on the parameters' device.
  void set_main_grads(std::vector<torch::Tensor> buffers);

  /// As torch::nn::Module's, and the main-grad buffers follow the parameters to a new device (as
  /// float32 copies: buffers given to set_main_grads are then the module's own again). Refused
  /// while delayed weight-gradient computations are queued.
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  /// Cloneable's deep copy, with its main grads (fuse_wgrad_accumulation) on the device of its
  /// parameters, which need not be options.device() after to() or with `device` (their contents
  /// are not copied, as a parameter's .grad is not). Refused while delayed weight-gradient
  /// computations are queued.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  /// The weight parameters as registered: G tensors [out, in], or one [G, out, in] with
  /// single_grouped_weight.
  const std::vector<torch::Tensor>& weight_parameters() const { return weight_params_; }

  /// For an optimizer that writes the layer's FP8 weights with each update
  /// (optim::FusedAdamW::set_fp8_weights): the delayed-scaling copies to write, allocated on the
  /// first call of its `copies` (rowwise and columnwise e4m3 and scale_inv, with the weight scales
  /// and current amax row of the layer's FP8 state), and the call that says they have been written
  /// from the current weights. From then on forwards under DelayedScaling read them instead of
  /// quantizing the weights, until a weight parameter's version counter moves (an in-place ATen op
  /// such as load_state_dict's copies, or a FusedAdamW's write of the parameter as a model copy;
  /// writes that bypass both, such as a raw kernel's or variable_data()'s, are not seen) or `to()`
  /// moves or converts the layer. Needs the FP8 state (fp8_amax_history_len > 0), in and out
  /// features that are multiples of 16, and the layer held by a GroupedLinear (the target keeps it
  /// alive).
  optim::Fp8WeightTarget fp8_weight_target() const;

  /// Per-expert [out, in] weights and [out] biases (views into the grouped parameters when used).
  std::vector<torch::Tensor> expert_weights() const;
  std::vector<torch::Tensor> expert_biases() const;

  /// Tensor-parallel attributes of a parameter by name (`weight3`, `weight`, `bias0`, ...).
  TensorParallelAttributes tensor_parallel_attributes(const std::string& parameter_name) const;

  /// The FP8 delayed-scaling state, child module `fp8_state` (buffers `fp8_state.input_scale`,
  /// ...); an empty holder when fp8_amax_history_len is 0. fp8::update_delayed_scaling updates it.
  fp8::Fp8State fp8_state() const { return fp8_state_; }

  /// Loads parameters saved in either layout (`weight0..` or `weight`, `bias0..` or `bias`), and
  /// the FP8 state's `fp8_state.*` entries (Fp8StateImpl::load_state_dict's rules; ignored by a
  /// layer without FP8 state, as torch::load ignores them).
  void load_state_dict(const std::unordered_map<std::string, torch::Tensor>& state_dict);
  /// torch::load support for both layouts and the FP8 state.
  void load(torch::serialize::InputArchive& archive) override;

  /// The options this module was built with.
  GroupedLinearOptions options;
  /// Features per tensor-parallel partition.
  int64_t in_features_per_partition = 0;
  int64_t out_features_per_partition = 0;

 private:
  // GroupedMLP plans fc1 and fc2 together and runs fc2 with its activation fused in front, through
  // detail::GroupedLinearCalls (modules/grouped_linear_calls.h).
  friend class GroupedMLPImpl;
  friend struct detail::GroupedLinearCalls;

  // Checks an input of `width` features against the parameters; returns it as [rows, width].
  torch::Tensor input_rows(const torch::Tensor& input, int64_t width) const;
  void move_main_grads(torch::Device device);
  void pack_weights(torch::Device device, torch::Dtype dtype, bool non_blocking);
  void drop_fp8_weight_copies();
  // The copies an optimizer writes (fp8_weight_target), allocated on the first call.
  optim::Fp8WeightCopies optimizer_fp8_weights() const;
  // Why fp8_weight_target() refuses this layer; empty when it does not.
  std::string fp8_weight_target_refusal() const;
  // fp8_weights_from_optimizer: offers fp8_weight_target() to the optimizers, once.
  void offer_fp8_weights() const;
  std::vector<torch::Tensor> weight_params_;  // as registered: G tensors, or one grouped tensor
  std::vector<torch::Tensor> bias_params_;
  std::vector<torch::Tensor> main_grads_;
  fp8::Fp8State fp8_state_{nullptr};
  // The delayed-wgrad queue and the FP8 weight cache, shared with the calls' configs.
  std::shared_ptr<detail::GroupedLinearState> calls_state_;
};

/// A `ModuleHolder` subclass for `GroupedLinearImpl`; see `GroupedLinearImpl` and
/// `GroupedLinearOptions`.
TORCH_MODULE(GroupedLinear);

}  // namespace torchmoe
