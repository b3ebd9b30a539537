#include "torchmoe/optim/fused_adamw.h"

#include <ATen/MemoryOverlap.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/serialize.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchmoe/distributed/collectives.h"
#include "torchmoe/ops/multi_tensor_adamw.h"
#include "torchmoe/optim/fp8_weight_offers.h"

namespace torchmoe::optim {
namespace {

constexpr const char* kName = "FusedAdamW";

void check_options(const FusedAdamWOptions& o) {
  TORCH_CHECK(o.lr() >= 0 && std::isfinite(o.lr()), kName, ": lr must be finite and >= 0, got ",
              o.lr());
  TORCH_CHECK(o.eps() >= 0 && std::isfinite(o.eps()), kName, ": eps must be finite and >= 0, got ",
              o.eps());
  const auto [beta1, beta2] = o.betas();
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, kName,
              ": betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK(o.weight_decay() >= 0 && std::isfinite(o.weight_decay()), kName,
              ": weight_decay must be finite and >= 0, got ", o.weight_decay());
  TORCH_CHECK_NOT_IMPLEMENTED(!o.amsgrad(), kName, ": amsgrad is not supported");
}

// A group's options, which LibTorch stores as the base class: another optimizer's (a group added
// with SGDOptions, say) would be read as AdamW's fields.
const FusedAdamWOptions& options_of(const torch::optim::OptimizerParamGroup& group, size_t i) {
  TORCH_CHECK(group.has_options(), kName, ": param group ", i, " has no options");
  const auto* options = dynamic_cast<const FusedAdamWOptions*>(&group.options());
  TORCH_CHECK(options != nullptr, kName, ": param group ", i,
              " must have FusedAdamWOptions, got another optimizer's options");
  return *options;
}

// Whether a and b share memory: an optimizer that writes both in one launch would race.
bool overlaps(const torch::Tensor& a, const torch::Tensor& b) {
  return a.has_storage() && b.has_storage() && a.storage().is_alias_of(b.storage()) &&
         at::get_overlap_status(a, b) != at::MemOverlapStatus::No;
}

// Refuses tensors of one storage that overlap. Dense ones are compared by their byte ranges in
// address order (a layer's G weights over one allocation: G log G work where each pair through
// overlaps() was G^2 / 2 checks, 135 us a step at G = 128 on a CPU); any other pair by overlaps().
void check_disjoint(std::vector<torch::Tensor>& same) {
  std::vector<torch::Tensor> dense, other;
  for (torch::Tensor& t : same) {
    if (t.numel() == 0) continue;  // nothing to write
    (t.is_non_overlapping_and_dense() ? dense : other).push_back(std::move(t));
  }
  std::sort(dense.begin(), dense.end(), [](const torch::Tensor& a, const torch::Tensor& b) {
    return a.const_data_ptr() < b.const_data_ptr();
  });
  const char* message =
      "::step: two parameters or model copies share memory, which one launch would write twice";
  for (size_t i = 1; i < dense.size(); ++i) {
    const auto* end =
        static_cast<const char*>(dense[i - 1].const_data_ptr()) + dense[i - 1].nbytes();
    TORCH_CHECK(end <= dense[i].const_data_ptr(), kName, message);
  }
  for (size_t i = 0; i < other.size(); ++i) {
    for (size_t j = 0; j < i; ++j) TORCH_CHECK(!overlaps(other[i], other[j]), kName, message);
    for (const torch::Tensor& d : dense) TORCH_CHECK(!overlaps(other[i], d), kName, message);
  }
}

// Whether a and b are the same memory seen the same way: a model copy that is its own master's
// memory gets the value the master gets, from the same thread (an fp32 model without a separate
// master), which is no race.
bool same_memory(const torch::Tensor& a, const torch::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.dtype() == b.dtype();
}

// A gradient the kernels and the norm can read.
void check_dense(const torch::Tensor& grad, const char* where) {
  TORCH_CHECK(!grad.is_sparse(), kName, where, ": sparse gradients are not supported");
}

// An inference tensor cannot be written in place outside InferenceMode, which the step does
// after its checks (the version counters): refused while nothing has changed.
void check_not_inference(const torch::Tensor& t, const char* where, const char* what) {
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), kName, where, ": ", what,
              " must not be an inference tensor (made under InferenceMode), got one");
}

