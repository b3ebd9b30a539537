// FusedAdamW against torch::optim::AdamW: the same updates (float64 on the CPU to rounding;
// float32 on CUDA within fp32 tolerances of a float64 reference), the fused clip against
// torch::nn::utils::clip_grad_norm_, model copies, checkpoints that either optimizer loads, errors.

#include <torch/nn/utils/clip_grad.h>
#include <torchmoe/optim/fused_adamw.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::optim::FusedAdamW;
using torchmoe::optim::FusedAdamWOptions;

namespace {

// Parameters of varied shapes (scalars, odd lengths, a matrix), as leaves.
std::vector<torch::Tensor> make_params(const torch::TensorOptions& options, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> params;
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {}, {7}, {33, 5}, {4, 4, 3}, {0}, {1001}}) {
    params.push_back(torch::randn(shape, options).requires_grad_(true));
  }
  return params;
}

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Gradients for step `step`: parameter 1 has none on odd steps (so its step count lags).
void set_grads(const std::vector<torch::Tensor>& params, int step) {
  torch::manual_seed(100 + step);
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor& grad = params[i].mutable_grad();
    if (i == 1 && step % 2 == 1) {
      grad = torch::Tensor();
      continue;
    }
    grad = torch::randn(params[i].sizes(), torch::TensorOptions(torch::kFloat64)).to(params[i].options());
  }
}

std::vector<torch::optim::OptimizerParamGroup> two_groups(const std::vector<torch::Tensor>& p) {
  // Decay on the matrices, none on the rest, and a different learning rate (per-group options).
  std::vector<torch::Tensor> decay = {p[2], p[3]}, rest = {p[0], p[1], p[4], p[5]};
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay,
                      std::make_unique<FusedAdamWOptions>(FusedAdamWOptions(1e-2).weight_decay(0.1)));
  groups.emplace_back(rest, std::make_unique<FusedAdamWOptions>(
                                FusedAdamWOptions(3e-3).betas({0.8, 0.95}).weight_decay(0.0)));
  return groups;
}

}  // namespace

TEST_CASE("FusedAdamW matches torch::optim::AdamW (CPU, float64)", "[optim]") {
  const bool clip = GENERATE(false, true);
  INFO("clip=" << clip);
  const auto f64 = torch::TensorOptions(torch::kFloat64);
  const std::vector<torch::Tensor> fused_params = make_params(f64, 3);
  const std::vector<torch::Tensor> torch_params = clones(fused_params);
  FusedAdamW fused(two_groups(fused_params));
  torch::optim::AdamW reference(two_groups(torch_params));
  for (int step = 0; step < 5; ++step) {
    set_grads(fused_params, step);
    set_grads(torch_params, step);
    if (clip) {
      const double max_norm = 0.5;
      const torch::Tensor norm = fused.clip_grad_norm(max_norm);
      std::vector<torch::Tensor> with_grads;
      for (const auto& p : torch_params) {
        if (p.grad().defined()) with_grads.push_back(p);
      }
      const double expected = torch::nn::utils::clip_grad_norm_(with_grads, max_norm);
      CHECK(norm.item<double>() == Approx(expected).epsilon(1e-6));
    }
    fused.step();
    reference.step();
    for (size_t i = 0; i < fused_params.size(); ++i) {
      // Clipping multiplies by a float32 coefficient here and a float64 one in torch.
      check_close(fused_params[i], torch_params[i], clip ? Tolerance{1e-6, 1e-9} : Tolerance{1e-12, 1e-14},
                  "param " + std::to_string(i) + " after step " + std::to_string(step));
    }
  }
}

TEST_CASE("FusedAdamW checkpoints load into torch::optim::AdamW and back", "[optim]") {
  const auto f64 = torch::TensorOptions(torch::kFloat64);
  const std::vector<torch::Tensor> a = make_params(f64, 5);
  const std::vector<torch::Tensor> b = clones(a);
  FusedAdamW fused(two_groups(a));
  torch::optim::AdamW reference(two_groups(b));
  for (int step = 0; step < 3; ++step) {
    set_grads(a, step);
    set_grads(b, step);
    fused.step();
    reference.step();
  }
  // Swap the optimizers' states through archives and keep going: both continue identically.
  std::stringstream fused_state, reference_state;
  torch::save(fused, fused_state);
  torch::save(reference, reference_state);
  const std::vector<torch::Tensor> a2 = clones(a), b2 = clones(b);
  FusedAdamW fused2(two_groups(a2));
  torch::optim::AdamW reference2(two_groups(b2));
  torch::load(fused2, reference_state);
  torch::load(reference2, fused_state);
  for (int step = 3; step < 5; ++step) {
    set_grads(a2, step);
    set_grads(b2, step);
    fused2.step();
    reference2.step();
  }
  for (size_t i = 0; i < a2.size(); ++i) {
    check_close(a2[i], b2[i], {1e-12, 1e-14}, "param " + std::to_string(i));
  }
}

