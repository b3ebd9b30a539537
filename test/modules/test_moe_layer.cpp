// MoELayer vs a float64 reference built from plain ATen (router by hand, a loop over experts),
// output, aux loss and every gradient; float64 on the CPU, float32 and bfloat16 on CUDA; errors.

#include <torchmoe/torchmoe.h>

#include <sstream>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::MoELayer;
using torchmoe::MoELayerOptions;
using torchmoe::TopKRouter;
using torchmoe::TopKRouterOptions;

namespace {

struct Reference {
  torch::Tensor output, aux_loss, grad_x, grad_router;
  std::vector<torch::Tensor> grad_fc1, grad_fc2;
};

torch::Tensor leaf(const torch::Tensor& t) {
  return t.detach().to(torch::kCPU, torch::kFloat64).requires_grad_(true);
}

// Softmax top-k router with renormalisation, Switch aux loss, SwiGLU experts without bias.
Reference reference_moe(MoELayer& moe, const torch::Tensor& x_in, const torch::Tensor& dy) {
  torch::AutoGradMode enable(true);
  const auto& o = moe->options;
  const int64_t e_count = o.num_experts(), k = o.router().topk(), ffn = o.experts().ffn_hidden();
  const torch::Tensor x = leaf(x_in.reshape({-1, o.hidden()}));
  const torch::Tensor w_router = leaf(moe->router->weight);
  std::vector<torch::Tensor> w1, w2;
  for (const auto& w : moe->experts->fc1->expert_weights()) w1.push_back(leaf(w));
  for (const auto& w : moe->experts->fc2->expert_weights()) w2.push_back(leaf(w));

  const int64_t tokens = x.size(0);
  const torch::Tensor scores = torch::softmax(torch::linear(x, w_router), 1);
  const torch::Tensor indices = std::get<1>(scores.detach().topk(k, 1));
  torch::Tensor probs = scores.gather(1, indices);
  if (k > 1) probs = probs / probs.sum(1, true);

  torch::Tensor out = torch::zeros_like(x);
  torch::Tensor counts = torch::zeros({e_count}, torch::kFloat64);
  for (int64_t e = 0; e < e_count; ++e) {
    const torch::Tensor hit = (indices == e);  // [T, k]
    counts[e] = hit.sum().item<double>();
    const torch::Tensor rows = torch::nonzero(hit.any(1)).reshape(-1);
    if (rows.numel() == 0) continue;
    const torch::Tensor z = torch::linear(x.index_select(0, rows), w1[e]);
    const torch::Tensor h = torch::silu(z.narrow(1, 0, ffn)) * z.narrow(1, ffn, ffn);
    const torch::Tensor p = (probs * hit.to(torch::kFloat64)).sum(1).index_select(0, rows);
    out = out.index_add(0, rows, torch::linear(h, w2[e]) * p.unsqueeze(1));
  }
  const torch::Tensor aux = o.router().aux_loss_coeff() * e_count / (double(k) * tokens * tokens) *
                            (scores.sum(0) * counts).sum();
  ((out * dy.to(torch::kCPU, torch::kFloat64).reshape(out.sizes())).sum() + aux).backward();

  Reference ref;
  ref.output = out.detach().reshape(x_in.sizes());
  ref.aux_loss = aux.detach();
  ref.grad_x = x.grad().reshape(x_in.sizes());
  ref.grad_router = w_router.grad();
  for (const auto& w : w1)
    ref.grad_fc1.push_back(w.grad().defined() ? w.grad() : torch::zeros_like(w));
  for (const auto& w : w2)
    ref.grad_fc2.push_back(w.grad().defined() ? w.grad() : torch::zeros_like(w));
  return ref;
}

// |a - e| <= rel · (|e| + max|e|): relative to each element and to the tensor's scale.
void check_scaled(const torch::Tensor& actual, const torch::Tensor& expected, double rel,
                  const std::string& what) {
  const double scale = expected.numel() ? expected.abs().max().item<double>() : 0.0;
  check_close(actual, expected, {rel, rel * scale + 1e-12}, what);
}

// flat: x [63, hidden] (taken as it is) instead of [3, 21, hidden] (reshaped and back). aux: the
// aux loss's coefficient (0: the router's top-k gets its gradient from the probabilities alone).
void check_layer(torch::Dtype dtype, torch::Device device, int64_t topk, double rel,
                 bool single = false, bool flat = false, double aux = 0.05) {
  torch::manual_seed(17);
  const int64_t hidden = 32, ffn = 48, experts = 6;
  MoELayerOptions options(hidden, ffn, experts, topk);
  options.params_dtype(dtype).device(device);
  options.router().aux_loss_coeff(aux);
  options.experts().linear().single_grouped_weight(single);
  MoELayer moe(options);
  const std::vector<int64_t> shape =
      flat ? std::vector<int64_t>{63, hidden} : std::vector<int64_t>{3, 21, hidden};
  const torch::Tensor x = (torch::randn(shape) * 0.5).to(dtype).to(device).requires_grad_(true);
  const torch::Tensor dy = torch::randn(shape).to(dtype).to(device);
  const auto out = moe(x);
  (out.output * dy).sum().add(out.aux_loss).backward();
  const Reference ref = reference_moe(moe, x, dy);

  CHECK(out.output.scalar_type() == dtype);
  check_scaled(out.output, ref.output, rel, "output");
  check_scaled(out.aux_loss, ref.aux_loss, rel, "aux loss");
  check_scaled(x.grad(), ref.grad_x, rel, "grad x");
  check_scaled(moe->router->weight.grad(), ref.grad_router, rel, "grad router weight");
  // An expert weight without tokens has no gradient yet (None), as in PyTorch.
  auto grad_of = [&](torchmoe::GroupedLinear& fc, int64_t e) {
    const torch::Tensor w = single ? fc->named_parameters()["weight"]
                                   : fc->named_parameters()["weight" + std::to_string(e)];
    const torch::Tensor g = w.grad().defined() ? w.grad() : torch::zeros_like(w);
    return single ? g[e] : g;
  };
  for (int64_t e = 0; e < experts; ++e) {
    INFO("expert " << e);
    const torch::Tensor g1 = grad_of(moe->experts->fc1, e);
    const torch::Tensor g2 = grad_of(moe->experts->fc2, e);
    check_scaled(g1, ref.grad_fc1[e], rel, "grad fc1");
    check_scaled(g2, ref.grad_fc2[e], rel, "grad fc2");
  }
  CHECK(out.tokens_per_expert.sum().item<int64_t>() == 63 * topk);
}

}  // namespace