// The FP8 copy of `param` for this step: its rows of its layer's copies, master i being expert i
// when the layer has separate weights.
ops::AdamWFp8Copy fp8_copy(const Fp8WeightCopies& c, const torch::Tensor& param, size_t i,
                           size_t masters) {
  ops::AdamWFp8Copy copy{c.rowwise, c.columnwise, c.scale, c.scale_inv, c.amax};
  if (masters > 1) {
    const int64_t rows = param.size(0), elements = param.numel();
    const auto index = static_cast<int64_t>(i);
    copy.rowwise = copy.rowwise.narrow(0, index * rows, rows);
    copy.columnwise = copy.columnwise.narrow(0, index * elements, elements);
    copy.scale = copy.scale.narrow(0, index, 1);
    copy.scale_inv = copy.scale_inv.narrow(0, index, 1);
    copy.amax = copy.amax.narrow(0, index, 1);
  }
  return copy;
}

}  // namespace

FusedAdamW::FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                       FusedAdamWOptions defaults)
    : Optimizer(param_groups, std::make_unique<FusedAdamWOptions>(defaults)),
      fp8_holder_(detail::make_fp8_weight_holder()) {
  check_options(defaults);
  for (size_t i = 0; i < param_groups_.size(); ++i) check_options(options_of(param_groups_[i], i));
}

FusedAdamW::FusedAdamW(std::vector<torch::Tensor> params, FusedAdamWOptions defaults)
    : FusedAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

void FusedAdamW::set_model_copy(const torch::Tensor& param, const torch::Tensor& model) {
  TORCH_CHECK(is_parameter(param), kName,
              "::set_model_copy: param is not one of the optimizer's parameters");
  TORCH_CHECK(model.defined() && model.sizes() == param.sizes() &&
                  model.device() == param.device() && torch::isFloatingType(model.scalar_type()),
              kName, "::set_model_copy: model must be a floating tensor of shape ", param.sizes(),
              " on ", param.device(), ", got ",
              model.defined() ? c10::str("a tensor of dtype ", model.scalar_type(), ", shape ",
                                         model.sizes(), " on ", model.device())
                              : std::string("an undefined tensor"));
  const torch::ScalarType type = model.scalar_type();
  TORCH_CHECK(!model.is_cuda() || type == torch::kFloat32 || type == torch::kFloat16 ||
                  type == torch::kBFloat16,
              kName, "::set_model_copy: a CUDA model must be float32, float16 or bfloat16 (the ",
              "step's kernels write those), got ", type);
  TORCH_CHECK(!model.is_cuda() || model.is_contiguous(), kName,
              "::set_model_copy: a CUDA model must be contiguous, got strides ", model.strides());
  check_not_inference(model, "::set_model_copy", "model");
  // The step writes every parameter and model copy in one launch per group: memory written twice
  // would be a race.
  for (const auto& group : param_groups_) {
    for (const torch::Tensor& p : group.params()) {
      if (p.is_same(param) && same_memory(model, p)) continue;
      TORCH_CHECK(!overlaps(model, p), kName,
                  "::set_model_copy: model must not share memory with a parameter other than "
                  "as param's own memory");
    }
  }
  for (const auto& [key, other] : model_copies_) {
    TORCH_CHECK(key == param.unsafeGetTensorImpl() || !overlaps(model, other), kName,
                "::set_model_copy: model must not share memory with another parameter's model "
                "copy");
  }
  TORCH_CHECK(at::has_internal_overlap(model) != at::MemOverlap::Yes, kName,
              "::set_model_copy: model must not overlap itself (e.g. an expanded tensor), got "
              "strides ",
              model.strides());
  // A layer taken from an offer with this master goes back to casting its weights (its offer
  // stands again); one given by hand keeps the master, and step() refuses it once it no longer
  // writes the layer's weight.
  const auto fp8_master = fp8_masters_.find(param.unsafeGetTensorImpl());
  if (fp8_master != fp8_masters_.end() && fp8_weights_[fp8_master->second.first].offered) {
    drop_fp8_weights(fp8_master->second.first);
  }
  model_copies_[param.unsafeGetTensorImpl()] = model;
  fp8_offers_seen_ = 0;  // a layer's weights may be this optimizer's now
}

