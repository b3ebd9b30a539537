#pragma once
// One end-to-end GroupedLinear case (forward, backward, optional backward_dw) checked against the
// float64 reference; shared by the CPU and CUDA test files.

#include <torchmoe/torchmoe.h>

#include <cmath>
#include <optional>

#include "test_utils.h"

namespace torchmoe::test {

struct ModuleCase {
  torch::Dtype dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  int64_t in = 48, out = 80;
  std::vector<int64_t> splits;  // one per expert
  std::optional<std::vector<int64_t>>
      lead_shape;  // input shape without the features; default {rows}
  bool bias = true, fuse = false, delay = false, single_weight = false, single_bias = false;
  std::optional<bool> is_first_microbatch;
  bool splits_as_tensor = false;
};

// Axes of TE's test_grouped_linear_accuracy: dtype × num_gemms × bias × fuse_wgrad_accumulation ×
// delay_wgrad_compute × parameter layout, with random splits and one forced empty expert.
enum class Layout { kDiscrete, kSingleWeight, kSingleWeightAndBias };

inline ModuleCase matrix_case(torch::Dtype dtype, torch::Device device, int64_t groups, bool bias,
                              bool fuse, bool delay, Layout layout, int64_t rows, uint64_t seed) {
  ModuleCase c;
  c.dtype = dtype;
  c.device = device;
  c.splits = random_splits(groups, rows, /*zero_at=*/groups > 1 ? groups / 2 : -1, seed);
  c.bias = bias;
  c.fuse = fuse;
  c.delay = delay;
  c.single_weight = layout != Layout::kDiscrete;
  c.single_bias = layout == Layout::kSingleWeightAndBias;
  return c;
}

inline std::string describe(const ModuleCase& c) {
  std::ostringstream s;
  s << "dtype=" << c.dtype << " device=" << c.device << " in=" << c.in << " out=" << c.out
    << " splits=" << torch::IntArrayRef(c.splits) << " bias=" << c.bias << " fuse=" << c.fuse
    << " delay=" << c.delay << " single_weight=" << c.single_weight
    << " single_bias=" << c.single_bias << " first_microbatch="
    << (c.is_first_microbatch ? (*c.is_first_microbatch ? "true" : "false") : "none");
  return s.str();
}

inline std::vector<torch::Tensor> param_grads(GroupedLinear& m, const std::string& name,
                                              bool grouped, int64_t groups) {
  auto params = m->named_parameters();
  if (grouped) {
    const torch::Tensor grad = params[name].grad();
    return grad.defined() ? grad.unbind(0) : std::vector<torch::Tensor>(groups);
  }
  std::vector<torch::Tensor> grads;
  for (int64_t g = 0; g < groups; ++g) grads.push_back(params[name + std::to_string(g)].grad());
  return grads;
}

inline void run_module_case(const ModuleCase& c) {
  INFO(describe(c));
  torch::manual_seed(1234);
  const auto groups = static_cast<int64_t>(c.splits.size());
  GroupedLinear m(GroupedLinearOptions(groups, c.in, c.out)
                      .bias(c.bias)
                      .params_dtype(c.dtype)
                      .device(c.device)
                      .fuse_wgrad_accumulation(c.fuse)
                      .delay_wgrad_compute(c.delay)
                      .single_grouped_weight(c.single_weight)
                      .single_grouped_bias(c.single_bias));
  {
    torch::NoGradGuard no_grad;  // random biases, so a missing bias add cannot pass
    for (torch::Tensor b : m->expert_biases()) b.uniform_(-0.5, 0.5);
  }
  int64_t rows = 0;
  for (int64_t s : c.splits) rows += s;
  std::vector<int64_t> shape = c.lead_shape.value_or(std::vector<int64_t>{rows});
  shape.push_back(c.in);
  const auto options = torch::TensorOptions().dtype(c.dtype).device(c.device);
  const torch::Tensor x = torch::randn(shape, options).requires_grad_(true);
  shape.back() = c.out;
  // Scaled so weight gradients (sums over rows) stay O(1) and the tolerances keep their meaning.
  const torch::Tensor dy =
      torch::randn(shape, options) / std::sqrt(static_cast<double>(std::max<int64_t>(rows, 1)));
  constexpr double kSentinel = 0.5;
  for (torch::Tensor mg : m->main_grads()) mg.fill_(kSentinel);

  const torch::Tensor y =
      c.splits_as_tensor
          ? m->forward(x, torch::tensor(c.splits, torch::TensorOptions().device(c.device)),
                       c.is_first_microbatch)
          : m->forward(x, c.splits, c.is_first_microbatch);
  y.backward(dy);

  const Reference ref =
      reference_grouped_linear(x, c.splits, m->expert_weights(), m->expert_biases(), dy);
  const Tolerance tol = tolerance_for(c.dtype);
  check_close(y, ref.output, tol, "output");
  check_close(x.grad(), ref.grad_input, tol, "grad_input");
  if (c.bias) {
    // Bias gradients come from the main backward, also when the wgrad GEMM is delayed.
    const auto db = param_grads(m, "bias", c.single_bias, groups);
    for (int64_t g = 0; g < groups; ++g) check_close(db[g], ref.grad_biases[g], tol, "bias grad");
  }
  if (c.delay) {
    REQUIRE(m->pending_wgrad_count() == 1);
    for (const torch::Tensor& mg : m->main_grads()) {
      CHECK(mg.eq(kSentinel).all().item<bool>());  // untouched until backward_dw
    }
    for (const torch::Tensor& dw : param_grads(m, "weight", c.single_weight, groups)) {
      CHECK_FALSE(dw.defined());
    }
    m->backward_dw();
    REQUIRE(m->pending_wgrad_count() == 0);
  }
  if (c.fuse) {
    const bool overwrite = c.is_first_microbatch.value_or(false);
    // Main-grad buffers are fp32 whatever the parameters' dtype.
    const Tolerance main_tol = c.dtype == torch::kFloat64 ? tolerance_for(torch::kFloat32) : tol;
    std::vector<torch::Tensor> main = m->main_grads();
    if (c.single_weight) main = main[0].unbind(0);
    for (int64_t g = 0; g < groups; ++g) {
      check_close(main[g], ref.grad_weights[g] + (overwrite ? 0.0 : kSentinel), main_tol,
                  "main_grad");
    }
    for (const torch::Tensor& dw : param_grads(m, "weight", c.single_weight, groups)) {
      CHECK_FALSE(dw.defined());  // fused accumulation leaves .grad alone
    }
  } else {
    const auto dw = param_grads(m, "weight", c.single_weight, groups);
    for (int64_t g = 0; g < groups; ++g) {
      check_close(dw[g], ref.grad_weights[g], tol, "weight grad");
    }
  }
}

}  // namespace torchmoe::test