TEST_CASE("MoELayer matches a float64 loop-over-experts reference (CPU)", "[modules][moe]") {
  const int64_t topk = GENERATE(1, 2, 4);
  const bool single = GENERATE(false, true);
  const bool flat = GENERATE(false, true);
  INFO("topk=" << topk << " single_grouped_weight=" << single << " flat=" << flat);
  check_layer(torch::kFloat64, torch::kCPU, topk, 1e-10, single, flat);
}

// x with and without a gradient: the layer forks x between its router and its permutation only
// when x takes one (the router's gradient of x is then added by its GEMM); the output, the aux
// loss and the parameters' gradients are the same either way.
TEST_CASE("MoELayer gives the same results whether x takes a gradient or not", "[modules][moe]") {
  torch::manual_seed(71);
  MoELayerOptions options(16, 24, 4, 2);
  options.params_dtype(torch::kFloat64);
  options.router().aux_loss_coeff(0.05);
  MoELayer moe(options);
  const torch::Tensor x = torch::randn({30, 16}, torch::kFloat64);
  const torch::Tensor dy = torch::randn({30, 16}, torch::kFloat64);
  auto run = [&](bool x_grad) {
    moe->zero_grad();
    const torch::Tensor input = x.clone().requires_grad_(x_grad);
    const auto out = moe(input);
    (out.output * dy).sum().add(out.aux_loss).backward();
    return std::make_tuple(out.output.detach(), out.aux_loss.detach(),
                           moe->router->weight.grad().clone());
  };
  const auto [y1, aux1, grad1] = run(true);
  const auto [y0, aux0, grad0] = run(false);
  CHECK(torch::equal(y1, y0));
  CHECK(torch::equal(aux1, aux0));
  check_close(grad1, grad0, {1e-12, 1e-12}, "router weight gradient");
}

// Without an aux loss (or z-loss) the top-k's only gradient is the probabilities', which reaches
// it through the layer's link rather than as an output gradient: the router's weight gradient
// must still match.
TEST_CASE("MoELayer without an aux loss matches the reference", "[modules][moe]") {
  const bool cuda = GENERATE(false, true);
  TORCHMOE_RETURN_IF_NO_GPU_FOR(cuda);
  const torch::Dtype dtype = cuda ? torch::kBFloat16 : torch::kFloat64;
  INFO("dtype=" << dtype);
  check_layer(dtype, cuda ? torch::kCUDA : torch::kCPU, 2, cuda ? 3e-2 : 1e-10, false, true, 0.0);
}