void FusedAdamW::set_fp8_weights(const Fp8WeightTarget& target,
                                 const std::vector<torch::Tensor>& masters) {
  constexpr const char* kWhere = "FusedAdamW::set_fp8_weights";
  TORCH_CHECK(target.layer != nullptr && target.copies && target.written, kWhere,
              ": target must be a layer's (e.g. GroupedLinearImpl::fp8_weight_target()), got one "
              "without its layer or calls");
  // Taken from the layer's offer before: the hand's masters replace the offer's once they pass.
  std::optional<size_t> offered;
  for (size_t l = 0; l < fp8_weights_.size(); ++l) {
    if (fp8_weights_[l].target.layer != target.layer) continue;
    TORCH_CHECK(fp8_weights_[l].offered, kWhere, ": the layer already has its masters");
    offered = l;
  }
  const std::vector<torch::Tensor>& weights = target.weights;
  TORCH_CHECK(masters.size() == weights.size(), kWhere, ": needs one master per weight parameter ",
              "of the layer (", weights.size(), "), got ", masters.size());
  for (size_t i = 0; i < masters.size(); ++i) {
    const torch::Tensor& m = masters[i];
    TORCH_CHECK(is_parameter(m), kWhere, ": masters[", i,
                "] is not one of the optimizer's parameters");
    const std::string refusal = fp8_master_refusal(m, weights[i], offered);
    TORCH_CHECK(refusal.empty(), kWhere, ": masters[", i, "] ", refusal);
    TORCH_CHECK(writes_weight(m, weights[i]), kWhere, ": masters[", i, "] must be the layer's ",
                "weight parameter ", i, " or the master whose model copy it is (set_model_copy ",
                "first), got a tensor that is neither");
  }
  target.copies();  // allocated now, on the layer's device
  if (offered) {
    // Kept held through the swap: no other optimizer can take the layer in between.
    drop_fp8_weights(*offered, /*release=*/false);
  }
  TORCH_CHECK(detail::hold_fp8_weights(fp8_holder_.get(), target.layer, /*by_hand=*/true), kWhere,
              ": another FusedAdamW was given the layer's FP8 weights by hand");
  add_fp8_weights(target, masters, /*offered=*/false);
}

void FusedAdamW::add_fp8_weights(const Fp8WeightTarget& target,
                                 const std::vector<torch::Tensor>& masters, bool offered) {
  for (size_t i = 0; i < masters.size(); ++i) {
    fp8_masters_[masters[i].unsafeGetTensorImpl()] = {fp8_weights_.size(), i};
  }
  fp8_weights_.push_back({target, masters, std::vector<bool>(masters.size(), false), offered});
}

void FusedAdamW::drop_fp8_weights(size_t index, bool release) {
  if (release) detail::release_fp8_weights(fp8_holder_.get(), fp8_weights_[index].target.layer);
  fp8_weights_.erase(fp8_weights_.begin() + static_cast<std::ptrdiff_t>(index));
  fp8_masters_.clear();
  for (size_t l = 0; l < fp8_weights_.size(); ++l) {
    for (size_t i = 0; i < fp8_weights_[l].masters.size(); ++i) {
      fp8_masters_[fp8_weights_[l].masters[i].unsafeGetTensorImpl()] = {l, i};
    }
  }
}

