// GroupedMLP vs a float64 reference built from plain ATen per expert (FC1 -> act -> ·probs -> FC2),
// TE's test_grouped_mlp setup: 4 experts, hidden {128, 256}, splits shuffled {0, 256, 512, 768},
// x and dy in U[-0.25, 0.25], probs U[0, 1), biases U[-0.5, 0.5]; y, dx, dprobs, every dW and db.

#include <torchmoe/autograd/token_permutation_function.h>
#include <torchmoe/torchmoe.h>

#include <limits>
#include <sstream>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::GluActivation;
using torchmoe::GroupedMLP;
using torchmoe::GroupedMLPOptions;

namespace {

struct MlpCase {
  torch::Dtype dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  int64_t hidden = 128;
  bool bias = true, scale_bias = false, fuse = false, delay = false, single = false;
  bool recompute = false;
  GluActivation activation = GluActivation::kSwiGLU;
  std::optional<int64_t> interleave;
};

std::string describe(const MlpCase& c) {
  std::ostringstream s;
  s << "dtype=" << c.dtype << " device=" << c.device << " hidden=" << c.hidden << " bias=" << c.bias
    << " scale_bias=" << c.scale_bias << " fuse=" << c.fuse << " delay=" << c.delay
    << " single=" << c.single << " clamped=" << (c.activation == GluActivation::kClampedSwiGLU)
    << " interleave=" << c.interleave.value_or(0);
  return s.str();
}

torch::Tensor uniform(torch::IntArrayRef shape, double lo, double hi,
                      const torch::TensorOptions& options) {
  return torch::rand(shape, options.dtype(torch::kFloat32)) * (hi - lo) + lo;
}

// Per-expert weights/biases of a layer, float64 leaves for the reference.
std::vector<torch::Tensor> leaves(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().to(torch::kFloat64).requires_grad_(true));
  return out;
}

// act(z) with the act half / gate half located through the interleave block, in float64.
torch::Tensor reference_act(const torch::Tensor& z, const MlpCase& c,
                            const torchmoe::ClampedSwiGLUOptions& clamped) {
  const int64_t ffn = z.size(1) / 2;
  const int64_t block = c.interleave.value_or(ffn);
  std::vector<int64_t> a_idx, b_idx;
  for (int64_t j = 0; j < ffn; ++j) {
    a_idx.push_back((j / block) * 2 * block + j % block);
    b_idx.push_back(a_idx.back() + block);
  }
  const torch::Tensor a = z.index_select(1, torch::tensor(a_idx).to(z.device()));
  const torch::Tensor b = z.index_select(1, torch::tensor(b_idx).to(z.device()));
  if (c.activation == GluActivation::kSwiGLU) return a * torch::sigmoid(a) * b;
  const torch::Tensor ac = torch::clamp_max(a, clamped.limit());
  return ac * torch::sigmoid(clamped.alpha() * ac) *
         (torch::clamp(b, -clamped.limit(), clamped.limit()) + clamped.offset());
}

std::vector<torch::Tensor> weight_grads(torchmoe::GroupedLinear& layer, bool fuse, bool single) {
  if (fuse) {
    auto main = layer->main_grads();
    return single ? main[0].unbind(0) : main;
  }
  auto params = layer->named_parameters();
  if (single) return params["weight"].grad().unbind(0);
  std::vector<torch::Tensor> grads;
  for (size_t g = 0; g < layer->expert_weights().size(); ++g) {
    grads.push_back(params["weight" + std::to_string(g)].grad());
  }
  return grads;
}

std::vector<torch::Tensor> bias_grads(torchmoe::GroupedLinear& layer, bool single) {
  auto params = layer->named_parameters();
  if (single) return params["bias"].grad().unbind(0);
  std::vector<torch::Tensor> grads;
  for (size_t g = 0; g < layer->expert_biases().size(); ++g) {
    grads.push_back(params["bias" + std::to_string(g)].grad());
  }
  return grads;
}