TEST_CASE("FusedAdamW writes model copies and rejects what it does not support",
          "[optim][errors]") {
  const std::vector<torch::Tensor> params = make_params(torch::kFloat32, 7);
  FusedAdamW adamw(params, FusedAdamWOptions(1e-2));
  const torch::Tensor copy = torch::zeros({33, 5}, torch::kBFloat16);
  adamw.set_model_copy(params[2], copy);
  set_grads(params, 0);
  adamw.step();
  CHECK(torch::equal(copy, params[2].detach().to(torch::kBFloat16)));

  REQUIRE_THROWS_WITH(adamw.set_model_copy(torch::zeros({33, 5}), copy),
                      Contains("set_model_copy: param is not one of the optimizer's parameters"));
  REQUIRE_THROWS_WITH(adamw.set_model_copy(params[2], torch::zeros({5, 33})),
                      Contains("set_model_copy: model must be a floating tensor of shape [33, 5]"));
  REQUIRE_THROWS_AS(FusedAdamW(params, FusedAdamWOptions(1e-2).amsgrad(true)),
                    c10::NotImplementedError);
  REQUIRE_THROWS_WITH(FusedAdamW(params, FusedAdamWOptions(-1.0)),
                      Contains("FusedAdamW: lr must be >= 0, got -1"));
  REQUIRE_THROWS_WITH(FusedAdamW(params, FusedAdamWOptions(1e-3).betas({0.9, 1.0})),
                      Contains("betas must be in [0, 1), got (0.9, 1)"));
  FusedAdamW no_grads(make_params(torch::kFloat32, 8));
  REQUIRE_THROWS_WITH(no_grads.clip_grad_norm(1.0),
                      Contains("clip_grad_norm: no parameter has a gradient"));
  REQUIRE_THROWS_WITH(adamw.clip_grad_norm(0.0), Contains("max_norm must be positive, got 0"));
}

TEST_CASE("A refused FusedAdamW step changes nothing", "[optim][errors]") {
  // Two groups; the second's options turn invalid after construction. The step is refused
  // before the first group is written: values, step counts and version counters stay.
  const std::vector<torch::Tensor> first = make_params(torch::kFloat32, 9);
  const std::vector<torch::Tensor> second = make_params(torch::kFloat32, 10);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(first);
  groups.emplace_back(second);
  FusedAdamW adamw(groups, FusedAdamWOptions(1e-2));
  set_grads(first, 2);  // even steps: every parameter has a gradient
  set_grads(second, 4);
  adamw.step();  // every parameter has a state of step 1
  std::vector<torch::Tensor> values;
  std::vector<int64_t> versions;
  for (const torch::Tensor& p : first) {
    values.push_back(p.detach().clone());
    versions.push_back(p._version());
  }
  static_cast<FusedAdamWOptions&>(adamw.param_groups()[1].options()).lr(-1.0);
  REQUIRE_THROWS_WITH(adamw.step(), Contains("FusedAdamW: lr must be >= 0, got -1"));
  for (size_t i = 0; i < first.size(); ++i) {
    CHECK(torch::equal(first[i], values[i]));
    CHECK(first[i]._version() == versions[i]);
    const auto& state = static_cast<const torch::optim::AdamWParamState&>(
        *adamw.state().at(first[i].unsafeGetTensorImpl()));
    CHECK(state.step() == 1);
  }
  static_cast<FusedAdamWOptions&>(adamw.param_groups()[1].options()).lr(1e-2);
  adamw.step();
  CHECK_FALSE(torch::equal(first[0], values[0]));
  CHECK(first[0]._version() > versions[0]);

  // A parameter in two groups (LibTorch's constructor lets it through) would be updated twice.
  const torch::Tensor twice = first[2];
  std::vector<torch::optim::OptimizerParamGroup> overlapping;
  overlapping.emplace_back(std::vector<torch::Tensor>{twice});
  overlapping.emplace_back(std::vector<torch::Tensor>{twice});
  FusedAdamW duplicated(overlapping, FusedAdamWOptions(1e-2));
  const torch::Tensor before = twice.detach().clone();
  REQUIRE_THROWS_WITH(duplicated.step(),
                      Contains("FusedAdamW::step: a parameter appears more than once in the "
                               "parameter groups"));
  CHECK(torch::equal(twice, before));
}

