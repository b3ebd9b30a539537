// GroupedLinear and GroupedMLP with device split sizes, and a whole MoELayer, inside a CUDA graph,
// in 16 bits and in FP8 (each recipe): forward + backward is captured once and replayed with new
// input data (and new split contents, or a new routing) in the same buffers; each replay must
// match an eager step on the same buffers bit for bit (the same kernels run), and the capacity
// padding rows of the output (past the split sum) must keep their sentinel where the step is one
// op (GraphStep::padding_kept).

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <torchmoe/fp8/autocast.h>
#include <torchmoe/modules/grouped_linear.h>
#include <torchmoe/modules/grouped_mlp.h>
#include <torchmoe/modules/moe_layer.h>

#include <functional>
#include <numeric>
#include <optional>
#include <variant>

#include "test_utils.h"

using namespace torchmoe::test;

namespace {

constexpr int64_t kRows = 300;  // buffer rows; the splits sum to less (capacity padding)
constexpr double kSentinel = 12345.0;

struct GraphStep {
  std::function<torch::Tensor()> step;  // forward + backward on the static buffers; returns y
  std::vector<torch::Tensor> leaves;    // row-indexed inputs whose .grad is checked on valid rows
  std::vector<torch::Tensor> params;    // every parameter; .grad checked whole
  // Whether y's padding rows (past the split sum) must keep the sentinel across a replay. Only
  // for a step whose forward is one op: in a captured graph the pool may hand y memory that an
  // earlier kernel of the same graph used for a temporary it freed (the cuBLASLt grouped fc1's
  // fp32 product, in GroupedMLP), which that kernel writes again at replay.
  bool padding_kept = true;
};

void clear_grads(const GraphStep& s) {
  for (torch::Tensor t : s.leaves) t.mutable_grad() = torch::Tensor();
  for (torch::Tensor t : s.params) t.mutable_grad() = torch::Tensor();
}

std::vector<torch::Tensor> grads_of(const GraphStep& s, int64_t valid) {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& t : s.leaves) out.push_back(t.grad().narrow(0, 0, valid).clone());
  for (const torch::Tensor& t : s.params) out.push_back(t.grad().clone());
  return out;
}

// refill(trial) writes new data and split sizes into the static buffers and returns the split sum.
void check_graph_matches_eager(const GraphStep& s, const std::function<int64_t(int)>& refill) {
  const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
  const c10::cuda::CUDAStreamGuard guard(stream);
  refill(0);
  s.step();  // eager warm-up: allocator pools, address tables for the weights
  clear_grads(s);
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  const torch::Tensor y_graph = s.step();
  graph.capture_end();
  std::vector<torch::Tensor> graph_grads;  // the buffers the replays write
  for (const torch::Tensor& t : s.leaves) graph_grads.push_back(t.grad());
  for (const torch::Tensor& t : s.params) graph_grads.push_back(t.grad());

  for (int trial = 1; trial <= 2; ++trial) {
    INFO("trial " << trial);
    const int64_t valid = refill(trial);
    y_graph.narrow(0, valid, kRows - valid).fill_(kSentinel);
    graph.replay();
    const torch::Tensor y_replay = y_graph.narrow(0, 0, valid).clone();
    std::vector<torch::Tensor> replay_grads;
    for (size_t i = 0; i < graph_grads.size(); ++i) {
      replay_grads.push_back(i < s.leaves.size() ? graph_grads[i].narrow(0, 0, valid).clone()
                                                 : graph_grads[i].clone());
    }
    if (s.padding_kept) {
      CHECK(y_graph.narrow(0, valid, kRows - valid).eq(kSentinel).all().item<bool>());
    }

    clear_grads(s);
    const torch::Tensor y_eager = s.step();
    CHECK(torch::equal(y_eager.narrow(0, 0, valid), y_replay));
    const std::vector<torch::Tensor> eager_grads = grads_of(s, valid);
    for (size_t i = 0; i < eager_grads.size(); ++i) {
      INFO("gradient " << i);
      CHECK(torch::equal(eager_grads[i], replay_grads[i]));
    }
    // The next replay writes into the captured buffers again, not these.
    clear_grads(s);
  }
}

