#pragma once
// FusedAdamW: torch::optim::AdamW for C++ training loops, with the update of every parameter in a
// few multi-tensor launches on CUDA (LibTorch's C++ optimizers step one tensor at a time, several
// kernels each), fp32 master weights that write their 16-bit compute copies in the same pass, and a
// fused global gradient norm for clipping. Options, state and checkpoints are
// torch::optim::AdamW's, so either optimizer loads the other's.

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchmoe/distributed/process_group.h"
#include "torchmoe/optim/fp8_weight_target.h"

namespace torchmoe::optim {

/// torch::optim::AdamW's options (lr, betas, eps, weight_decay; amsgrad is not supported).
using FusedAdamWOptions = torch::optim::AdamWOptions;

/// AdamW (decoupled weight decay) over parameter groups, as torch::optim::AdamW. On CUDA the
/// parameters, their gradients and the state are float32 (master weights; the gradients e.g.
/// GroupedLinear's fused main-grad buffers) and every group takes one pass over them; on the CPU
/// any floating dtype, one tensor at a time (the reference).
///
/// Example:
/// ```
/// // masters: fp32 leaves whose .grad hold the fp32 gradient sums; params16: the bf16 copies the
/// // model computes with.
/// torchmoe::optim::FusedAdamW adamw({torch::optim::OptimizerParamGroup(masters)},
///                                   torchmoe::optim::FusedAdamWOptions(3e-4).weight_decay(0.1));
/// for (size_t i = 0; i < masters.size(); ++i) adamw.set_model_copy(masters[i], params16[i]);
/// // per step, after backward:
/// torch::Tensor norm = adamw.clip_grad_norm(1.0);  // no host sync
/// adamw.step();                                    // masters and bf16 copies updated
/// ```
class FusedAdamW : public torch::optim::Optimizer {
 public:
  explicit FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                      FusedAdamWOptions defaults = {});
  explicit FusedAdamW(std::vector<torch::Tensor> params, FusedAdamWOptions defaults = {});

  /// After every step, `model` (same shape and device, a floating dtype) receives `param`'s new
  /// value rounded to its dtype, in the same pass: the compute copy of an fp32 master weight.
  /// `param` must be one of the optimizer's parameters; `model` must not share memory with a
  /// parameter or with another parameter's model copy (one launch writes them all), other than
  /// being `param`'s own memory (an fp32 model without a separate master).
  void set_model_copy(const torch::Tensor& param, const torch::Tensor& model);

  /// FP8 training under DelayedScaling without the forward's weight cast: every step writes a
  /// layer's FP8 weights (the rowwise copy fprop reads and the transposed one dgrad reads, e4m3
  /// with the weight scales of the layer's FP8 state) from `masters`' new values in the same pass
  /// as their update, and maxes their amax into the state's current history row, as the forward's
  /// cast would. Once every master has been stepped, the layer's forwards under DelayedScaling
  /// read these copies (GroupedLinearImpl::fp8_weight_target says until when). A layer built with
  /// fp8_weights_from_optimizer (the default) offers its target at its first forward under
  /// DelayedScaling, and step() takes the offers of layers whose weights are all this optimizer's;
  /// this call gives a layer by hand. target: the layer's, e.g.
  /// `adamw.set_fp8_weights(layer->fp8_weight_target(), masters)`. masters: the optimizer's
  /// parameters holding the layer's weights, in target.weights' order, each float32 and either
  /// the weight itself or the master whose model copy (set_model_copy) it is. One optimizer writes
  /// a layer at a time: a layer given by hand is refused to any other FusedAdamW, and one taken
  /// from its offer moves to the optimizer it is given to by hand. What an optimizer took from an
  /// offer never makes step() throw: a master re-pointed by set_model_copy lets the layer go, and
  /// a master or gradient the FP8 kernel cannot read (off a 16-byte boundary) leaves that step's
  /// copies stale, so that the layer casts its weights. A layer moves between optimizers at their
  /// steps: steps of two optimizers that share a layer's weights are not to run concurrently with
  /// each other's set_fp8_weights (like an optimizer's own calls, which are not thread-safe).
  void set_fp8_weights(const Fp8WeightTarget& target, const std::vector<torch::Tensor>& masters);