void run_mlp_case(const MlpCase& c) {
  INFO(describe(c));
  torch::manual_seed(23);
  const int64_t experts = 4, ffn = c.hidden;
  GroupedMLPOptions options_mlp = GroupedMLPOptions(experts, c.hidden, ffn)
                                      .scale_bias(c.scale_bias)
                                      .activation(c.activation)
                                      .glu_interleave_size(c.interleave)
                                      .recompute_activation(c.recompute)
                                      .params_dtype(c.dtype)
                                      .device(c.device);
  options_mlp.linear()
      .bias(c.bias)
      .fuse_wgrad_accumulation(c.fuse)
      .delay_wgrad_compute(c.delay)
      .single_grouped_weight(c.single)
      .single_grouped_bias(c.single);
  GroupedMLP mlp(options_mlp);
  const auto options = torch::TensorOptions().device(c.device);
  {
    torch::NoGradGuard no_grad;
    for (auto* layer : {&mlp->fc1, &mlp->fc2}) {
      for (torch::Tensor b : (*layer)->expert_biases())
        b.copy_(uniform(b.sizes(), -0.5, 0.5, options));
    }
  }
  const std::vector<int64_t> splits = {512, 0, 768, 256};  // {0, 256, 512, 768} shuffled
  const int64_t rows = 1536;
  const torch::Tensor x =
      uniform({rows, c.hidden}, -0.25, 0.25, options).to(c.dtype).requires_grad_(true);
  // fp32 probabilities (a router's usual output), float64 in the float64 runs
  const torch::Tensor probs =
      uniform({rows}, 0.0, 1.0, options)
          .to(c.dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32)
          .requires_grad_(true);
  const torch::Tensor dy = uniform({rows, c.hidden}, -0.25, 0.25, options).to(c.dtype);

  const torch::Tensor y = mlp(x, splits, probs);
  y.backward(dy);
  if (c.delay) mlp->backward_dw();

  // float64 reference: plain ATen per expert, autograd for the gradients.
  torch::AutoGradMode enable(true);
  const auto w1 = leaves(mlp->fc1->expert_weights()), w2 = leaves(mlp->fc2->expert_weights());
  const auto b1 = leaves(mlp->fc1->expert_biases()), b2 = leaves(mlp->fc2->expert_biases());
  const torch::Tensor x64 = x.detach().to(torch::kFloat64).requires_grad_(true);
  const torch::Tensor p64 = probs.detach().to(torch::kFloat64).requires_grad_(true);
  std::vector<torch::Tensor> pieces;
  int64_t first = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const torch::Tensor xe = x64.narrow(0, first, splits[e]);
    const torch::Tensor pe = p64.narrow(0, first, splits[e]).unsqueeze(1);
    const torch::Tensor z = torch::linear(xe, w1[e], c.bias ? b1[e] : torch::Tensor());
    torch::Tensor ye = torch::linear(reference_act(z, c, mlp->options.clamped()) * pe, w2[e]);
    if (c.bias) ye = ye + (c.scale_bias ? b2[e] * pe : b2[e]);
    pieces.push_back(ye);
    first += splits[e];
  }
  const torch::Tensor y64 = torch::cat(pieces);
  (y64 * dy.to(torch::kFloat64)).sum().backward();

  const Tolerance tol = c.dtype == torch::kBFloat16  ? Tolerance{0.125, 0.25}  // TE's
                        : c.dtype == torch::kFloat64 ? Tolerance{1e-10, 1e-10}
                                                     : Tolerance{1e-4, 1e-5};
  check_close(y, y64, tol, "y");
  check_close(x.grad(), x64.grad(), tol, "dx");
  check_close(probs.grad(), p64.grad(), tol, "dprobs");
  const auto dw1 = weight_grads(mlp->fc1, c.fuse, c.single);
  const auto dw2 = weight_grads(mlp->fc2, c.fuse, c.single);
  // main-grad is fp32 whatever the parameters' dtype
  const Tolerance wtol = c.fuse && c.dtype == torch::kFloat64 ? Tolerance{1e-4, 1e-5} : tol;
  for (int64_t e = 0; e < experts; ++e) {
    check_close(dw1[e], w1[e].grad(), wtol, "dW1 expert " + std::to_string(e));
    check_close(dw2[e], w2[e].grad(), wtol, "dW2 expert " + std::to_string(e));
  }
  if (c.bias) {
    const auto db1 = bias_grads(mlp->fc1, c.single), db2 = bias_grads(mlp->fc2, c.single);
    for (int64_t e = 0; e < experts; ++e) {
      check_close(db1[e], b1[e].grad(), tol, "db1 expert " + std::to_string(e));
      check_close(db2[e], b2[e].grad(), tol, "db2 expert " + std::to_string(e));
    }
  }
}

}  // namespace