// A second backward through a retained graph: the links' parts are taken as they are used, so
// each backward gives the same gradients (twice one backward's, accumulated).
TEST_CASE("MoELayer's gradients through a retained graph", "[modules][moe]") {
  const bool cuda = GENERATE(false, true);
  TORCHMOE_RETURN_IF_NO_GPU_FOR(cuda);
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  const torch::Dtype dtype = cuda ? torch::kFloat32 : torch::kFloat64;
  INFO("device=" << device);
  torch::manual_seed(73);
  MoELayerOptions options(16, 24, 4, 2);
  options.params_dtype(dtype).device(device);
  options.router().aux_loss_coeff(0.05);
  MoELayer moe(options);
  const torch::Tensor x0 = torch::randn({30, 16}, torch::TensorOptions(dtype).device(device));
  const torch::Tensor dy = torch::randn_like(x0);
  auto grads = [&](int backwards) {
    moe->zero_grad();
    const torch::Tensor x = x0.clone().requires_grad_(true);
    const auto out = moe(x);
    const torch::Tensor loss = (out.output * dy).sum() + out.aux_loss;
    for (int i = 0; i < backwards; ++i) loss.backward({}, /*retain_graph=*/i + 1 < backwards);
    return std::make_pair(x.grad(), moe->router->weight.grad().clone());
  };
  const auto [x1, w1] = grads(1);
  const auto [x2, w2] = grads(2);
  const double tol = cuda ? 1e-5 : 1e-12;
  check_close(x2, 2 * x1, {tol, tol}, "grad x, two backwards");
  check_close(w2, 2 * w1, {tol, tol}, "router weight gradient, two backwards");
}

TEST_CASE("MoELayer matches the reference on CUDA", "[modules][moe][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const torch::Dtype dtype = GENERATE(torch::kFloat32, torch::kBFloat16);
  const int64_t topk = GENERATE(1, 2, 4);
  INFO("dtype=" << dtype << " topk=" << topk);
  check_layer(dtype, torch::kCUDA, topk, dtype == torch::kFloat32 ? 1e-4 : 3e-2);
}

TEST_CASE("MoELayer: the permutation fused into fc1 matches the permuted copy",
          "[modules][moe][cuda][sm90][gather]") {
  TORCHMOE_REQUIRE_SM90();
  const int64_t topk = GENERATE(1, 2, 4);
  const bool delay = GENERATE(false, true);
  // bf16, or FP8 (fc1's input quantize gathers the rows): none, current, delayed, block scaling.
  const int recipe = GENERATE(0, 1, 2, 3);
  // Dropless (device splits), or with a capacity (dropped slots, host splits, fewer rows).
  const bool capacity = GENERATE(false, true);
  INFO("topk=" << topk << " delay_wgrad_compute=" << delay << " recipe=" << recipe
               << " capacity=" << capacity);
  MaybeRecipe fp8;
  if (recipe == 1) fp8 = torchmoe::fp8::CurrentScaling();
  if (recipe == 2) fp8 = torchmoe::fp8::DelayedScaling().amax_history_len(4);
  if (recipe == 3) fp8 = torchmoe::fp8::BlockScaling();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torch::manual_seed(31);
  const torch::Tensor x_in = torch::randn({777, 256}, cuda);
  const torch::Tensor dy = torch::randn({777, 256}, cuda);
  struct Result {
    torch::Tensor output, aux_loss, grad_x;
    std::vector<std::pair<std::string, torch::Tensor>> grads;
  };
  // The same layer (same seed) with and without the fused permutation.
  auto run = [&](bool fuse) {
    torch::manual_seed(29);
    // FP8 operands need features in multiples of 16.
    MoELayerOptions options(/*hidden=*/256, /*ffn_hidden=*/fp8 ? 208 : 200, /*num_experts=*/12,
                            topk);
    options.params_dtype(torch::kBFloat16).device(torch::kCUDA);
    options.router().aux_loss_coeff(1e-2);
    if (capacity) options.router().capacity_factor(1.0);
    options.experts().linear().delay_wgrad_compute(delay);
    options.fuse_permutation(fuse);
    options.experts().linear().fp8_amax_history_len(4);
    MoELayer moe(options);
    const torch::Tensor x = x_in.clone().requires_grad_(true);
    torchmoe::MoEOutput out;
    {
      const auto guard = autocast_for(fp8);
      out = moe(x);
    }
    (out.output * dy).sum().add(out.aux_loss).backward();
    if (delay) moe->backward_dw();
    Result r{out.output.detach(), out.aux_loss.detach(), x.grad(), {}};
    for (const auto& p : moe->named_parameters()) {
      r.grads.emplace_back(
          p.key(), p.value().grad().defined() ? p.value().grad() : torch::zeros_like(p.value()));
    }
    return r;
  };
  const Result fused = run(true), copied = run(false);
  // The same kernels on the same data: equal up to bf16 rounding (in fact bit for bit).
  check_scaled(fused.output, copied.output, 1e-2, "output");
  check_scaled(fused.aux_loss, copied.aux_loss, 1e-2, "aux loss");
  check_scaled(fused.grad_x, copied.grad_x, 1e-2, "grad x");
  REQUIRE(fused.grads.size() == copied.grads.size());
  for (size_t i = 0; i < fused.grads.size(); ++i) {
    INFO(fused.grads[i].first);
    check_scaled(fused.grads[i].second, copied.grads[i].second, 1e-2, "parameter gradient");
  }
}