const std::vector<std::vector<int64_t>> kTrialSplits = {
    {40, 0, 100, 7, 60, 33}, {1, 90, 0, 0, 120, 50}, {0, 0, 0, 250, 0, 9}};

constexpr int64_t kHistory = 4;  // delayed scaling's amax history

// The amax history that a recipe's layers need: only delayed scaling keeps one.
int64_t history_for(const MaybeRecipe& recipe) {
  return recipe && std::holds_alternative<torchmoe::fp8::DelayedScaling>(*recipe) ? kHistory : 0;
}

// The recipes of the FP8 module cases. Delayed scaling's amaxes are collected but the scales not
// updated inside the step, so replays and eager steps use the same scales.
enum class GraphRecipe { kCurrent, kDelayed, kBlock };

torchmoe::fp8::Recipe graph_recipe(GraphRecipe r) {
  switch (r) {
    case GraphRecipe::kCurrent:
      return torchmoe::fp8::CurrentScaling();
    case GraphRecipe::kDelayed:
      return torchmoe::fp8::DelayedScaling().amax_history_len(kHistory);
    default:
      return torchmoe::fp8::BlockScaling();
  }
}

// A GroupedLinear [6 experts, 128 → 256] step on static buffers, under `recipe` when it has one.
void check_linear_graph(const torchmoe::GroupedLinearOptions& options, const MaybeRecipe& recipe) {
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torchmoe::GroupedLinear layer(options);
  const torch::Tensor x = torch::zeros({kRows, 128}, cuda).requires_grad_();
  const torch::Tensor dy = torch::zeros({kRows, 256}, cuda);
  const torch::Tensor splits = torch::zeros({6}, cuda.dtype(torch::kLong));
  auto refill = [&](int trial) {
    const torch::NoGradGuard no_grad;
    x.detach().copy_(torch::randn({kRows, 128}, cuda));
    dy.copy_(torch::randn({kRows, 256}, cuda));
    splits.copy_(torch::tensor(kTrialSplits[trial], torch::kLong));
    return std::accumulate(kTrialSplits[trial].begin(), kTrialSplits[trial].end(), int64_t{0});
  };
  GraphStep s;
  s.step = [&] {
    torch::Tensor y;
    {
      const auto fp8 = autocast_for(recipe);
      y = layer(x, torchmoe::SplitSizes(splits));
    }
    y.backward(dy);
    return y;
  };
  s.leaves = {x};
  s.params = layer->parameters();
  // FP8: the quantizes' temporaries precede y in the graph's pool.
  s.padding_kept = !recipe.has_value();
  check_graph_matches_eager(s, refill);
}

}  // namespace

TEST_CASE("GroupedLinear with device splits replays in a CUDA graph",
          "[modules][grouped_linear][cuda][graph]") {
  // Device splits: the sm90 kernel, or the cuBLASLt grouped matmul (cuBLASLt >= 13.8 loaded).
  const auto backend =
      GENERATE(torchmoe::GemmBackend::kSm90, torchmoe::GemmBackend::kCublasLtGrouped);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  const bool single = GENERATE(false, true);
  INFO("backend " << static_cast<int>(backend) << ", single_grouped_weight " << single);
  torch::manual_seed(21);
  check_linear_graph(torchmoe::GroupedLinearOptions(6, 128, 256)
                         .params_dtype(torch::kBFloat16)
                         .device(torch::kCUDA)
                         .single_grouped_weight(single)
                         .single_grouped_bias(single)
                         .gemm_backend(backend),
                     std::nullopt);
}

TEST_CASE("FP8 GroupedLinear with device splits replays in a CUDA graph",
          "[modules][grouped_linear][fp8][cuda][graph]") {
  // The quantizes read the device sizes; the products run on the sm90 kernel or the cuBLASLt
  // grouped matmul, both with device sizes. Delayed scaling's amaxes are collected but the
  // scales not updated inside the step, so replays and eager steps use the same scales.
  const auto backend =
      GENERATE(torchmoe::GemmBackend::kSm90, torchmoe::GemmBackend::kCublasLtGrouped);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  const bool delayed = GENERATE(false, true);
  INFO("backend " << static_cast<int>(backend) << ", delayed scaling " << delayed);
  torch::manual_seed(23);
  const torchmoe::fp8::Recipe recipe =
      graph_recipe(delayed ? GraphRecipe::kDelayed : GraphRecipe::kCurrent);
  check_linear_graph(torchmoe::GroupedLinearOptions(6, 128, 256)
                         .params_dtype(torch::kBFloat16)
                         .device(torch::kCUDA)
                         .fp8_amax_history_len(history_for(recipe))
                         .gemm_backend(backend),
                     recipe);
}