TEST_CASE("GroupedMLP on CPU vs float64 reference", "[modules][grouped_mlp]") {
  MlpCase c;
  c.dtype = GENERATE(torch::kFloat32, torch::kFloat64);
  c.hidden = GENERATE(128, 256);
  c.activation = GENERATE(GluActivation::kSwiGLU, GluActivation::kClampedSwiGLU);
  c.interleave = GENERATE(std::optional<int64_t>{}, std::optional<int64_t>{32});
  c.scale_bias = GENERATE(false, true);
  run_mlp_case(c);
}

TEST_CASE("GroupedMLP options reach both layers", "[modules][grouped_mlp]") {
  MlpCase c;
  c.recompute = GENERATE(false, true);
  c.bias = GENERATE(false, true);
  c.fuse = GENERATE(false, true);
  c.delay = GENERATE(false, true);
  c.single = GENERATE(false, true);
  run_mlp_case(c);
}

TEST_CASE("GroupedMLP on CUDA (bf16) vs float64 reference", "[modules][grouped_mlp][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  MlpCase c;
  c.device = torch::kCUDA;
  c.dtype = GENERATE(torch::kBFloat16, torch::kFloat32);
  c.hidden = GENERATE(128, 256);
  c.activation = GENERATE(GluActivation::kSwiGLU, GluActivation::kClampedSwiGLU);
  c.interleave = GENERATE(std::optional<int64_t>{}, std::optional<int64_t>{32});
  c.scale_bias = GENERATE(false, true);
  c.fuse = GENERATE(false, true);
  c.delay = GENERATE(false, true);
  c.single = GENERATE(false, true);
  c.recompute = GENERATE(false, true);
  at::globalContext().setAllowTF32CuBLAS(false);
  run_mlp_case(c);
}