void FusedAdamW::take_fp8_weight_offers() {
  size_t params = 0;  // add_param_group may have added a layer's weights
  for (const auto& group : param_groups_) params += group.params().size();
  const uint64_t version = detail::fp8_weight_offers_version();
  if (version == fp8_offers_seen_ && params == fp8_offers_params_) return;
  // Layers taken from offers that another optimizer has since been given by hand.
  for (size_t l = fp8_weights_.size(); l-- > 0;) {
    if (fp8_weights_[l].offered &&
        !detail::holds_fp8_weights(fp8_holder_.get(), fp8_weights_[l].target.layer)) {
      drop_fp8_weights(l);
    }
  }
  // Each weight's master here: the parameter itself, or the one whose model copy it is.
  std::unordered_map<const void*, torch::Tensor> master_of;
  for (const auto& group : param_groups_) {
    for (const torch::Tensor& p : group.params()) master_of.emplace(p.unsafeGetTensorImpl(), p);
  }
  for (const auto& [param, model] : model_copies_) {
    const auto master = master_of.find(param);
    if (master != master_of.end()) master_of[model.unsafeGetTensorImpl()] = master->second;
  }
  for (const Fp8WeightTarget& target : detail::open_fp8_weight_offers()) {
    // What set_fp8_weights would refuse is left to the layer's own casts.
    std::vector<torch::Tensor> masters;
    for (const torch::Tensor& w : target.weights) {
      const auto master = master_of.find(w.unsafeGetTensorImpl());
      if (master == master_of.end() ||
          !fp8_master_refusal(master->second, w, std::nullopt).empty()) {
        break;
      }
      masters.push_back(master->second);
    }
    // Not held: another optimizer may have taken it since the offers were listed.
    if (masters.size() != target.weights.size() ||
        !detail::hold_fp8_weights(fp8_holder_.get(), target.layer, /*by_hand=*/false)) {
      continue;
    }
    try {
      target.copies();  // allocated now, on the layer's device
    } catch (...) {
      detail::release_fp8_weights(fp8_holder_.get(), target.layer);
      throw;
    }
    add_fp8_weights(target, masters, /*offered=*/true);
  }
  fp8_offers_seen_ = version;
  fp8_offers_params_ = params;
}

std::string FusedAdamW::fp8_master_refusal(const torch::Tensor& master, const torch::Tensor& weight,
                                           std::optional<size_t> layer) const {
  const auto writes = fp8_masters_.find(master.unsafeGetTensorImpl());
  if (writes != fp8_masters_.end() && writes->second.first != layer) {
    return "already writes another layer's FP8 weights";
  }
  if (master.scalar_type() != torch::kFloat32 || master.sizes() != weight.sizes()) {
    return c10::str("must be float32 of shape ", weight.sizes(), ", got ", master.scalar_type(),
                    " ", master.sizes());
  }
  return {};
}

bool FusedAdamW::is_parameter(const torch::Tensor& t) const {
  for (const auto& group : param_groups_) {
    for (const torch::Tensor& p : group.params()) {
      if (p.is_same(t)) return true;
    }
  }
  return false;
}

bool FusedAdamW::writes_weight(const torch::Tensor& master, const torch::Tensor& weight) const {
  const auto model = model_copies_.find(master.unsafeGetTensorImpl());
  return master.is_same(weight) || (model != model_copies_.end() && model->second.is_same(weight));
}

void FusedAdamW::check_step(const torch::Tensor& param) const {
  check_dense(param.grad(), "");
  check_not_inference(param, "::step", "a parameter");
  // Elements written through more than one index would take several updates, racing on CUDA.
  TORCH_CHECK(at::has_internal_overlap(param) != at::MemOverlap::Yes, kName,
              "::step: a parameter must not overlap itself (e.g. an expanded tensor), got sizes ",
              param.sizes(), " and strides ", param.strides());
  const auto found = fp8_masters_.find(param.unsafeGetTensorImpl());
  if (found == fp8_masters_.end()) return;
  const auto [layer_index, i] = found->second;
  // A model copy re-pointed since (set_model_copy) would leave the copies following a master
  // that no longer holds the layer's weights.
  TORCH_CHECK(writes_weight(param, fp8_weights_[layer_index].target.weights[i]), kName,
              "::step: the master of the layer's weight parameter ", i, " (set_fp8_weights) no ",
              "longer writes that parameter (its model copy was replaced)");
}