TEST_CASE("FP8 block-scaled GroupedLinear with device splits replays in a CUDA graph",
          "[modules][grouped_linear][fp8][cuda][graph]") {
  // BlockScaling's default blocks (1x128 activations and gradients, 128x128 weights) on the sm90
  // kernel: no product may fall back to per-group matmuls, whose host sizes a capture refuses.
  TORCHMOE_REQUIRE_GEMM_BACKEND(torchmoe::GemmBackend::kSm90);
  torch::manual_seed(29);
  check_linear_graph(torchmoe::GroupedLinearOptions(6, 128, 256)
                         .params_dtype(torch::kBFloat16)
                         .device(torch::kCUDA)
                         .gemm_backend(torchmoe::GemmBackend::kSm90),
                     graph_recipe(GraphRecipe::kBlock));
}

namespace {

// `forward(fp8)` runs the step's forward under `recipe` (fp8) or in bf16 on the buffers as the
// last replay left them. FP8 must be far from bf16 on the first `rows` rows (quantization noise
// ~0.04 against bf16's ~0.004): the recipe reached the module, so the replays compared FP8 steps.
void check_ran_fp8(const std::function<torch::Tensor(bool)>& forward, int64_t rows) {
  const torch::Tensor y8 = forward(true).narrow(0, 0, rows).to(torch::kFloat);
  const torch::Tensor y16 = forward(false).narrow(0, 0, rows).to(torch::kFloat);
  CHECK(((y8 - y16).norm() / y16.norm()).item<double>() > 0.01);
}

// A GroupedMLP [6 experts, 128 → 192 → 128] step with device splits, under `recipe` when it
// has one.
void check_mlp_graph(torchmoe::GemmBackend backend, const MaybeRecipe& recipe) {
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torchmoe::GroupedMLPOptions options(6, 128, 192);
  options.params_dtype(torch::kBFloat16).device(torch::kCUDA);
  options.linear().gemm_backend(backend).fp8_amax_history_len(history_for(recipe));
  torchmoe::GroupedMLP mlp(options);
  const torch::Tensor x = torch::zeros({kRows, 128}, cuda).requires_grad_();
  const torch::Tensor probs = torch::zeros({kRows}, cuda.dtype(torch::kFloat32)).requires_grad_();
  const torch::Tensor dy = torch::zeros({kRows, 128}, cuda);
  const torch::Tensor splits = torch::zeros({6}, cuda.dtype(torch::kInt));
  auto refill = [&](int trial) {
    const torch::NoGradGuard no_grad;
    x.detach().copy_(torch::randn({kRows, 128}, cuda));
    probs.detach().copy_(torch::rand({kRows}, cuda.dtype(torch::kFloat32)));
    dy.copy_(torch::randn({kRows, 128}, cuda));
    splits.copy_(torch::tensor(kTrialSplits[trial], torch::kInt));
    return std::accumulate(kTrialSplits[trial].begin(), kTrialSplits[trial].end(), int64_t{0});
  };
  auto forward = [&](bool fp8) {
    const auto guard = autocast_for(recipe, fp8);
    return mlp(x, torchmoe::SplitSizes(splits), probs);
  };
  GraphStep s;
  s.step = [&] {
    torch::Tensor y = forward(true);
    y.backward(dy);
    return y;
  };
  s.leaves = {x, probs};
  s.padding_kept = false;  // fc1 then fc2: see GraphStep
  s.params = mlp->parameters();
  check_graph_matches_eager(s, refill);
  if (recipe) check_ran_fp8(forward, refill(1));
}

// The architectures' MoE options (checkpoint/hf_moe.h) at the graph cases' sizes.
enum class MoeVariant {
  kPlain,     // softmax top-2
  kDeepseek,  // sigmoid, expert bias, 3 groups of 2 keeping 2, scaled, a gated shared expert
  kLlama4,    // sigmoid top-1, input-scaled experts, a shared expert
  kGptOss,    // a router bias, clamped SwiGLU interleaved by 1, biased experts
};

// A MoELayer [6 experts top-2, 128 → 192 → 128] step: routing, permutation and experts.
void check_moe_graph(bool fuse_permutation, const MaybeRecipe& recipe,
                     MoeVariant variant = MoeVariant::kPlain) {
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torchmoe::MoELayerOptions options(/*hidden=*/128, /*ffn_hidden=*/192, /*num_experts=*/6,
                                    /*topk=*/variant == MoeVariant::kLlama4 ? 1 : 2);
  options.params_dtype(torch::kBFloat16).device(torch::kCUDA).fuse_permutation(fuse_permutation);
  options.router().aux_loss_coeff(1e-2).z_loss_coeff(1e-3);  // the routers' losses are captured too
  switch (variant) {
    case MoeVariant::kPlain:
      break;
    case MoeVariant::kDeepseek:
      options.router()
          .score_function(torchmoe::RouterScore::kSigmoid)
          .expert_bias(true)
          .num_groups(3)
          .topk_groups(2)
          .routed_scaling_factor(2.5);
      options.shared_expert(torchmoe::SharedExpertOptions(64).gate(true));
      break;
    case MoeVariant::kLlama4:
      options.router().score_function(torchmoe::RouterScore::kSigmoid);
      options.scale_expert_input(true).shared_expert(torchmoe::SharedExpertOptions(192));
      break;
    case MoeVariant::kGptOss:
      options.router().bias(true);
      options.experts()
          .activation(torchmoe::GluActivation::kClampedSwiGLU)
          .glu_interleave_size(1)
          .scale_bias(true);
      options.experts().linear().bias(true);
      break;
  }
  options.experts().linear().fp8_amax_history_len(history_for(recipe));
  torchmoe::MoELayer moe(options);
  // Every row is a token: the whole output is checked (no padding rows).
  const torch::Tensor x = torch::zeros({kRows, 128}, cuda).requires_grad_();
  const torch::Tensor dy = torch::zeros({kRows, 128}, cuda);
  auto refill = [&](int trial) {
    const torch::NoGradGuard no_grad;
    // A new draw each trial routes differently: new split sizes inside the graph.
    x.detach().copy_(torch::randn({kRows, 128}, cuda) * (trial + 1));
    dy.copy_(torch::randn({kRows, 128}, cuda));
    return kRows;
  };
  auto forward = [&](bool fp8) {
    const auto guard = autocast_for(recipe, fp8);
    return moe(x);
  };
  GraphStep s;
  s.step = [&] {
    const torchmoe::MoEOutput out = forward(true);
    torch::autograd::backward({out.output, out.aux_loss}, {dy, torch::ones_like(out.aux_loss)});
    return out.output;
  };
  s.leaves = {x};
  s.params = moe->parameters();
  check_graph_matches_eager(s, refill);
  if (recipe) check_ran_fp8([&](bool fp8) { return forward(fp8).output; }, kRows);
}

}  // namespace