TEST_CASE("MoELayer in FP8 is close to the same layer in bf16", "[modules][moe][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  // The dropless layer keeps its split sizes on the device: the FP8 products take them there (the
  // grouped matmul) or copy them to the host once (per-group matmuls). Two FP8 layers in series,
  // current or delayed scaling (its state calibrated by one step first): relative Frobenius errors
  // as GroupedMLP's FP8 test bounds them (0.09 output, 0.14 gradients); the routing itself is
  // computed in fp32 from the same router, so the same experts are chosen.
  const bool delayed = GENERATE(false, true);
  INFO((delayed ? "DelayedScaling" : "CurrentScaling"));
  const auto recipe =
      delayed ? torchmoe::fp8::Recipe(torchmoe::fp8::DelayedScaling().amax_history_len(4))
              : torchmoe::fp8::Recipe(torchmoe::fp8::CurrentScaling());
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torch::manual_seed(41);
  MoELayerOptions options(/*hidden=*/256, /*ffn_hidden=*/256, /*num_experts=*/8, /*topk=*/2);
  options.params_dtype(torch::kBFloat16).device(torch::kCUDA);
  options.experts().linear().fp8_amax_history_len(4);
  MoELayer moe(options);
  const torch::Tensor x_in = torch::randn({501, 256}, cuda);
  const torch::Tensor dy = torch::randn({501, 256}, cuda);
  auto run = [&](bool fp8) {
    moe->zero_grad();
    const torch::Tensor x = x_in.clone().requires_grad_(true);
    torchmoe::MoEOutput out;
    {
      const torchmoe::fp8::Autocast guard(recipe, fp8);
      out = moe(x);
    }
    (out.output * dy).sum().backward();
    if (fp8 && delayed) {
      torchmoe::fp8::update_delayed_scaling(*moe, std::get<torchmoe::fp8::DelayedScaling>(recipe),
                                            torchmoe::fp8::Pass::kForward);
      torchmoe::fp8::update_delayed_scaling(*moe, std::get<torchmoe::fp8::DelayedScaling>(recipe),
                                            torchmoe::fp8::Pass::kBackward);
    }
    std::vector<torch::Tensor> grads{x.grad()};
    for (const auto& p : moe->experts->named_parameters()) grads.push_back(p.value().grad());
    return std::make_pair(out.output.detach(), grads);
  };
  if (delayed) run(true);  // calibrates the scales (the first step casts with scale 1)
  const auto [y_ref, g_ref] = run(false);
  const auto [y, g] = run(true);
  auto rel = [](const torch::Tensor& a, const torch::Tensor& e) {
    return ((a.to(torch::kFloat) - e.to(torch::kFloat)).norm() / e.to(torch::kFloat).norm())
        .item<double>();
  };
  const double y_err = rel(y, y_ref);
  CHECK(y_err < 0.09);
  CHECK(y_err > 0.005);  // FP8 ran
  REQUIRE(g.size() == g_ref.size());
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("gradient " << i);
    REQUIRE(g[i].defined());
    CHECK(rel(g[i], g_ref[i]) < 0.14);
  }
}