// forward_combined sums each token's expert rows inside fc2's GEMM and its input-gradient rows
// inside fc1's dgrad (top-1 and top-2 on sm90); top-3, and scale_bias on a biased fc2, take the
// three steps themselves. Against the permuted copy, forward and unpermute: the output and every
// gradient equal bit for bit, and the output's node says which path ran.
TEST_CASE("GroupedMLP::forward_combined is the permuted forward and its unpermute, bit for bit",
          "[modules][grouped_mlp][cuda][sm90][scatter]") {
  TORCHMOE_REQUIRE_SM90();
  const int64_t topk = GENERATE(1, 2, 3);
  const int bias = GENERATE(0, 1, 2);  // none, fc2's bias, fc2's bias scaled (scale_bias)
  const bool delay = GENERATE(false, true);
  const bool recompute = GENERATE(false, true);
  const bool dropped = GENERATE(false, true);  // a fifth of the tokens lose their last slot
  const bool copied = GENERATE(false, true);   // routed by permute_tokens (a copy) or route_tokens
  INFO("topk=" << topk << " bias=" << bias << " delay=" << delay << " recompute=" << recompute
               << " dropped=" << dropped << " copied=" << copied);
  const int64_t tokens = 333, hidden = 128, ffn = 200, experts = 6;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torch::manual_seed(41);
  GroupedMLPOptions options(experts, hidden, ffn);
  options.recompute_activation(recompute).scale_bias(bias == 2);
  options.linear()
      .bias(bias > 0)
      .delay_wgrad_compute(delay)
      .params_dtype(torch::kBFloat16)
      .device(torch::kCUDA);
  GroupedMLP mlp(options);
  const torch::Tensor x_in = torch::randn({tokens, hidden}, cuda);
  const torch::Tensor dy = torch::randn({tokens, hidden}, cuda);
  torch::Tensor indices =
      torch::rand({tokens, experts}).argsort(/*dim=*/int64_t{1}).narrow(1, 0, topk).clone();
  if (dropped) indices.select(1, topk - 1).masked_fill_(torch::arange(tokens) % 5 == 0, -1);
  indices = indices.to(torch::kCUDA);
  const torch::Tensor probs_in = torch::rand({tokens, topk}, cuda.dtype(torch::kFloat32));
  struct Result {
    torch::Tensor y, dx, dprobs;
    std::vector<torch::Tensor> grads;
    std::vector<std::string> names;
    std::string node;
  };
  auto run = [&](bool combined) {
    mlp->zero_grad();
    const torch::Tensor x = x_in.clone().requires_grad_(true);
    const torch::Tensor probs = probs_in.clone().requires_grad_(true);
    const torchmoe::PermutedTokens routed =
        combined && !copied ? torchmoe::autograd::route_tokens(x, indices, experts, probs)
                            : torchmoe::functional::permute_tokens(x, indices, experts, probs);
    const torch::Tensor y = combined
                                ? mlp->forward_combined(x, routed)
                                : torchmoe::functional::unpermute_tokens(
                                      mlp(routed.tokens, routed.m_splits, routed.probs), routed);
    (y * dy).sum().backward();
    if (delay) mlp->backward_dw();
    Result r{y.detach(), x.grad(), probs.grad(), {}, {}, y.grad_fn()->name()};
    for (const auto& p : mlp->named_parameters()) {
      r.names.push_back(p.key());
      r.grads.push_back(p.value().grad());
    }
    return r;
  };
  const Result combined = run(true), three_steps = run(false);
  INFO("output nodes: " << combined.node << ", " << three_steps.node);
  const bool sums_in_gemms = topk <= 2 && bias != 2;
  CHECK((combined.node.find("UnpermuteFunction") == std::string::npos) == sums_in_gemms);
  CHECK(three_steps.node.find("UnpermuteFunction") != std::string::npos);
  CHECK(torch::equal(combined.y, three_steps.y));
  CHECK(torch::equal(combined.dx, three_steps.dx));
  CHECK(torch::equal(combined.dprobs, three_steps.dprobs));
  REQUIRE(combined.grads.size() == three_steps.grads.size());
  // scale_bias's fc2 bias gradient is two parts that autograd adds in bf16, each rounded once:
  // fc2's column sum A_e = Σ dy and the rows' gather backward B_e = Σ dy·(p - 1), the latter summed
  // with float atomics on CUDA, whose order can move its rounding by an ulp from run to run (an
  // ulp of a part, ~0.03 at |A| ~ 7, exceeds the gradient's own scale where A + B cancels). Each
  // path is held to the float64 A + B within one bf16 ulp of each part and of the sum.
  torch::Tensor bias_tolerance, bias_exact;
  if (bias == 2) {
    const torch::Tensor dy64 = dy.cpu().to(torch::kFloat64);
    const torch::Tensor p64 = probs_in.cpu().to(torch::kFloat64);
    const torch::Tensor expert = indices.cpu();
    torch::Tensor a = torch::zeros({experts, hidden}, torch::kFloat64), b = torch::zeros_like(a);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t e = expert[t][j].item<int64_t>();
        if (e < 0) continue;
        a[e].add_(dy64[t]);
        b[e].add_(dy64[t] * (p64[t][j] - 1));
      }
    }
    const auto ulp = [](const torch::Tensor& x) {
      return torch::pow(2.0, torch::floor(torch::log2(x.abs().clamp_min(1e-30))) - 7);
    };
    bias_exact = a + b;
    bias_tolerance = ulp(a) + ulp(b) + ulp(bias_exact);
  }
  for (size_t i = 0; i < combined.grads.size(); ++i) {
    INFO("parameter " << combined.names[i]);
    const std::string& name = combined.names[i];
    if (bias == 2 && name.rfind("fc2.bias", 0) == 0) {
      const torch::Tensor exact =
          name == "fc2.bias" ? bias_exact : bias_exact[std::stoll(name.substr(8))];
      const torch::Tensor tolerance =
          name == "fc2.bias" ? bias_tolerance : bias_tolerance[std::stoll(name.substr(8))];
      for (const Result* r : {&combined, &three_steps}) {
        const torch::Tensor error = (r->grads[i].cpu().to(torch::kFloat64) - exact).abs();
        INFO("largest error over its tolerance " << (error / tolerance).max().item<double>());
        CHECK((error <= tolerance).all().item<bool>());
      }
    } else {
      CHECK(torch::equal(combined.grads[i], three_steps.grads[i]));
    }
  }
}