TEST_CASE("GroupedMLP with device splits replays in a CUDA graph",
          "[modules][grouped_mlp][cuda][graph]") {
  const auto backend =
      GENERATE(torchmoe::GemmBackend::kSm90, torchmoe::GemmBackend::kCublasLtGrouped);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  INFO("backend " << static_cast<int>(backend));
  torch::manual_seed(22);
  check_mlp_graph(backend, std::nullopt);
}

TEST_CASE("FP8 GroupedMLP with device splits replays in a CUDA graph",
          "[modules][grouped_mlp][fp8][cuda][graph]") {
  // Both layers in FP8, the SwiGLU inside the casts of fc2's input and of fc1's output gradient.
  // Per-tensor scales on either device-size backend; block scales on the sm90 kernel only (the
  // cuBLASLt grouped matmul has none on Hopper, and per-group matmuls need host sizes).
  using torchmoe::GemmBackend;
  const auto [recipe, backend] = GENERATE(
      table<GraphRecipe, GemmBackend>({{GraphRecipe::kCurrent, GemmBackend::kSm90},
                                       {GraphRecipe::kCurrent, GemmBackend::kCublasLtGrouped},
                                       {GraphRecipe::kDelayed, GemmBackend::kSm90},
                                       {GraphRecipe::kDelayed, GemmBackend::kCublasLtGrouped},
                                       {GraphRecipe::kBlock, GemmBackend::kSm90}}));
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  INFO("recipe " << static_cast<int>(recipe) << ", backend " << static_cast<int>(backend));
  torch::manual_seed(25);
  check_mlp_graph(backend, graph_recipe(recipe));
}