TEST_CASE("MoELayer errors", "[modules][moe]") {
  MoELayer moe(MoELayerOptions(8, 16, 4, 2));
  CHECK_THROWS_WITH(moe(torch::randn({3, 7})), Contains("x must be [..., hidden=8], got [3, 7]"));
  CHECK_THROWS_WITH(MoELayer(MoELayerOptions(8, 16, 4, 5)),
                    Contains("topk must be in [1, num_experts=4], got 5"));
  CHECK_THROWS_WITH(moe(torch::randn({3, 8}, torch::kFloat64)),
                    Contains("MoELayer: x must have the experts' dtype Float, got Double"));
  MoELayerOptions mismatched(8, 16, 4, 2);
  mismatched.experts().hidden(12);
  CHECK_THROWS_WITH(MoELayer(mismatched),
                    Contains("MoELayer: the router and the experts must agree on hidden and "
                             "num_experts, got router (8, 4) and experts (12, 4)"));
  // The options are public: forward checks what it relies on against what was built.
  const torch::Tensor x = torch::randn({3, 8});
  moe->options.pad_to_capacity(true);
  CHECK_THROWS_AS(moe(x), c10::NotImplementedError);
  CHECK_THROWS_WITH(moe(x), Contains("pad_to_capacity is implemented for expert_parallel only"));
  moe->options.pad_to_capacity(false);
  moe->options.router().num_experts(8);
  CHECK_THROWS_WITH(moe(x), Contains("num_experts=8 over 1 rank(s) does not match the router (4 "
                                     "experts) and the experts (4 on this rank)"));
  moe->options.router().num_experts(4);
  CHECK_NOTHROW(moe(x));
}

TEST_CASE("MoELayer options: one aux-loss default, the router's", "[modules][moe]") {
  const MoELayerOptions options(8, 16, 4, 2);
  CHECK(options.router().aux_loss_coeff() == torchmoe::TopKRouterOptions(8, 4, 2).aux_loss_coeff());
  CHECK_FALSE(options.experts().linear().bias());
}

TEST_CASE("MoELayer follows ->to(dtype); the router's expert bias stays float32",
          "[modules][moe]") {
  MoELayerOptions options(8, 16, 4, 2);
  options.router().expert_bias(true);
  MoELayer moe(options);
  moe->to(torch::kFloat64);
  const auto out = moe(torch::randn({5, 8}, torch::kFloat64));
  CHECK(out.output.scalar_type() == torch::kFloat64);
  CHECK(moe->router->expert_bias.scalar_type() == torch::kFloat32);
  CHECK(moe->router->expert_load.scalar_type() == torch::kFloat32);
  CHECK(moe->router->expert_load.sum().item<double>() == 10.0);  // 5 tokens, top-2
}

TEST_CASE("MoELayer's aux loss has the z-loss its router computes", "[modules][moe]") {
  // The router's options decide, also when changed after the layer was built from its own.
  MoELayer moe(MoELayerOptions(8, 16, 4, 2));
  moe->to(torch::kFloat64);
  const torch::Tensor x = torch::randn({6, 8}, torch::kFloat64);
  const torch::Tensor without = moe(x).aux_loss;
  constexpr double kCoeff = 0.25;
  moe->router->options.z_loss_coeff(kCoeff);
  const torch::Tensor with = moe(x).aux_loss;
  // z-loss = coeff · mean over tokens of logsumexp(logits)².
  const torch::Tensor logits = torch::linear(x, moe->router->weight.detach());
  const double z = kCoeff * torch::logsumexp(logits, 1).square().mean().item<double>();
  CHECK(std::abs((with - without).item<double>() - z) <= 1e-12 * std::max(1.0, z));
}

