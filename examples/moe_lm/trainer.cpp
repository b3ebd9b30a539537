// The mixed-precision trainer (fp32 masters, main-grad sums, FusedAdamW with clipping, its
// checkpoint state) and the learning-rate schedule.

#include "trainer.h"

#include <fmt/core.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

namespace moe_lm {
namespace {

// The model's buffers from a checkpoint's, by name. FP8 state that the checkpoint lacks (a bf16
// run continued with --fp8) keeps its initial values, and entries the model lacks (FP8 state of
// a run continued without --fp8) are ignored, as GroupedLinear's own load does (docs/fp8.md).
void read_buffers(torch::nn::Module& model, torch::serialize::InputArchive& saved_buffers) {
  torch::NoGradGuard no_grad;
  for (const auto& buffer : model.named_buffers()) {
    torch::Tensor saved;
    if (!saved_buffers.try_read(buffer.key(), saved)) {
      if (buffer.key().find("fp8_state.") != std::string::npos) continue;
      throw std::runtime_error(
          fmt::format("checkpoint: no buffer '{}' (a checkpoint of a model with other options?)",
                      buffer.key()));
    }
    if (!saved.sizes().equals(buffer.value().sizes()))
      throw std::runtime_error(fmt::format("checkpoint: buffer '{}' is {}, the model's is {}",
                                           buffer.key(), c10::str(saved.sizes()),
                                           c10::str(buffer.value().sizes())));
    buffer.value().copy_(saved);
  }
}

}  // namespace

Trainer::Trainer(MoETransformer& model, const Flags& f) : model_(model), flags_(f) {
  // The GroupedLinear layers' weights (one [E, out, in] weight each, or E) take main-grad
  // buffers. Those of the routed experts (the MoE layers' `experts`), biases included, are the
  // expert parameters: sharded with --ep. A shared expert's are replicated, like the dense ones.
  std::vector<std::pair<torchmoe::GroupedLinear, std::vector<std::string>>> grouped;
  std::set<std::string> expert_names;
  for (const auto& item : model->named_modules()) {
    auto layer = std::dynamic_pointer_cast<torchmoe::GroupedLinearImpl>(item.value());
    if (!layer) continue;
    std::vector<std::string> names;
    if (layer->options.single_grouped_weight()) {
      names.push_back(item.key() + ".weight");
    } else {
      for (int64_t g = 0; g < layer->options.num_gemms(); ++g)
        names.push_back(item.key() + ".weight" + std::to_string(g));
    }
    if (item.key().find(".experts.") != std::string::npos) {
      for (const auto& p : layer->named_parameters(/*recurse=*/false)) {
        expert_names.insert(item.key() + "." + p.key());
      }
    }
    grouped.emplace_back(torchmoe::GroupedLinear(layer), std::move(names));
  }
  std::map<std::string, size_t> by_name;
  for (const auto& p : model->named_parameters()) {
    Slot s;
    s.param = p.value();
    s.master = p.value().scalar_type() == torch::kFloat32
                   ? p.value().detach()
                   : p.value().detach().to(torch::kFloat32).clone();
    s.expert = expert_names.count(p.key()) > 0;
    by_name[p.key()] = slots_.size();
    slots_.push_back(std::move(s));
  }
  // Main-grad sums in one flat buffer, the dense ones first (one all-reduce with --ep), each
  // starting on a 512-byte boundary (16-byte alignment is what the grouped GEMM's TMA and the
  // optimizer's vector loads need).
  constexpr int64_t kAlign = 128;  // floats
  const auto padded = [](int64_t numel) { return (numel + kAlign - 1) / kAlign * kAlign; };
  int64_t dense_total = 0, expert_total = 0;
  for (const Slot& s : slots_) (s.expert ? expert_total : dense_total) += padded(s.master.numel());
  const torch::Tensor main_grads =
      torch::zeros({dense_total + expert_total}, slots_[0].master.options());
  dense_grads_ = main_grads.narrow(0, 0, dense_total);
  int64_t offsets[2] = {0, dense_total};  // the next dense and expert sums
  for (Slot& s : slots_) {
    int64_t& offset = offsets[s.expert ? 1 : 0];
    s.main_grad = main_grads.narrow(0, offset, s.master.numel()).view(s.master.sizes());
    offset += padded(s.master.numel());
  }
  // Hand the expert weights' main-grad buffers to their GroupedLinear layers.
  for (auto& [layer, names] : grouped) {
    std::vector<torch::Tensor> buffers;
    for (const std::string& name : names) buffers.push_back(slots_.at(by_name.at(name)).main_grad);
    layer->set_main_grads(buffers);
  }
  std::vector<torch::Tensor> masters;
  for (const Slot& s : slots_) masters.push_back(s.master);
  optimizer_ = make_optimizer(masters);
  for (const Slot& s : slots_) {
    if (!s.master.is_same(s.param)) optimizer_->set_model_copy(s.master, s.param);
  }
  // --fp8 delayed: the experts' forwards offer their weights, and from the step after the first
  // forward every step also writes their FP8 copies, so that forwards do not cast the weights
  // (GroupedLinearOptions::fp8_weights_from_optimizer, docs/fp8.md).
}

std::unique_ptr<torchmoe::optim::FusedAdamW> Trainer::make_optimizer(
    const std::vector<torch::Tensor>& params) const {
  using torchmoe::optim::FusedAdamWOptions;
  std::vector<torch::Tensor> decay, no_decay;
  for (size_t i = 0; i < slots_.size(); ++i)
    (slots_[i].master.dim() >= 2 ? decay : no_decay).push_back(params[i]);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      decay,
      std::make_unique<FusedAdamWOptions>(
          FusedAdamWOptions(flags_.lr).betas({0.9, 0.95}).weight_decay(flags_.weight_decay)));
  groups.emplace_back(no_decay,
                      std::make_unique<FusedAdamWOptions>(
                          FusedAdamWOptions(flags_.lr).betas({0.9, 0.95}).weight_decay(0.0)));
  return std::make_unique<torchmoe::optim::FusedAdamW>(std::move(groups));
}