TEST_CASE("GroupedMLP recompute_activation gives the same numbers", "[modules][grouped_mlp]") {
  const bool delay = GENERATE(false, true);
  const bool clamped = GENERATE(false, true);
  torch::manual_seed(31);
  auto options = GroupedMLPOptions(3, 32, 64).glu_interleave_size(32);
  options.linear().delay_wgrad_compute(delay);
  if (clamped) options.activation(GluActivation::kClampedSwiGLU);
  GroupedMLP plain(options);
  GroupedMLP recompute(GroupedMLPOptions(options).recompute_activation(true));
  {
    torch::NoGradGuard no_grad;
    auto src = plain->parameters();
    auto dst = recompute->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i] + 0.01 * (i + 1));
    for (size_t i = 0; i < src.size(); ++i) src[i].copy_(dst[i]);
  }
  const std::vector<int64_t> splits = {5, 0, 11};
  const torch::Tensor x = torch::randn({16, 32});
  const torch::Tensor probs = torch::rand({16});
  std::vector<torch::Tensor> dx, dp;
  for (auto* mlp : {&plain, &recompute}) {
    const torch::Tensor xi = x.clone().requires_grad_(true),
                        pi = probs.clone().requires_grad_(true);
    (*mlp)(xi, splits, pi).sin().sum().backward();
    if (delay) (*mlp)->backward_dw();
    dx.push_back(xi.grad());
    dp.push_back(pi.grad());
  }
  check_close(dx[1], dx[0], {0, 0}, "dx");
  check_close(dp[1], dp[0], {0, 0}, "dprobs");
  auto a = plain->named_parameters(), b = recompute->named_parameters();
  for (const auto& item : a)
    check_close(b[item.key()].grad(), item.value().grad(), {0, 0}, item.key());
}