TEST_CASE("MoELayer and GroupedMLP move and copy and load whole or not at all",
          "[modules][moe][errors]") {
  torch::manual_seed(41);
  MoELayerOptions options(8, 16, 4, 2);
  options.experts().linear().delay_wgrad_compute(true);
  MoELayer moe(options);
  moe(torch::randn({6, 8})).output.sum().backward();  // queues the experts' weight gradients
  // Refused before anything moves: Module::to would convert the router before the experts refuse.
  REQUIRE_THROWS_WITH(
      moe->to(torch::kFloat64),
      Contains("MoELayer::to: 1 delayed weight-gradient computation(s) are queued"));
  CHECK(moe->router->weight.scalar_type() == torch::kFloat32);
  REQUIRE_THROWS_WITH(moe->experts->to(torch::kFloat64),
                      Contains("GroupedMLP::to: 1 delayed weight-gradient computation(s)"));
  // A copy would start with an empty queue while the work writes into the original's main grads.
  REQUIRE_THROWS_WITH(moe->clone(), Contains("GroupedLinear::clone: 1 delayed"));
  moe->backward_dw();
  moe->to(torch::kFloat64);
  CHECK(moe->router->weight.scalar_type() == torch::kFloat64);

  // A checkpoint of other experts: the router (loaded first) is restored when the experts refuse.
  MoELayer other(MoELayerOptions(8, 16, 2, 2));
  std::stringstream checkpoint;
  torch::save(other, checkpoint);
  MoELayer target(MoELayerOptions(8, 16, 4, 2));
  const torch::Tensor router_before = target->router->weight.detach().clone();
  REQUIRE_THROWS(torch::load(target, checkpoint));
  CHECK(torch::equal(target->router->weight, router_before));
  // A router checkpoint of another shape or dtype: shapes checked, dtype kept.
  TopKRouter small(TopKRouterOptions(8, 2, 1));
  std::stringstream router_checkpoint;
  torch::save(small, router_checkpoint);
  REQUIRE_THROWS_WITH(torch::load(target->router, router_checkpoint),
                      Contains("TopKRouter::load: 'weight' must have shape [4, 8], got [2, 8]"));
  TopKRouter doubles(TopKRouterOptions(8, 4, 2).params_dtype(torch::kFloat64));
  std::stringstream doubles_checkpoint;
  torch::save(doubles, doubles_checkpoint);
  torch::load(target->router, doubles_checkpoint);
  CHECK(target->router->weight.scalar_type() == torch::kFloat32);
  CHECK(torch::allclose(target->router->weight, doubles->weight.to(torch::kFloat32)));
  // A complex weight would lose its imaginary part.
  TopKRouter complex(TopKRouterOptions(8, 4, 2));
  complex->weight.set_data(torch::zeros({4, 8}, torch::kComplexFloat));
  std::stringstream complex_checkpoint;
  torch::save(complex, complex_checkpoint);
  REQUIRE_THROWS_WITH(torch::load(target->router, complex_checkpoint),
                      Contains("TopKRouter::load: 'weight' must have a floating dtype, got "
                               "ComplexFloat"));
  // The shared expert's gate, a parameter of the layer itself, is checked as the children's are
  // (Module::load would take any shape or dtype, reinterpreting the bytes).
  MoELayerOptions gated_options(8, 16, 4, 2);
  gated_options.shared_expert(torchmoe::SharedExpertOptions(16).gate(true));
  MoELayer gated(gated_options), wrong_gate(gated_options);
  wrong_gate->shared_expert_gate.set_data(torch::ones({2, 8}));
  std::stringstream gate_checkpoint;
  torch::save(wrong_gate, gate_checkpoint);
  const torch::Tensor gate_before = gated->shared_expert_gate.detach().clone();
  REQUIRE_THROWS_WITH(torch::load(gated, gate_checkpoint),
                      Contains("MoELayer::load: 'shared_expert_gate' must be a floating tensor of "
                               "shape [1, 8], got Float [2, 8]"));
  CHECK(torch::equal(gated->shared_expert_gate, gate_before));
  // float64 is converted into the layer's float32 (Module::load reinterpreted its bytes).
  MoELayer source(gated_options);
  source->shared_expert_gate.set_data(torch::full({1, 8}, 0.5, torch::kFloat64));
  std::stringstream good_checkpoint;
  torch::save(source, good_checkpoint);
  torch::load(gated, good_checkpoint);
  CHECK(gated->shared_expert_gate.scalar_type() == torch::kFloat32);
  CHECK(torch::equal(gated->shared_expert_gate, torch::full({1, 8}, 0.5)));
  CHECK(torch::equal(gated->shared_expert->fc1->expert_weights()[0],
                     source->shared_expert->fc1->expert_weights()[0]));

  // The printout reads the submodules as built; a null group in the options prints, not crashes.
  target->options.expert_parallel(
      torchmoe::ProcessGroupOptions(c10::intrusive_ptr<c10d::ProcessGroup>()));
  std::ostringstream printed;
  printed << *target;
  CHECK_THAT(printed.str(), Contains("topk=2") && Contains("expert_parallel=(no process group)"));
}