  /// The L2 norm of all parameters' gradients together, and the next step() multiplies every
  /// gradient by min(1, max_norm / (norm + 1e-6)) as it reads them: the effect of
  /// torch::nn::utils::clip_grad_norm_ without its pass over the gradients, which are left as they
  /// are. Returns the norm before clipping, a 0-d float32 tensor on the parameters' device (no
  /// host sync). max_norm = infinity measures only (no multiplier, whatever the norm); a NaN
  /// multiplier (a NaN norm) is kept, as clip_grad_norm_ keeps it.
  torch::Tensor clip_grad_norm(double max_norm);

  /// clip_grad_norm for a model trained over the ranks of `group` whose parameters are partly
  /// sharded (expert parallelism: each rank holds other experts) and partly replicated (the same
  /// gradients on every rank, e.g. after a data-parallel all-reduce): the norm of the whole
  /// model's gradient, sqrt(|replicated|² + Σ over ranks |sharded|²), from one all-reduce of a
  /// scalar (no host sync). `sharded`: this rank's shard parameters among the optimizer's; all
  /// others count once. Every rank of the group must call it; all get the same norm. A rank whose
  /// arguments are refused joins the all-reduce with a NaN before it throws, so that the others
  /// return a NaN norm instead of waiting for it.
  torch::Tensor clip_grad_norm(double max_norm, const std::vector<torch::Tensor>& sharded,
                               const ProcessGroupOptions& group);

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  /// torch::optim::AdamW's format. The groups, their options and every moment's shape, dtype and
  /// device are checked against this optimizer's before anything of it changes.
  void load(torch::serialize::InputArchive& archive) override;

 private:
  // A layer whose FP8 weights the steps write, and which of its masters have been written.
  struct Fp8Weights {
    Fp8WeightTarget target;
    std::vector<torch::Tensor> masters;
    std::vector<bool> written;
    bool offered = false;  // taken from the layer's offer, not given by hand
  };
  // The checks step() makes on `param` (which has a gradient) before it changes anything.
  void check_step(const torch::Tensor& param) const;
  // Takes the offered FP8 weights of layers whose weights are all this optimizer's (its
  // parameters, or model copies of them) and not yet another layer's (optim/fp8_weight_offers.h).
  void take_fp8_weight_offers();
  void add_fp8_weights(const Fp8WeightTarget& target, const std::vector<torch::Tensor>& masters,
                       bool offered);
  // Stops writing layer `index`'s copies and, with `release`, lets the layer go.
  void drop_fp8_weights(size_t index, bool release = true);
  // Why `master`, one of this optimizer's parameters, cannot write `weight`'s FP8 copy for layer
  // entry `layer` (none: a layer not yet here); empty when it can.
  std::string fp8_master_refusal(const torch::Tensor& master, const torch::Tensor& weight,
                                 std::optional<size_t> layer) const;
  // Whether `t` is one of the parameter groups' tensors.
  bool is_parameter(const torch::Tensor& t) const;
  // Whether `master` is `weight` or the master whose model copy it is.
  bool writes_weight(const torch::Tensor& master, const torch::Tensor& weight) const;

  std::unordered_map<const void*, torch::Tensor> model_copies_;  // by the parameter's TensorImpl
  std::vector<Fp8Weights> fp8_weights_;
  // By the master's TensorImpl: its Fp8Weights and which of its masters it is.
  std::unordered_map<const void*, std::pair<size_t, size_t>> fp8_masters_;
  torch::Tensor grad_scale_;  // set by clip_grad_norm, used by the next step
  // Whose holds on layers' FP8 weights this optimizer's are; released with the last copy of it.
  std::shared_ptr<const void> fp8_holder_;
  uint64_t fp8_offers_seen_ = 0;  // the offers' version last looked at
  size_t fp8_offers_params_ = 0;  // and the number of parameters then
};

}  // namespace torchmoe::optim