TEST_CASE("GroupedMLP rejects bad input", "[modules][grouped_mlp][errors]") {
  GroupedMLP mlp(GroupedMLPOptions(3, 16, 8));
  const torch::Tensor x = torch::randn({6, 16});
  const std::vector<int64_t> splits = {2, 0, 4};
  REQUIRE_THROWS_WITH(
      mlp(x, splits, torch::rand({5})),
      Contains("probs must be [rows] with one probability per row of x (6), got [5]"));
  REQUIRE_THROWS_WITH(mlp(x, std::vector<int64_t>{2, 0, 3}, torch::rand({6})),
                      Contains("GroupedMLP: m_splits must sum to the number of rows (6)"));
  REQUIRE_THROWS_WITH(mlp(x.to(torch::kFloat64), splits, torch::rand({6})),
                      Contains("GroupedMLP: x must have the parameters' dtype Float, got Double"));
  REQUIRE_THROWS_WITH(mlp(torch::randn({6, 12}), splits, torch::rand({6})),
                      Contains("x must be [rows, hidden=16], got [6, 12]"));
  // The routed forwards: tokens checked as x is, and the routing must be these tokens'.
  const torchmoe::PermutedTokens routed = torchmoe::functional::permute_tokens(
      x, torch::tensor({{0, 2}, {2, 1}, {0, 1}, {1, 2}, {0, 2}, {1, 0}}), 3, torch::rand({6, 2}));
  REQUIRE_THROWS_WITH(mlp->forward_combined(x.narrow(0, 0, 5), routed),
                      Contains("GroupedMLP: routed must be the routing of the 5 tokens (row_map "
                               "[T, k] and sorted_slots [N]), got row_map [6, 2]"));
  REQUIRE_THROWS_WITH(mlp->forward_routed(x.narrow(0, 0, 5), routed),
                      Contains("GroupedMLP: routed must be the routing of the 5 tokens"));
  REQUIRE_THROWS_WITH(mlp->forward_combined(x.to(torch::kFloat64), routed),
                      Contains("GroupedMLP: x must have the parameters' dtype Float, got Double"));
  CHECK(mlp->forward_combined(x, routed).sizes() == x.sizes());
  // A caller's row_tokens that are not the routing map's (each row's token, int64, x's device).
  torchmoe::PermutedTokens stale = routed;
  stale.row_tokens = routed.row_tokens.narrow(0, 0, 11);
  REQUIRE_THROWS_WITH(mlp->forward_routed(x, stale),
                      Contains("GroupedMLP: routed.row_tokens must be an int64 [12] tensor on cpu "
                               "like sorted_slots, got [11] Long on cpu"));
  stale.row_tokens = routed.row_tokens.to(torch::kInt);
  REQUIRE_THROWS_WITH(mlp->forward_combined(x, stale),
                      Contains("GroupedMLP: routed.row_tokens must be an int64 [12] tensor on cpu "
                               "like sorted_slots, got [12] Int on cpu"));
  REQUIRE_THROWS_WITH(GroupedMLP(GroupedMLPOptions(3, 16, 0)),
                      Contains("ffn_hidden must be positive, got 0"));
  // The activation's options are checked when the layers are built, not after fc1 has run.
  REQUIRE_THROWS_WITH(GroupedMLP(GroupedMLPOptions(3, 16, 48).glu_interleave_size(32)),
                      Contains("GroupedMLP: glu_interleave_size must be a positive divisor of "
                               "H=48, got 32"));
  GroupedMLPOptions nan_limit(3, 16, 8);
  nan_limit.activation(torchmoe::GluActivation::kClampedSwiGLU)
      .clamped()
      .limit(std::numeric_limits<double>::quiet_NaN());
  REQUIRE_THROWS_WITH(GroupedMLP(nan_limit),
                      Contains("GroupedMLP: the clamped SwiGLU needs a finite positive limit"));
  GroupedMLP changed(GroupedMLPOptions(3, 16, 8));
  changed->options.glu_interleave_size(64);
  // Refused by the module before fc1 runs (the activation's own check would name torchmoe::glu).
  REQUIRE_THROWS_WITH(
      changed(x, splits, torch::rand({6})),
      Contains("GroupedMLP: glu_interleave_size must be a positive divisor of H=8, got 64"));
  GroupedMLPOptions row_parallel(3, 16, 8);
  row_parallel.linear().parallel_mode(torchmoe::ParallelMode::kRow).tp_size(2);
  REQUIRE_THROWS_AS(GroupedMLP(row_parallel), c10::NotImplementedError);
  REQUIRE_THROWS_WITH(GroupedMLP(row_parallel), Contains("tensor parallelism is not implemented"));
  std::ostringstream s;
  s << mlp;
  CHECK(s.str().find("torchmoe::GroupedMLP(num_experts=3, hidden=16, ffn_hidden=8, bias=true, "
                     "activation=swiglu)") == 0);
}

