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

#include "torchmoe/autograd/grouped_linear_function.h"

namespace torchmoe {

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
  /// dtype of the parameters; the input must have the same dtype.
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
  /// Which grouped GEMM runs the layer (kAuto: the sm90 kernel where it applies, else per-group
  /// cuBLASLt; TORCHMOE_GROUPED_GEMM_BACKEND overrides kAuto). See ops::select_backend.
  TORCH_ARG(ops::GemmBackendChoice, gemm_backend) = ops::GemmBackendChoice::kAuto;
  /// Row: in_features is split over tp_size ranks; column: out_features is.
  TORCH_ARG(ParallelMode, parallel_mode) = ParallelMode::kNone;
  /// Tensor-parallel world size.
  TORCH_ARG(int64_t, tp_size) = 1;
};

/// Rows per expert, given either on the host (a vector, brace list or IntArrayRef) or as a 1-D
/// integer tensor (CPU or CUDA). One type rather than two forward overloads, because
/// ModuleHolder::operator() (`layer(x, splits)`) only works with a single forward. A CUDA tensor
/// stays on the device when the sm90 grouped GEMM runs the layer (no host sync, CUDA-graph safe);
/// see ops::GroupSplits.
using SplitSizes = ops::GroupSplits;

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
  /// Returns [..., out_features]. is_first_microbatch == true makes fused main-grad accumulation
  /// overwrite instead of add.
  torch::Tensor forward(const torch::Tensor& input, const SplitSizes& m_splits,
                        std::optional<bool> is_first_microbatch = std::nullopt);

  /// forward(glu(pre_activation, scales)) with the gated activation fused in front: the layer
  /// saves the pre-activation [..., 2·in_features] and the per-row scales instead of the
  /// activation and recomputes it in backward (GroupedMLP's recompute_activation). Both inputs
  /// receive gradients.
  torch::Tensor forward_with_activation(const torch::Tensor& pre_activation,
                                        const torch::Tensor& scales,
                                        const ops::GluOptions& activation,
                                        const SplitSizes& m_splits,
                                        std::optional<bool> is_first_microbatch = std::nullopt);

  /// Runs the oldest queued weight-gradient computation (delay_wgrad_compute) and adds its result
  /// into `.grad` (or the main-grad buffers) exactly as backward would have.
  void backward_dw();
  /// Number of weight-gradient computations waiting for backward_dw().
  int64_t pending_wgrad_count() const;

  /// fp32 main-grad buffers: G tensors [out, in], or one [G, out, in] with single_grouped_weight.
  /// Empty unless fuse_wgrad_accumulation.
  std::vector<torch::Tensor> main_grads() const;
  /// Replaces the main-grad buffers (e.g. with views into one flat buffer). Shapes as main_grads().
  void set_main_grads(std::vector<torch::Tensor> buffers);

  /// Per-expert [out, in] weights and [out] biases (views into the grouped parameters when used).
  std::vector<torch::Tensor> expert_weights() const;
  std::vector<torch::Tensor> expert_biases() const;

  /// Tensor-parallel attributes of a parameter by name (`weight3`, `weight`, `bias0`, ...).
  TensorParallelAttributes tensor_parallel_attributes(const std::string& parameter_name) const;

  /// Loads parameters saved in either layout (`weight0..` or `weight`, `bias0..` or `bias`).
  void load_state_dict(const std::unordered_map<std::string, torch::Tensor>& state_dict);
  /// torch::load support for both layouts.
  void load(torch::serialize::InputArchive& archive) override;

  /// The options this module was built with.
  GroupedLinearOptions options;
  /// Features per tensor-parallel partition.
  int64_t in_features_per_partition = 0;
  int64_t out_features_per_partition = 0;

 private:
  // The shared body of both forwards; `activation` set means input is the pre-activation.
  torch::Tensor run(const torch::Tensor& input, const SplitSizes& m_splits,
                    std::optional<bool> is_first_microbatch, const torch::Tensor& scales,
                    const std::optional<ops::GluOptions>& activation);

  std::vector<torch::Tensor> weight_params_;  // as registered: G tensors, or one grouped tensor
  std::vector<torch::Tensor> bias_params_;
  std::vector<torch::Tensor> main_grads_;
  std::shared_ptr<autograd::WgradQueue> wgrad_queue_ = std::make_shared<autograd::WgradQueue>();
};

/// A `ModuleHolder` subclass for `GroupedLinearImpl`; see `GroupedLinearImpl` and
/// `GroupedLinearOptions`.
TORCH_MODULE(GroupedLinear);

}  // namespace torchmoe