void Trainer::accumulate(bool first_microbatch) {
  torch::NoGradGuard no_grad;
  for (Slot& s : slots_) {
    if (s.expert) continue;
    if (!s.param.grad().defined()) {
      if (first_microbatch) s.main_grad.zero_();
      continue;
    }
    if (first_microbatch) {
      s.main_grad.copy_(s.param.grad());
    } else {
      s.main_grad.add_(s.param.grad());
    }
    s.param.mutable_grad().reset();
  }
}

double Trainer::step(double lr) {
  torch::NoGradGuard no_grad;
  for (Slot& s : slots_) s.master.mutable_grad() = s.main_grad;
  const double max_norm = flags_.clip > 0 ? flags_.clip : INFINITY;
  torch::Tensor norm;
  if (model_->expert_parallel) {
    // Each rank backpropagated its share of the global batch's loss (step.cpp), so the sum over
    // the ranks of the dense gradients is the whole batch's gradient. The experts' sums are
    // complete already: the all-to-all's backward brought them every rank's tokens.
    torchmoe::distributed::all_reduce_sum_(dense_grads_, *model_->expert_parallel);
    std::vector<torch::Tensor> shards;
    for (const Slot& s : slots_) {
      if (s.expert) shards.push_back(s.master);
    }
    norm = optimizer_->clip_grad_norm(max_norm, shards, *model_->expert_parallel);
  } else {
    norm = optimizer_->clip_grad_norm(max_norm);
  }
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  optimizer_->step();
  for (Slot& s : slots_) s.master.mutable_grad().reset();
  return norm.item<double>();
}

void Trainer::save(torch::serialize::OutputArchive& archive) const {
  torch::serialize::OutputArchive masters, buffers, optimizer;
  for (size_t i = 0; i < slots_.size(); ++i) masters.write(std::to_string(i), slots_[i].master);
  for (const auto& buffer : model_->named_buffers()) buffers.write(buffer.key(), buffer.value());
  optimizer_->save(optimizer);
  archive.write("masters", masters);
  archive.write("buffers", buffers);
  archive.write("optimizer", optimizer);
}

void Trainer::load(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive masters, buffers, optimizer;
  archive.read("masters", masters);
  archive.read("buffers", buffers);
  archive.read("optimizer", optimizer);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < slots_.size(); ++i) {
    torch::Tensor saved;
    masters.read(std::to_string(i), saved);
    slots_[i].master.copy_(saved);
    slots_[i].param.copy_(slots_[i].master);
  }
  read_buffers(*model_, buffers);
  optimizer_->load(optimizer);
}

