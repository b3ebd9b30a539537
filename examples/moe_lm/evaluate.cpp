// moe_lm's validation loss, generation and MoE profile (evaluate.h).

#include "evaluate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>

#include <torchmoe/distributed/collectives.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "report.h"
#include "step.h"

namespace moe_lm {
namespace {

// Times `n` calls of fn (after 3 untimed ones), synchronising the device around them; ms per call.
template <typename Fn>
double time_ms(int64_t n, const torch::Device& device, Fn&& fn) {
  for (int i = 0; i < 3; ++i) fn();
  if (device.is_cuda()) torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) fn();
  if (device.is_cuda()) torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
         static_cast<double>(n);
}

}  // namespace

torch::Tensor rank_sum(const torch::Tensor& value, const MoETransformer& model) {
  if (!model->expert_parallel) return value;
  torch::Tensor sum = value.detach().clone();
  torchmoe::distributed::all_reduce_sum_(sum, *model->expert_parallel);
  return sum;
}

double evaluate(MoETransformer& model, const Corpus& c, const Flags& f, int64_t rank,
                const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  // Fixed, evenly spaced validation windows.
  const int64_t span = c.valid.size(0) - f.model.seq - 1;
  const int64_t count = f.eval_batches * f.batch;
  const torch::Tensor starts =
      torch::linspace(0, static_cast<double>(span), count).to(torch::kLong);
  torch::Tensor total = torch::zeros({}, torch::TensorOptions(torch::kFloat32).device(device));
  for (int64_t b = 0; b < f.eval_batches; ++b) {
    const Batch batch =
        windows(c.valid, rank_part(starts, b * f.batch, f.batch, f, rank), f.model.seq, device);
    total += lm_loss(model(batch.input), batch.target);
  }
  model->train();
  return rank_sum(total, model).item<double>() / static_cast<double>(f.eval_batches * f.ranks());
}

void generate(MoETransformer& model, const Flags& f, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(f.seed);
  std::vector<int64_t> context(f.prompt.begin(), f.prompt.end());
  for (int64_t& b : context) b = static_cast<uint8_t>(b);
  if (context.empty()) context.push_back('\n');
  std::string text = f.prompt;
  for (int64_t i = 0; i < f.generate; ++i) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(context.size()), model->config.seq);
    const torch::Tensor input =
        torch::tensor(std::vector<int64_t>(context.end() - n, context.end()))
            .view({1, n})
            .to(device);
    const torch::Tensor logits = model(input).logits[0][n - 1].to(torch::kCPU);
    int64_t next = 0;
    if (f.temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      next = torch::multinomial(torch::softmax(logits / f.temperature, 0), 1, false, gen)
                 .item<int64_t>();
    }
    context.push_back(next);
    text.push_back(static_cast<char>(next));
  }
  say("{}\n", text);
}

void profile_moe(MoETransformer& model, Trainer& trainer, const Flags& f,
                 const torch::Device& device, const torch::Dtype dtype, double step_ms) {
  torchmoe::MoELayer moe = model->moe_layers().at(0);
  // A rank's tokens: --batch / --ep sequences with --ep.
  const torch::Tensor x = torch::randn({f.batch / f.ranks() * f.model.seq, f.model.hidden},
                                       torch::TensorOptions(dtype).device(device))
                              .requires_grad_(true);
  const double ms = time_ms(f.profile_moe, device, [&] {
    const torchmoe::MoEOutput out = moe(x);
    (out.output.to(torch::kFloat32).square().mean() + out.aux_loss).backward();
  });
  const double share = 100.0 * ms * static_cast<double>(f.model.layers * f.accum) / step_ms;
  say("moe profile: one MoE layer fwd+bwd {:.3f} ms x {} layers x {} micro-batches = {:.1f}% of a "
      "{:.1f} ms step\n",
      ms, f.model.layers, f.accum, share, step_ms);
  // The optimizer step: gradient norm, clip, AdamW on the masters and their bf16 copies, and the
  // clearing of the gradient sums (with its host read of the norm).
  const double step_only = time_ms(f.profile_moe, device, [&] { trainer.step(0.0); });
  say("moe profile: optimizer step {:.3f} ms = {:.1f}% of a {:.1f} ms step\n", step_only,
      100.0 * step_only / step_ms, step_ms);
  // The profiling passes wrote into the main-grad buffers, .grad and the optimizer state (with a
  // learning rate of 0); nothing is trained after this.
}

}  // namespace moe_lm