TEST_CASE("TopKRouter refuses options changed past what it was built with", "[modules][errors]") {
  TopKRouter router(TopKRouterOptions(8, 4, 2).aux_loss_coeff(0.01));
  const torch::Tensor x = torch::randn({5, 8});
  router->options.num_experts(8);
  REQUIRE_THROWS_WITH(router(x), Contains("options num_experts=8 and hidden=8 must be those the "
                                          "router was built with, its weight is [4, 8]"));
  router->options.num_experts(4).expert_bias(true);
  REQUIRE_THROWS_WITH(router(x), Contains("expert_bias was off when the router was built"));
  router->options.expert_bias(false).aux_loss_coeff(INFINITY);
  REQUIRE_THROWS_WITH(router(x), Contains("loss coefficients must be finite and >= 0"));
}

TEST_CASE("MoELayer with a shared expert adds a dense SwiGLU MLP's output", "[modules][moe]") {
  const bool gate = GENERATE(false, true);
  const bool delayed = GENERATE(false, true);
  INFO("gate " << gate << ", delay_wgrad_compute " << delayed);
  torch::manual_seed(31);
  const int64_t hidden = 32, shared_ffn = 40;
  MoELayerOptions options(hidden, 24, 4, 2);
  options.params_dtype(torch::kFloat64);
  options.shared_expert(torchmoe::SharedExpertOptions(shared_ffn).gate(gate));
  options.experts().linear().delay_wgrad_compute(delayed);
  MoELayer moe(options);
  REQUIRE(moe->named_parameters().contains("shared_expert.fc1.weight0"));
  REQUIRE(moe->named_parameters().contains("shared_expert_gate") == gate);
  // The routed part alone: the same router and experts without the shared expert.
  MoELayerOptions routed_options = options;
  routed_options.shared_expert(std::nullopt);
  routed_options.experts().linear().delay_wgrad_compute(false);
  MoELayer routed(routed_options);
  {
    const torch::NoGradGuard no_grad;
    for (const auto& item : routed->named_parameters()) {
      item.value().copy_(moe->named_parameters()[item.key()]);
    }
  }
  const torch::Tensor x = torch::randn({2, 9, hidden}, torch::kFloat64);
  const torch::Tensor dy = torch::randn({2, 9, hidden}, torch::kFloat64);
  const torch::Tensor xs = x.clone().requires_grad_(true);
  const auto out = moe(xs);
  (out.output * dy).sum().backward();
  if (delayed) {
    CHECK_FALSE(moe->shared_expert->fc1->named_parameters()["weight0"].grad().defined());
    moe->backward_dw();
  }

  const torch::Tensor xr = x.clone().requires_grad_(true);
  const torch::Tensor w1 =
      moe->shared_expert->fc1->named_parameters()["weight0"].detach().requires_grad_(true);
  const torch::Tensor w2 =
      moe->shared_expert->fc2->named_parameters()["weight0"].detach().requires_grad_(true);
  const torch::Tensor g =
      gate ? moe->shared_expert_gate.detach().requires_grad_(true) : torch::Tensor();
  const torch::Tensor h = torch::linear(xr, w1);
  torch::Tensor shared = torch::linear(
      torch::silu(h.narrow(-1, 0, shared_ffn)) * h.narrow(-1, shared_ffn, shared_ffn), w2);
  if (gate) shared = shared * torch::sigmoid(torch::linear(xr, g));
  const torch::Tensor expected = routed(xr).output + shared;
  (expected * dy).sum().backward();
  check_close(out.output, expected, {1e-10, 1e-12}, "output");
  check_close(xs.grad(), xr.grad(), {1e-10, 1e-12}, "grad x");
  check_close(moe->shared_expert->fc1->named_parameters()["weight0"].grad(), w1.grad(),
              {1e-10, 1e-12}, "grad shared fc1");
  check_close(moe->shared_expert->fc2->named_parameters()["weight0"].grad(), w2.grad(),
              {1e-10, 1e-12}, "grad shared fc2");
  if (gate) check_close(moe->shared_expert_gate.grad(), g.grad(), {1e-10, 1e-12}, "grad gate");
  std::ostringstream printed;
  printed << *moe;
  CHECK_THAT(printed.str(), Contains(gate ? "shared_expert=40 (gated)" : "shared_expert=40)"));
}

