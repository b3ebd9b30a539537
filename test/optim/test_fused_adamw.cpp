// FusedAdamW against torch::optim::AdamW: the same updates (float64 on the CPU to rounding;
// float32 on CUDA within fp32 tolerances of a float64 reference), the fused clip against
// torch::nn::utils::clip_grad_norm_, model copies, checkpoints that either optimizer loads, errors.

#include <c10/core/InferenceMode.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>
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
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{}, {7}, {33, 5}, {4, 4, 3}, {0}, {1001}}) {
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
    grad = torch::randn(params[i].sizes(), torch::TensorOptions(torch::kFloat64))
               .to(params[i].options());
  }
}

std::vector<torch::optim::OptimizerParamGroup> two_groups(const std::vector<torch::Tensor>& p) {
  // Decay on the matrices, none on the rest, and a different learning rate (per-group options).
  std::vector<torch::Tensor> decay = {p[2], p[3]}, rest = {p[0], p[1], p[4], p[5]};
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      decay, std::make_unique<FusedAdamWOptions>(FusedAdamWOptions(1e-2).weight_decay(0.1)));
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
      check_close(fused_params[i], torch_params[i],
                  clip ? Tolerance{1e-6, 1e-9} : Tolerance{1e-12, 1e-14},
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
  // An integer model of the right shape: the message names the dtype it got.
  REQUIRE_THROWS_WITH(
      adamw.set_model_copy(params[2], torch::zeros({33, 5}, torch::kInt32)),
      Contains("model must be a floating tensor of shape [33, 5] on cpu, got a tensor of dtype "
               "Int, shape [33, 5] on cpu"));
  REQUIRE_THROWS_AS(FusedAdamW(params, FusedAdamWOptions(1e-2).amsgrad(true)),
                    c10::NotImplementedError);
  REQUIRE_THROWS_WITH(FusedAdamW(params, FusedAdamWOptions(-1.0)),
                      Contains("FusedAdamW: lr must be finite and >= 0, got -1"));
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
  REQUIRE_THROWS_WITH(adamw.step(), Contains("FusedAdamW: lr must be finite and >= 0, got -1"));
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

TEST_CASE("FusedAdamW::load checks the whole checkpoint before it changes anything",
          "[optim][errors]") {
  const auto f32 = torch::TensorOptions(torch::kFloat32);
  const std::vector<torch::Tensor> saved_params = make_params(f32, 11);
  FusedAdamW saved(two_groups(saved_params));
  set_grads(saved_params, 0);
  saved.step();
  std::stringstream checkpoint;
  torch::save(saved, checkpoint);

  // A target whose state and options a refused load must leave as they were.
  const std::vector<torch::Tensor> params = make_params(f32, 12);
  FusedAdamW target(two_groups(params));
  set_grads(params, 0);
  target.step();
  const auto moment = [&](const torch::Tensor& p) {
    return static_cast<const torch::optim::AdamWParamState&>(
               *target.state().at(p.unsafeGetTensorImpl()))
        .exp_avg()
        .clone();
  };
  const torch::Tensor moment_before = moment(params[2]);
  const double lr_before = target.param_groups()[0].options().get_lr();
  const auto unchanged = [&] {
    CHECK(torch::equal(moment(params[2]), moment_before));
    CHECK(target.param_groups()[0].options().get_lr() == lr_before);
  };

  // Other groups: LibTorch's loader would have replaced group 0 before it refused group 1.
  std::vector<torch::optim::OptimizerParamGroup> other_groups = two_groups(params);
  other_groups[1].params().pop_back();
  FusedAdamW fewer(other_groups);
  std::stringstream fewer_checkpoint;
  torch::save(fewer, fewer_checkpoint);
  REQUIRE_THROWS(torch::load(target, fewer_checkpoint));
  unchanged();

  // The same groups with a parameter of another shape: its moments would have been taken as they
  // are, and the next step refused.
  std::vector<torch::Tensor> reshaped = make_params(f32, 13);
  reshaped[2] = torch::randn({5, 33}, f32).requires_grad_(true);
  FusedAdamW other_shapes(two_groups(reshaped));
  set_grads(reshaped, 0);
  other_shapes.step();
  std::stringstream reshaped_checkpoint;
  torch::save(other_shapes, reshaped_checkpoint);
  REQUIRE_THROWS_WITH(torch::load(target, reshaped_checkpoint),
                      Contains("FusedAdamW::load: param group 0, parameter 0: the checkpoint's "
                               "exp_avg must be a Float tensor of shape [33, 5]") &&
                          Contains("got Float [5, 33]"));
  unchanged();

  // The good checkpoint loads: the saved optimizer's moments and options.
  torch::load(target, checkpoint);
  CHECK(
      torch::equal(moment(params[2]), static_cast<const torch::optim::AdamWParamState&>(
                                          *saved.state().at(saved_params[2].unsafeGetTensorImpl()))
                                          .exp_avg()));
}

TEST_CASE("FusedAdamW refuses options, tensors and clips it would misread", "[optim][errors]") {
  const auto f32 = torch::TensorOptions(torch::kFloat32);
  const std::vector<torch::Tensor> params = make_params(f32, 14);

  // Another optimizer's options in a group would be read as AdamW's fields.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{params[0]});
  groups.emplace_back(std::vector<torch::Tensor>{params[1]},
                      std::make_unique<torch::optim::SGDOptions>(0.1));
  REQUIRE_THROWS_WITH(FusedAdamW(groups, FusedAdamWOptions(1e-2)),
                      Contains("FusedAdamW: param group 1 must have FusedAdamWOptions, got another "
                               "optimizer's options"));
  REQUIRE_THROWS_WITH(FusedAdamW(params, FusedAdamWOptions(INFINITY)),
                      Contains("lr must be finite and >= 0, got inf"));
  {
    // An expanded parameter: its one element would take four updates. Refused before any
    // parameter or step count changes.
    const torch::Tensor one = torch::zeros({1}).expand({4}).requires_grad_(true);
    const torch::Tensor plain = torch::zeros({4}, torch::requires_grad());
    FusedAdamW expanded({plain, one}, FusedAdamWOptions(1e-2));
    plain.mutable_grad() = torch::ones({4});
    one.mutable_grad() = torch::ones({4});
    REQUIRE_THROWS_WITH(expanded.step(), Contains("FusedAdamW::step: a parameter must not overlap "
                                                  "itself (e.g. an expanded tensor)"));
    CHECK(torch::equal(plain, torch::zeros({4})));
    FusedAdamW master({plain}, FusedAdamWOptions(1e-2));
    REQUIRE_THROWS_WITH(master.set_model_copy(plain, torch::zeros({1}).expand({4})),
                        Contains("set_model_copy: model must not overlap itself"));
    // An archive without an optimizer's entries (the reader threw its own exception type).
    torch::serialize::OutputArchive empty;
    std::stringstream bytes;
    empty.save_to(bytes);
    torch::serialize::InputArchive read;
    read.load_from(bytes);
    REQUIRE_THROWS_WITH(master.load(read), Contains("FusedAdamW::load: the archive is not an "
                                                    "AdamW optimizer's state"));
  }
  REQUIRE_THROWS_WITH(FusedAdamW(params, FusedAdamWOptions(1e-2).weight_decay(INFINITY)),
                      Contains("weight_decay must be finite and >= 0, got inf"));

  FusedAdamW adamw(params, FusedAdamWOptions(1e-2));
  // Model copies that share memory with a parameter or with each other: one launch would write
  // that memory twice.
  REQUIRE_THROWS_WITH(adamw.set_model_copy(
                          params[2], params[3].detach().view({-1}).narrow(0, 0, 1).expand({33, 5})),
                      Contains("set_model_copy: model must not share memory with a parameter"));
  // Its own master's memory (an fp32 model without a separate master) is the master's value.
  adamw.set_model_copy(params[2], params[2].detach());
  const torch::Tensor shared = torch::zeros({33, 5}, torch::kBFloat16);
  const std::vector<torch::Tensor> same_shape = {params[2], torch::randn({33, 5}, f32)};
  FusedAdamW two(same_shape, FusedAdamWOptions(1e-2));
  two.set_model_copy(same_shape[0], shared);
  two.set_model_copy(same_shape[0], shared);  // re-pointing the same parameter's copy is fine
  REQUIRE_THROWS_WITH(two.set_model_copy(same_shape[1], shared),
                      Contains("set_model_copy: model must not share memory with another "
                               "parameter's model copy"));
  // An inference tensor cannot have its version bumped after the step has changed its state.
  torch::Tensor inference;
  {
    const c10::InferenceMode guard;
    inference = torch::zeros({33, 5}, torch::kBFloat16);
  }
  REQUIRE_THROWS_WITH(adamw.set_model_copy(params[2], inference),
                      Contains("model must not be an inference tensor"));

  // Two parameters over overlapping memory are refused before anything changes.
  const torch::Tensor flat = torch::randn({10}, f32);
  const std::vector<torch::Tensor> views = {flat.narrow(0, 0, 6), flat.narrow(0, 4, 6)};
  for (const torch::Tensor& v : views) v.mutable_grad() = torch::ones({6}, f32);
  FusedAdamW overlapping(views, FusedAdamWOptions(1e-2));
  const torch::Tensor flat_before = flat.clone();
  REQUIRE_THROWS_WITH(overlapping.step(),
                      Contains("FusedAdamW::step: two parameters or model copies share memory"));
  CHECK(torch::equal(flat, flat_before));
  CHECK(overlapping.state().empty());
  // Views side by side are fine.
  const std::vector<torch::Tensor> halves = {flat.narrow(0, 0, 5), flat.narrow(0, 5, 5)};
  for (const torch::Tensor& v : halves) v.mutable_grad() = torch::ones({5}, f32);
  FusedAdamW disjoint(halves, FusedAdamWOptions(1e-2));
  disjoint.step();
  CHECK_FALSE(torch::equal(flat, flat_before));
  // Dense tensors are compared by address range, others pair by pair: a strided view over a dense
  // parameter's memory, and dense ones listed out of address order.
  const torch::Tensor wide = torch::randn({12}, f32);
  const std::vector<torch::Tensor> mixed = {wide.narrow(0, 8, 4), wide.narrow(0, 0, 4),
                                            wide.narrow(0, 3, 4).unfold(0, 1, 2).squeeze(1)};
  for (const torch::Tensor& v : mixed) v.mutable_grad() = torch::ones_like(v);
  FusedAdamW strided(mixed, FusedAdamWOptions(1e-2));
  REQUIRE_THROWS_WITH(strided.step(),
                      Contains("FusedAdamW::step: two parameters or model copies share memory"));
  const std::vector<torch::Tensor> unordered = {wide.narrow(0, 8, 4), wide.narrow(0, 0, 4),
                                                wide.narrow(0, 4, 4)};
  for (const torch::Tensor& v : unordered) v.mutable_grad() = torch::ones({4}, f32);
  FusedAdamW side_by_side(unordered, FusedAdamWOptions(1e-2));
  side_by_side.step();

  // The op's errors say which parameter of which group they are about.
  std::vector<torch::Tensor> more = make_params(f32, 15);
  FusedAdamW named(two_groups(more));
  set_grads(more, 0);
  more[5].mutable_grad() = torch::zeros({3}, f32);  // group 1's parameter 3
  REQUIRE_THROWS_WITH(named.step(),
                      Contains("FusedAdamW::step: param group 1, its parameters 0, 1, 2, 3 as the "
                               "op's params[0], params[1], ...") &&
                          Contains("grads[3] must have shape [1001] like params[3], got [3]"));

  // max_norm = infinity measures only: an infinite norm does not turn into an inf / inf
  // multiplier that would make every parameter NaN.
  std::vector<torch::Tensor> measured = make_params(f32, 16);
  FusedAdamW measuring(measured, FusedAdamWOptions(1e-2));
  set_grads(measured, 0);
  measured[5].mutable_grad()[0] = INFINITY;
  CHECK(std::isinf(measuring.clip_grad_norm(INFINITY).item<double>()));
  measuring.step();
  CHECK(torch::isfinite(measured[2]).all().item<bool>());
}

TEST_CASE("FusedAdamW on CUDA keeps a NaN clip multiplier as clip_grad_norm_ does",
          "[optim][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  // A NaN norm: clip_grad_norm_'s clamp keeps its NaN multiplier, and so every parameter of the
  // step turns NaN, also those whose own gradients are finite. fmin(1, NaN) would have made it 1.
  for (const torch::Device device : {torch::Device(torch::kCPU), torch::Device(torch::kCUDA)}) {
    std::vector<torch::Tensor> params = make_params(torch::TensorOptions(device), 17);
    FusedAdamW adamw(params, FusedAdamWOptions(1e-2));
    set_grads(params, 0);
    params[5].mutable_grad()[0] = NAN;
    CHECK(std::isnan(adamw.clip_grad_norm(1.0).item<double>()));
    adamw.step();
    INFO(device);
    CHECK(torch::isnan(params[2]).all().item<bool>());
  }
}

TEST_CASE("FusedAdamW on CUDA matches a float64 AdamW, in one pass per group", "[optim][cuda]") {
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