torch::Tensor FusedAdamW::clip_grad_norm(double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& group : param_groups_) {
    for (const torch::Tensor& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  TORCH_CHECK(!grads.empty(), kName, "::clip_grad_norm: no parameter has a gradient");
  for (const torch::Tensor& g : grads) check_dense(g, "::clip_grad_norm");
  const ops::GradNorm norm = ops::grad_norm(grads, max_norm);
  // Measuring only: no coefficient, so that an infinite norm does not make one of inf / inf.
  grad_scale_ = std::isinf(max_norm) ? torch::Tensor() : norm.coefficient;
  return norm.norm;
}

torch::Tensor FusedAdamW::clip_grad_norm(double max_norm, const std::vector<torch::Tensor>& sharded,
                                         const ProcessGroupOptions& group) {
  TORCH_CHECK(max_norm > 0, kName, "::clip_grad_norm: max_norm must be positive, got ", max_norm);
  TORCH_CHECK(!param_groups_.empty() && !param_groups_[0].params().empty(), kName,
              "::clip_grad_norm: the optimizer has no parameters");
  // A rank whose inputs are refused still joins the all-reduce, with a NaN, before it throws:
  // leaving it would keep the other ranks waiting in it. They get a NaN norm.
  std::string refused;
  torch::Tensor sharded_sq, replicated_sq;
  try {
    std::unordered_set<const void*> shards;
    for (const torch::Tensor& s : sharded) shards.insert(s.unsafeGetTensorImpl());
    std::vector<torch::Tensor> replicated_grads, sharded_grads;
    size_t found = 0;
    for (const auto& param_group : param_groups_) {
      for (const torch::Tensor& p : param_group.params()) {
        const bool is_shard = shards.count(p.unsafeGetTensorImpl()) > 0;
        found += is_shard;
        if (p.grad().defined()) (is_shard ? sharded_grads : replicated_grads).push_back(p.grad());
      }
    }
    TORCH_CHECK(found == shards.size(), kName,
                "::clip_grad_norm: every sharded tensor must be one of the optimizer's parameters");
    TORCH_CHECK(!replicated_grads.empty() || !sharded_grads.empty(), kName,
                "::clip_grad_norm: no parameter has a gradient");
    for (const auto* grads : {&replicated_grads, &sharded_grads}) {
      for (const torch::Tensor& g : *grads) check_dense(g, "::clip_grad_norm");
    }
    const torch::Tensor& any = replicated_grads.empty() ? sharded_grads[0] : replicated_grads[0];
    // Squared norms, each 0 for an empty list: a rank may hold no sharded gradient this step.
    const auto squared_norm = [&](const std::vector<torch::Tensor>& grads) {
      if (grads.empty()) return torch::zeros({}, any.options().dtype(torch::kFloat32));
      return ops::grad_norm(grads, INFINITY).norm.square();
    };
    sharded_sq = squared_norm(sharded_grads).reshape({1});
    replicated_sq = squared_norm(replicated_grads);
  } catch (const c10::Error& e) {
    refused = e.what_without_backtrace();
    const torch::Tensor& p = param_groups_[0].params()[0];
    sharded_sq = torch::full({1}, NAN, p.options().dtype(torch::kFloat32));
  }
  distributed::all_reduce_sum_(sharded_sq, group);
  TORCH_CHECK(refused.empty(), refused);
  const torch::Tensor norm = (replicated_sq + sharded_sq[0]).sqrt();
  // clip_grad_norm_'s coefficient, as ops::grad_norm computes it; measuring only: none.
  grad_scale_ = std::isinf(max_norm) ? torch::Tensor() : (max_norm / (norm + 1e-6)).clamp_max(1.0);
  return norm;
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  const torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    const at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  take_fp8_weight_offers();
  // The step is planned and checked whole before anything is written: a refused step leaves the
  // state (step counts, moments), the weights and their version counters as they were.
  struct Launch {
    ops::AdamWTensors tensors;
    ops::AdamWHyperparameters hyper;
  };
  std::vector<Launch> launches;
  std::vector<torch::Tensor> stepped;  // parameters with a gradient, in step order
  std::unordered_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>> fresh;
  std::unordered_set<const void*> planned;
  std::unordered_set<const void*> without_copy;  // FP8 masters whose copy this step skips
  // The tensors the step writes, by storage: those sharing one are checked for overlaps.
  std::unordered_map<const void*, std::vector<torch::Tensor>> written;
  const auto add_written = [&](const torch::Tensor& t) {
    if (t.has_storage()) written[t.storage().unsafeGetStorageImpl()].push_back(t);
  };
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& group = param_groups_[g];
    const FusedAdamWOptions& options = options_of(group, g);
    check_options(options);
    // Parameters that missed steps (no gradient then) have their own step counts, as in
    // torch::optim::AdamW: one call per distinct count (one in the usual case). Each launch's
    // tensors are the group's parameters at `positions` (for errors).
    std::map<int64_t, ops::AdamWTensors> by_step;
    std::map<int64_t, std::vector<size_t>> positions;
    for (size_t i = 0; i < group.params().size(); ++i) {
      const torch::Tensor& p = group.params()[i];
      if (!p.grad().defined()) continue;
      check_step(p);
      void* key = p.unsafeGetTensorImpl();
      // Twice in one step it would be updated twice in one launch, a race on its memory.
      TORCH_CHECK(planned.insert(key).second, kName,
                  "::step: a parameter appears more than once in the parameter groups");
      const auto found = state_.find(key);
      std::unique_ptr<torch::optim::OptimizerParamState>& slot =
          found != state_.end() ? found->second : fresh[key];
      if (!slot) {
        auto state = std::make_unique<torch::optim::AdamWParamState>();
        state->step(0);
        state->exp_avg(torch::zeros_like(p, at::MemoryFormat::Contiguous));
        state->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Contiguous));
        slot = std::move(state);
      }
      const auto& state = static_cast<const torch::optim::AdamWParamState&>(*slot);
      ops::AdamWTensors& t = by_step[state.step() + 1];
      positions[state.step() + 1].push_back(i);
      t.params.push_back(p);
      t.grads.push_back(p.grad());
      t.exp_avgs.push_back(state.exp_avg());
      t.exp_avg_sqs.push_back(state.exp_avg_sq());
      const auto model = model_copies_.find(key);
      t.models.push_back(model != model_copies_.end() ? model->second : torch::Tensor());
      add_written(p);
      if (model != model_copies_.end() && !same_memory(model->second, p)) {
        add_written(model->second);
      }
      const auto fp8_master = fp8_masters_.find(key);
      if (fp8_master == fp8_masters_.end()) {
        t.fp8_copies.emplace_back();
      } else {
        const Fp8Weights& f = fp8_weights_[fp8_master->second.first];
        t.fp8_copies.push_back(
            fp8_copy(f.target.copies(), p, fp8_master->second.second, f.masters.size()));
        // A layer taken from an offer whose tensors the kernel cannot read with a copy (a
        // master or gradient off a 16-byte boundary) is not refused: this step writes no copy
        // for the master, and the layer's forwards cast its weights.
        if (f.offered && p.is_cuda() &&
            ops::fp8_copy_misalignment(t, t.params.size() - 1).name != nullptr) {
          t.fp8_copies.back() = ops::AdamWFp8Copy();
          without_copy.insert(key);
        }
      }
      stepped.push_back(p);
    }
    for (auto& [step, tensors] : by_step) {
      const std::vector<size_t>& where = positions[step];
      Launch launch{std::move(tensors), {}};
      launch.hyper.lr = options.lr();
      launch.hyper.beta1 = std::get<0>(options.betas());
      launch.hyper.beta2 = std::get<1>(options.betas());
      launch.hyper.eps = options.eps();
      launch.hyper.weight_decay = options.weight_decay();
      launch.hyper.step = step;
      try {
        ops::check_adamw_step(launch.tensors, launch.hyper, grad_scale_);
      } catch (const c10::Error& e) {
        // The op numbers the tensors of one launch; say which of the group's parameters they are.
        std::string which;
        for (size_t j = 0; j < where.size(); ++j) {
          which += (j ? ", " : "") + std::to_string(where[j]);
          if (j == 7 && where.size() > 9) {
            which += ", ... (" + std::to_string(where.size()) + " in all)";
            break;
          }
        }
        TORCH_CHECK(false, kName, "::step: param group ", g, ", its parameters ", which,
                    " as the op's params[0], params[1], ...: ", e.what_without_backtrace());
      }
      launches.push_back(std::move(launch));
    }
  }
  for (auto& [storage, same] : written) check_disjoint(same);

  for (auto& [key, state] : fresh) state_[key] = std::move(state);
  for (Fp8Weights& f : fp8_weights_) std::fill(f.written.begin(), f.written.end(), false);
  for (const torch::Tensor& p : stepped) {
    auto& state = static_cast<torch::optim::AdamWParamState&>(*state_[p.unsafeGetTensorImpl()]);
    state.step(state.step() + 1);
    // The step writes the parameter and its model copy in place: their version counters move
    // as an in-place op's would (torch::optim::AdamW's do), so that anything holding a version
    // (a saved tensor, a layer's FP8 weights) sees it, also when the parameter is the weight.
    torch::autograd::impl::bump_version(p);
    const auto model = model_copies_.find(p.unsafeGetTensorImpl());
    if (model != model_copies_.end()) torch::autograd::impl::bump_version(model->second);
    const auto master = fp8_masters_.find(p.unsafeGetTensorImpl());
    if (master != fp8_masters_.end() && without_copy.count(master->first) == 0) {
      fp8_weights_[master->second.first].written[master->second.second] = true;
    }
  }
  for (const Launch& launch : launches) {
    ops::run_adamw_step(launch.tensors, launch.hyper, grad_scale_);  // checked when planned
  }
  grad_scale_ = torch::Tensor();  // a clip applies to one step
  // A layer reads its FP8 weights only when this step wrote all of them: after a step that
  // skipped a master (no gradient), its version counters no longer match.
  for (Fp8Weights& f : fp8_weights_) {
    if (std::all_of(f.written.begin(), f.written.end(), [](bool w) { return w; })) {
      f.target.written();
    }
  }
  return loss;
}

