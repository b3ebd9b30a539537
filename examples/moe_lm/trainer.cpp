// The mixed-precision trainer (fp32 masters, main-grad sums, FusedAdamW with clipping, its
// checkpoint state) and the learning-rate schedule.

#include "trainer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>

namespace moe_lm {

Trainer::Trainer(MoETransformer& model, const Flags& f) : model_(model), flags_(f) {
  // Main-grad sums in one flat buffer, each starting on a 512-byte boundary (16-byte alignment is
  // what the grouped GEMM's TMA and the optimizer's vector loads need).
  constexpr int64_t kAlign = 128;  // floats
  const auto named = model->named_parameters();
  int64_t total = 0;
  for (const auto& p : named) total += (p.value().numel() + kAlign - 1) / kAlign * kAlign;
  const torch::Tensor main_grads =
      torch::zeros({total}, named[0].value().options().dtype(torch::kFloat32));
  std::map<std::string, size_t> by_name;
  std::vector<torch::Tensor> decay, no_decay;
  int64_t offset = 0;
  for (const auto& p : named) {
    Slot s;
    s.param = p.value();
    s.master = p.value().scalar_type() == torch::kFloat32
                   ? p.value().detach()
                   : p.value().detach().to(torch::kFloat32).clone();
    s.main_grad = main_grads.narrow(0, offset, s.master.numel()).view(s.master.sizes());
    offset += (s.master.numel() + kAlign - 1) / kAlign * kAlign;
    by_name[p.key()] = slots_.size();
    (s.param.dim() >= 2 ? decay : no_decay).push_back(s.master);
    slots_.push_back(std::move(s));
  }
  // Hand the expert weights' main-grad buffers to their GroupedLinear layers.
  for (const auto& item : model->named_modules()) {
    auto layer = std::dynamic_pointer_cast<torchmoe::GroupedLinearImpl>(item.value());
    if (!layer) continue;
    std::vector<std::string> names;
    if (layer->options.single_grouped_weight()) {
      names.push_back("weight");
    } else {
      for (int64_t g = 0; g < layer->options.num_gemms(); ++g)
        names.push_back("weight" + std::to_string(g));
    }
    std::vector<torch::Tensor> buffers;
    for (const std::string& name : names) {
      Slot& s = slots_.at(by_name.at(item.key() + "." + name));
      s.fused = true;
      buffers.push_back(s.main_grad);
    }
    layer->set_main_grads(buffers);
  }
  using torchmoe::optim::FusedAdamWOptions;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay,
                      std::make_unique<FusedAdamWOptions>(
                          FusedAdamWOptions(f.lr).betas({0.9, 0.95}).weight_decay(f.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<FusedAdamWOptions>(
                                    FusedAdamWOptions(f.lr).betas({0.9, 0.95}).weight_decay(0.0)));
  optimizer_ = std::make_unique<torchmoe::optim::FusedAdamW>(std::move(groups));
  for (const Slot& s : slots_) {
    if (!s.master.is_same(s.param)) optimizer_->set_model_copy(s.master, s.param);
  }
}

void Trainer::accumulate(bool first_microbatch) {
  torch::NoGradGuard no_grad;
  for (Slot& s : slots_) {
    if (s.fused) continue;
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
  const torch::Tensor norm = optimizer_->clip_grad_norm(flags_.clip > 0 ? flags_.clip : INFINITY);
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  optimizer_->step();
  for (Slot& s : slots_) s.master.mutable_grad().reset();
  return norm.item<double>();
}

void Trainer::save(torch::serialize::OutputArchive& archive) const {
  torch::serialize::OutputArchive masters, buffers, optimizer;
  for (size_t i = 0; i < slots_.size(); ++i) masters.write(std::to_string(i), slots_[i].master);
  const auto model_buffers = model_->buffers();
  for (size_t i = 0; i < model_buffers.size(); ++i)
    buffers.write(std::to_string(i), model_buffers[i]);
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
  auto model_buffers = model_->buffers();
  for (size_t i = 0; i < model_buffers.size(); ++i) {
    torch::Tensor saved;
    buffers.read(std::to_string(i), saved);
    model_buffers[i].copy_(saved);
  }
  optimizer_->load(optimizer);
}

double learning_rate(const Flags& f, int64_t step) {
  if (step < f.warmup) return f.lr * static_cast<double>(step + 1) / static_cast<double>(f.warmup);
  const double span = std::max<int64_t>(1, f.steps - f.warmup);
  const double progress = std::min(1.0, static_cast<double>(step - f.warmup) / span);
  const double min_lr = f.lr * f.min_lr_ratio;
  return min_lr + 0.5 * (f.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace moe_lm