TEST_CASE("MoELayer replays in a CUDA graph: routing, permutation and experts without a host sync",
          "[modules][moe][cuda][graph]") {
  TORCHMOE_REQUIRE_SM90();  // device splits need the sm90 kernel
  const bool fuse = GENERATE(false, true);
  const MoeVariant variant =
      GENERATE(MoeVariant::kPlain, MoeVariant::kDeepseek, MoeVariant::kLlama4, MoeVariant::kGptOss);
  INFO("fuse_permutation " << fuse << ", variant " << static_cast<int>(variant));
  torch::manual_seed(23);
  check_moe_graph(fuse, std::nullopt, variant);
}

TEST_CASE("FP8 MoELayer replays in a CUDA graph", "[modules][moe][fp8][cuda][graph]") {
  // The experts in FP8 on the sm90 kernel. With fused permutation fc1's input is cast from the
  // tokens through the row map and fc2's output gradient in the unpermute's backward; without,
  // the permuted copies are cast.
  TORCHMOE_REQUIRE_SM90();
  const GraphRecipe recipe =
      GENERATE(GraphRecipe::kCurrent, GraphRecipe::kDelayed, GraphRecipe::kBlock);
  const bool fuse = GENERATE(false, true);
  const MoeVariant variant =
      GENERATE(MoeVariant::kPlain, MoeVariant::kDeepseek, MoeVariant::kLlama4, MoeVariant::kGptOss);
  INFO("recipe " << static_cast<int>(recipe) << ", fuse_permutation " << fuse << ", variant "
                 << static_cast<int>(variant));
  torch::manual_seed(27);
  check_moe_graph(fuse, graph_recipe(recipe), variant);
}

TEST_CASE("GroupedLinear with device splits leaves the output's rows past the split sum alone",
          "[modules][grouped_linear][cuda]") {
  // The eager counterpart of GraphStep::padding_kept for steps of several ops: the output block
  // of a call is refilled with the sentinel and released, and the next call, which the caching
  // allocator serves from the same block, must write only the rows of its groups.
  const auto backend =
      GENERATE(torchmoe::GemmBackend::kSm90, torchmoe::GemmBackend::kCublasLtGrouped);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  const bool bias = GENERATE(false, true);
  INFO("backend " << static_cast<int>(backend) << ", bias " << bias);
  torch::manual_seed(24);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torchmoe::GroupedLinear layer(torchmoe::GroupedLinearOptions(6, 192, 128)
                                    .params_dtype(torch::kBFloat16)
                                    .device(torch::kCUDA)
                                    .bias(bias)
                                    .gemm_backend(backend));
  const torch::Tensor x = torch::randn({kRows, 192}, cuda);
  const torch::Tensor splits = torch::tensor(kTrialSplits[1], torch::kInt).to(torch::kCUDA);
  const int64_t valid = std::accumulate(kTrialSplits[1].begin(), kTrialSplits[1].end(), int64_t{0});
  const torch::NoGradGuard no_grad;
  torch::Tensor first = layer(x, torchmoe::SplitSizes(splits));
  first.fill_(kSentinel);
  const void* block = first.data_ptr();
  first = torch::Tensor();
  const torch::Tensor y = layer(x, torchmoe::SplitSizes(splits));
  if (y.data_ptr() != block) {
    WARN("SKIPPED: the allocator served the second output from another block");
    return;
  }
  CHECK(y.narrow(0, valid, kRows - valid).eq(kSentinel).all().item<bool>());
  CHECK_FALSE(y.narrow(0, 0, valid).eq(kSentinel).any().item<bool>());
}