void Trainer::load_merged(std::vector<torch::serialize::InputArchive>& ranks) {
  const size_t n = ranks.size();
  std::vector<torch::serialize::InputArchive> masters(n), buffers(n), optimizers(n);
  for (size_t r = 0; r < n; ++r) {
    ranks[r].read("masters", masters[r]);
    ranks[r].read("buffers", buffers[r]);
    ranks[r].read("optimizer", optimizers[r]);
  }
  // A slot's tensor over the ranks: the expert shards concatenated, else rank 0's copy.
  const auto merge = [&](const Slot& s, const std::vector<torch::Tensor>& per_rank) {
    return s.expert ? torch::cat(per_rank) : per_rank[0];
  };
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < slots_.size(); ++i) {
    std::vector<torch::Tensor> shards(n);
    for (size_t r = 0; r < n; ++r) masters[r].read(std::to_string(i), shards[r]);
    slots_[i].master.copy_(merge(slots_[i], shards));
    slots_[i].param.copy_(slots_[i].master);
  }
  // The router's expert bias and load are the group's on every rank.
  read_buffers(*model_, buffers[0]);
  // Each rank's AdamW state, loaded into an optimizer of stand-in parameters with its slots'
  // groups (a checkpoint names parameters by position only), then merged slot by slot.
  std::vector<std::vector<torch::Tensor>> stand_ins(n);
  std::vector<std::unique_ptr<torchmoe::optim::FusedAdamW>> shard_optimizers;
  for (size_t r = 0; r < n; ++r) {
    // The rank's shapes (an expert slot's first dimension split over the ranks), which load checks
    // the moments against.
    for (const Slot& s : slots_) {
      std::vector<int64_t> shape = s.master.sizes().vec();
      if (s.expert) shape[0] /= static_cast<int64_t>(n);
      stand_ins[r].push_back(torch::empty(shape, torch::kFloat32));
    }
    shard_optimizers.push_back(make_optimizer(stand_ins[r]));
    shard_optimizers.back()->load(optimizers[r]);
  }
  for (size_t g = 0; g < optimizer_->param_groups().size(); ++g) {
    optimizer_->param_groups()[g].set_options(
        shard_optimizers[0]->param_groups()[g].options().clone());
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    std::vector<torch::Tensor> exp_avg, exp_avg_sq;
    std::optional<int64_t> step;
    for (size_t r = 0; r < n; ++r) {
      auto& state = shard_optimizers[r]->state();
      const auto it = state.find(stand_ins[r][i].unsafeGetTensorImpl());
      if (it == state.end()) continue;  // no step has updated this parameter yet
      const auto& adamw = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      TORCH_CHECK(!step || *step == adamw.step(),
                  "merging checkpoints: the ranks' AdamW step counts must agree, got ", *step,
                  " and ", adamw.step());
      step = adamw.step();
      exp_avg.push_back(adamw.exp_avg());
      exp_avg_sq.push_back(adamw.exp_avg_sq());
    }
    if (!step) continue;
    TORCH_CHECK(exp_avg.size() == n, "merging checkpoints: parameter ", i,
                " has AdamW state on some ranks only");
    auto merged = std::make_unique<torch::optim::AdamWParamState>();
    merged->step(*step);
    merged->exp_avg(merge(slots_[i], exp_avg).to(slots_[i].master.device()));
    merged->exp_avg_sq(merge(slots_[i], exp_avg_sq).to(slots_[i].master.device()));
    optimizer_->state()[slots_[i].master.unsafeGetTensorImpl()] = std::move(merged);
  }
}

double learning_rate(const Flags& f, int64_t step) {
  if (step < f.warmup) return f.lr * static_cast<double>(step + 1) / static_cast<double>(f.warmup);
  const double span = std::max<int64_t>(1, f.steps - f.warmup);
  const double progress = std::min(1.0, static_cast<double>(step - f.warmup) / span);
  const double min_lr = f.lr * f.min_lr_ratio;
  return min_lr + 0.5 * (f.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace moe_lm