void FusedAdamW::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<torch::optim::AdamWParamState, FusedAdamWOptions>(archive, *this);
}

void FusedAdamW::load(torch::serialize::InputArchive& archive) {
  // LibTorch's loader replaces each group's state and options before it looks at the next group,
  // and takes moments of any shape: it reads into a stand-in over the same parameters, whose
  // state is checked whole before it replaces this optimizer's.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    options_of(param_groups_[i], i);
    groups.emplace_back(param_groups_[i].params(), param_groups_[i].options().clone());
  }
  FusedAdamW staged(groups, static_cast<const FusedAdamWOptions&>(defaults()));
  try {
    torch::optim::serialize<torch::optim::AdamWParamState, FusedAdamWOptions>(archive, staged);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {  // the reader's own errors, e.g. a missing entry
    TORCH_CHECK(false, kName, "::load: the archive is not an AdamW optimizer's state: ", e.what());
  }
  for (size_t i = 0; i < staged.param_groups_.size(); ++i) {
    check_options(options_of(staged.param_groups_[i], i));
    const std::vector<torch::Tensor>& params = staged.param_groups_[i].params();
    for (size_t j = 0; j < params.size(); ++j) {
      const auto found = staged.state_.find(params[j].unsafeGetTensorImpl());
      if (found == staged.state_.end()) continue;
      const auto& state = static_cast<const torch::optim::AdamWParamState&>(*found->second);
      for (const auto& [name, moment] :
           {std::pair<const char*, torch::Tensor>{"exp_avg", state.exp_avg()},
            {"exp_avg_sq", state.exp_avg_sq()}}) {
        TORCH_CHECK(moment.defined() && moment.sizes() == params[j].sizes() &&
                        moment.device() == params[j].device() &&
                        moment.scalar_type() == params[j].scalar_type(),
                    kName, "::load: param group ", i, ", parameter ", j, ": the checkpoint's ",
                    name, " must be a ", params[j].scalar_type(), " tensor of shape ",
                    params[j].sizes(), " on ", params[j].device(), " like the parameter, got ",
                    moment.defined() ? c10::str(moment.scalar_type(), " ", moment.sizes(), " on ",
                                                moment.device())
                                     : std::string("none"));
      }
      TORCH_CHECK(state.step() >= 0, kName, "::load: param group ", i, ", parameter ", j,
                  ": the checkpoint's step must be >= 0, got ", state.step());
    }
  }
  state_ = std::move(staged.state_);
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    param_groups_[i].set_options(staged.param_groups_[i].options().clone());
  }
}

}  // namespace torchmoe::optim