TEST_CASE("FusedAdamW on CUDA matches a float64 AdamW, in one pass per group",
          "[optim][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool clip = GENERATE(false, true);
  INFO("clip=" << clip);
  // 100 tensors (three launches of 48): sizes around the 16K chunk and the 4-element vectors,
  // empty ones, and views that start off a 16-byte boundary (the scalar path).
  torch::manual_seed(9);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  std::vector<torch::Tensor> masters, copies;
  for (int i = 0; i < 100; ++i) {
    const int64_t n = i % 10 == 0 ? 0 : (i * 2749) % 20000 + (i % 3);
    torch::Tensor p = torch::randn({n}, cuda);
    if (i % 7 == 3) p = torch::empty({n + 1}, cuda).narrow(0, 1, n).copy_(p);  // unaligned
    masters.push_back(p.detach().requires_grad_(true));
    copies.push_back(torch::zeros({n}, cuda.dtype(i % 2 ? torch::kBFloat16 : torch::kFloat16)));
  }
  std::vector<torch::Tensor> reference;
  for (const auto& p : masters) {
    reference.push_back(p.detach().cpu().to(torch::kFloat64).requires_grad_(true));
  }
  FusedAdamW fused(masters, FusedAdamWOptions(1e-2).weight_decay(0.05));
  for (size_t i = 0; i < masters.size(); ++i) fused.set_model_copy(masters[i], copies[i]);
  torch::optim::AdamW expected(reference, FusedAdamWOptions(1e-2).weight_decay(0.05));
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < masters.size(); ++i) {
      const torch::Tensor g = torch::randn(masters[i].sizes(), cuda) * (i % 5 + 1);
      masters[i].mutable_grad() = g;
      reference[i].mutable_grad() = g.cpu().to(torch::kFloat64);
    }
    if (clip) {
      const torch::Tensor norm = fused.clip_grad_norm(10.0);
      const double want = torch::nn::utils::clip_grad_norm_(reference, 10.0);
      CHECK(norm.item<double>() == Approx(want).epsilon(1e-5));
    }
    fused.step();
    expected.step();
  }
  for (size_t i = 0; i < masters.size(); ++i) {
    INFO("tensor " << i << " of " << masters[i].numel());
    check_close(masters[i], reference[i], {1e-5, 1e-6}, "master");
    CHECK(torch::equal(copies[i], masters[i].detach().to(copies[i].scalar_type())));
  }
  // The norm is deterministic: the same gradients give the same bits.
  const torch::Tensor n1 = fused.clip_grad_norm(1.0), n2 = fused.clip_grad_norm(1.0);
  CHECK(torch::equal(n1, n2));
}

TEST_CASE("FusedAdamW on CUDA rejects what its kernels do not take", "[optim][cuda][errors]") {
  TORCHMOE_REQUIRE_CUDA();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor p64 = torch::randn({4}, cuda.dtype(torch::kFloat64)).requires_grad_(true);
  p64.mutable_grad() = torch::ones_like(p64);
  // A float32 parameter before it, in its own group: the refused step leaves it, its state and
  // its version counter as they were.
  const torch::Tensor p32 = torch::randn({4}, cuda).requires_grad_(true);
  p32.mutable_grad() = torch::ones_like(p32);
  const torch::Tensor p32_before = p32.detach().clone();
  const int64_t p32_version = p32._version();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{p32});
  groups.emplace_back(std::vector<torch::Tensor>{p64});
  FusedAdamW adamw(groups);
  REQUIRE_THROWS_WITH(adamw.step(), Contains("params[0] must be float32 on CUDA, got Double"));
  CHECK(torch::equal(p32, p32_before));
  CHECK(p32._version() == p32_version);
  CHECK(adamw.state().empty());

  FusedAdamW single({p32});
  REQUIRE_THROWS_WITH(
      single.set_model_copy(p32, torch::zeros({4}, cuda.dtype(torch::kFloat64))),
      Contains("set_model_copy: a CUDA model must be float32, float16 or bfloat16 (the step's "
               "kernels write those), got Double"));
}