TEST_CASE("MoELayer refuses options it cannot combine or change", "[modules][moe][errors]") {
  MoELayerOptions options(8, 16, 4, 2);
  options.shared_expert(torchmoe::SharedExpertOptions(0));
  CHECK_THROWS_WITH(MoELayer(options),
                    Contains("MoELayer: shared_expert().ffn_hidden must be positive, got 0"));
  MoELayer moe(MoELayerOptions(8, 16, 4, 2));
  moe->options.shared_expert(torchmoe::SharedExpertOptions(8));
  CHECK_THROWS_WITH(moe(torch::randn({3, 8})),
                    Contains("MoELayer: shared_expert cannot change after construction"));
  // FP8 is refused before anything runs, under the layer's name.
  MoELayer cpu(MoELayerOptions(16, 16, 4, 2));
  const torchmoe::fp8::Autocast fp8{torchmoe::fp8::DelayedScaling()};
  CHECK_THROWS_AS(cpu(torch::randn({3, 16})), c10::NotImplementedError);
  CHECK_THROWS_WITH(cpu(torch::randn({3, 16})),
                    Contains("MoELayer: FP8 (fp8::Autocast) runs on CUDA tensors, got x on cpu"));
}

TEST_CASE("MoELayer with input-scaled experts computes f_e(p · x) at any k", "[modules][moe]") {
  // Llama-4's rule: each routed row is scaled by its probability before fc1 and not after. Top-1
  // scales the tokens before the permutation; more choices scale each permuted row.
  const int64_t topk = GENERATE(1, 2);
  INFO("topk " << topk);
  torch::manual_seed(37);
  const int64_t hidden = 16, ffn = 24, experts = 4, tokens = 19;
  MoELayerOptions options(hidden, ffn, experts, topk);
  options.params_dtype(torch::kFloat64).scale_expert_input(true);
  options.router()
      .score_function(torchmoe::RouterScore::kSigmoid)
      .normalize_topk(false)
      .aux_loss_coeff(0);
  MoELayer moe(options);
  const torch::Tensor x = torch::randn({tokens, hidden}, torch::kFloat64);
  const torch::Tensor dy = torch::randn({tokens, hidden}, torch::kFloat64);
  const torch::Tensor xs = x.clone().requires_grad_(true);
  (moe(xs).output * dy).sum().backward();

  const torch::Tensor xr = x.clone().requires_grad_(true);
  const torch::Tensor wr = moe->router->weight.detach().requires_grad_(true);
  std::vector<torch::Tensor> w1, w2;
  for (const auto& w : moe->experts->fc1->expert_weights()) w1.push_back(leaf(w));
  for (const auto& w : moe->experts->fc2->expert_weights()) w2.push_back(leaf(w));
  const torch::Tensor scores = torch::sigmoid(torch::linear(xr, wr));
  const torch::Tensor indices = std::get<1>(scores.detach().topk(topk, 1));
  const torch::Tensor probs = scores.gather(1, indices);
  torch::Tensor out = torch::zeros_like(xr);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      const int64_t e = indices[t][j].item<int64_t>();
      const torch::Tensor z = torch::linear(xr[t] * probs[t][j], w1[e]);
      const torch::Tensor h = torch::silu(z.narrow(0, 0, ffn)) * z.narrow(0, ffn, ffn);
      out = out.index_add(0, torch::tensor({t}), torch::linear(h, w2[e]).unsqueeze(0));
    }
  }
  (out * dy).sum().backward();
  check_close(xs.grad(), xr.grad(), {1e-10, 1e-12}, "grad x");
  check_close(moe->router->weight.grad(), wr.grad(), {1e-10, 1e-12}, "grad router");
  for (int64_t e = 0; e < experts; ++e) {
    INFO("expert " << e);
    // An expert no token chose has no gradient (None), in both.
    const auto grad_or_zeros = [&](const torch::Tensor& w) {
      return w.grad().defined() ? w.grad() : torch::zeros_like(w);
    };
    check_close(grad_or_zeros(moe->experts->fc1->named_parameters()["weight" + std::to_string(e)]),
                grad_or_zeros(w1[e]), {1e-10, 1e-12}, "grad fc1");
    check_close(grad_or_zeros(moe->experts->fc2->named_parameters()["weight" + std::to_string(e)]),
                grad_or_zeros(w2[e]), {1e-10, 1e-12}, "grad fc2");
  }
  torch::NoGradGuard no_grad;
  check_close(moe(x).output, out, {1e-10, 1e-12}, "output");
}