TEST_CASE("GroupedMLP::backward_dw runs each layer's queued work, refusing only none anywhere",
          "[modules][grouped_mlp]") {
  GroupedMLPOptions options(3, 16, 8);
  options.linear().delay_wgrad_compute(true);
  GroupedMLP mlp(options);
  REQUIRE_THROWS_WITH(
      mlp->backward_dw(),
      Contains("GroupedMLP::backward_dw: no weight-gradient computation is queued"));
  // fc1 frozen: only fc2 queues its weight gradients.
  for (torch::Tensor& p : mlp->fc1->parameters()) p.set_requires_grad(false);
  const std::vector<int64_t> splits = {2, 0, 4};
  mlp(torch::randn({6, 16}), splits, torch::rand({6})).sum().backward();
  REQUIRE(mlp->fc1->pending_wgrad_count() == 0);
  REQUIRE(mlp->fc2->pending_wgrad_count() == 1);
  CHECK_FALSE(mlp->fc2->named_parameters()["weight0"].grad().defined());
  mlp->backward_dw();
  CHECK(mlp->fc2->pending_wgrad_count() == 0);
  CHECK(mlp->fc2->named_parameters()["weight0"].grad().defined());
}

TEST_CASE("GroupedMLP options compose the layers' shared settings", "[modules][grouped_mlp]") {
  GroupedMLPOptions options(4, 16, 8);
  options.params_dtype(torch::kFloat64).linear().bias(false).single_grouped_weight(true);
  GroupedMLP mlp(options);
  for (torchmoe::GroupedLinear* layer : {&mlp->fc1, &mlp->fc2}) {
    CHECK((*layer)->options.num_gemms() == 4);
    CHECK((*layer)->options.params_dtype() == torch::kFloat64);
    CHECK_FALSE((*layer)->options.bias());
    CHECK((*layer)->options.single_grouped_weight());
  }
  CHECK(mlp->fc1->options.in_features() == 16);
  CHECK(mlp->fc1->options.out_features() == 16);  // act and gate halves: 2 · ffn_hidden
  CHECK(mlp->fc2->options.in_features() == 8);
  CHECK(mlp->fc2->options.out_features() == 16);
}

TEST_CASE("GroupedMLP follows ->to(dtype)", "[modules][grouped_mlp]") {
  GroupedMLP mlp(GroupedMLPOptions(2, 16, 8));
  mlp->to(torch::kFloat64);
  const torch::Tensor x = torch::randn({5, 16}, torch::kFloat64);
  const torch::Tensor y = mlp(x, std::vector<int64_t>{2, 3}, torch::rand({5}, torch::kFloat64));
  CHECK(y.scalar_type() == torch::kFloat64);
}

TEST_CASE("GroupedMLP reads its bias from fc2 as built", "[modules][mlp]") {
  // options.linear() is what fc1 and fc2 were built from: changed later, the scale_bias term
  // still follows fc2's bias, so the output does not change.
  torch::manual_seed(43);
  torchmoe::GroupedMLPOptions options(3, 8, 4);
  options.scale_bias(true).linear().bias(true);
  torchmoe::GroupedMLP mlp(options);
  for (const auto& item : mlp->fc2->named_parameters()) {
    torch::NoGradGuard no_grad;
    if (item.key().rfind("bias", 0) == 0) item.value().uniform_(-1, 1);
  }
  const torch::Tensor x = torch::randn({7, 8});
  const torch::Tensor probs = torch::rand({7});
  const std::vector<int64_t> splits = {2, 3, 2};
  const torch::Tensor before = mlp(x, splits, probs);
  mlp->options.linear().bias(false);
  CHECK(torch::equal(mlp(x, splits, probs), before));
  std::ostringstream printed;
  printed << *mlp;
  CHECK_THAT(printed.str(), Contains("bias=true"));
}
