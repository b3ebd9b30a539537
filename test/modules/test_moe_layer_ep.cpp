// MoELayer with expert parallelism over Gloo, run as 2 and 4 processes (ctest: ep_n2, ep_n4), and
// over NCCL, one GPU per rank (ep_nccl_n1, ep_nccl_n2):
// each rank's output and gradients equal the single-process MoELayer's on the same global batch
// (float64 over Gloo, bf16 on the GPUs; the router's gradient and the aux loss summed over the
// ranks); uneven batches, a rank without tokens, an expert and a whole rank that receive none;
// capacity mode's token-count check and capture over NCCL; argument errors, and
// init_process_group's errors for a bad environment.

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <torchmoe/torchmoe.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "distributed/ep_test_utils.h"
#include "test_utils.h"
#include "torchmoe/ops/expert_parallel.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::MoELayer;
using torchmoe::MoELayerOptions;

namespace {

struct EpCase {
  int64_t experts_per_rank;
  int64_t topk;
  std::vector<int64_t> tokens_per_rank;
  // Experts no token may choose (expert bias -100 in both layers).
  std::vector<int64_t> blocked_experts;
  // Capacity mode, with a capacity factor that drops nothing (equal tokens per rank).
  bool pad_to_capacity = false;
};

torch::Tensor group_sum(const torch::Tensor& t,
                        const torchmoe::ProcessGroupOptions& group = test_group()) {
  torch::Tensor sum = t.detach().clone().contiguous();
  torchmoe::distributed::all_reduce_sum_(sum, group);
  return sum;
}

// The expert-parallel layer's parameters from the single-process one's: the router whole, the
// experts [first, first + the layer's local count).
void copy_shard(MoELayer& layer, MoELayer& single, int64_t first) {
  const torch::NoGradGuard no_grad;
  layer->router->weight.copy_(single->router->weight);
  layer->router->expert_bias.copy_(single->router->expert_bias);
  for (int64_t l = 0; l < layer->experts->options.num_experts(); ++l) {
    layer->experts->fc1->expert_weights()[l].copy_(
        single->experts->fc1->expert_weights()[first + l]);
    layer->experts->fc2->expert_weights()[l].copy_(
        single->experts->fc2->expert_weights()[first + l]);
  }
}

void block_experts(MoELayer& layer, const std::vector<int64_t>& experts) {
  const torch::NoGradGuard no_grad;
  for (const int64_t e : experts) layer->router->expert_bias[e] = -100.0;
}

void check_against_single_process(const EpCase& c) {
  const int64_t ep = test_world(), rank = test_rank();
  const int64_t hidden = 16, ffn = 24, experts = c.experts_per_rank * ep;
  REQUIRE(static_cast<int64_t>(c.tokens_per_rank.size()) == ep);
  torch::manual_seed(29);  // the same global batch and parameters on every rank
  MoELayerOptions options(hidden, ffn, experts, c.topk);
  options.params_dtype(torch::kFloat64);
  options.router().aux_loss_coeff(1e-2).z_loss_coeff(1e-3).expert_bias(true);
  if (c.pad_to_capacity) {
    // Capacity T·k/E·E/k = T: every expert can keep every token, so nothing is dropped.
    options.router().capacity_factor(static_cast<double>(experts) / c.topk);
  }
  MoELayer single(options);
  block_experts(single, c.blocked_experts);
  const int64_t total =
      std::accumulate(c.tokens_per_rank.begin(), c.tokens_per_rank.end(), int64_t{0});
  const torch::Tensor x_global = torch::randn({total, hidden}, torch::kFloat64);
  const torch::Tensor dy_global = torch::randn({total, hidden}, torch::kFloat64);

  const torch::Tensor xs = x_global.clone().requires_grad_(true);
  const torchmoe::MoEOutput ref = single(xs);
  ((ref.output * dy_global).sum() + ref.aux_loss).backward();

  MoELayerOptions ep_options = options;
  ep_options.expert_parallel(test_group()).pad_to_capacity(c.pad_to_capacity);
  MoELayer layer(ep_options);
  REQUIRE(layer->experts->options.num_experts() == c.experts_per_rank);
  const int64_t first = rank * c.experts_per_rank;
  copy_shard(layer, single, first);
  const torch::Tensor x = rank_rows(x_global, c.tokens_per_rank, rank).clone().requires_grad_(true);
  const torchmoe::MoEOutput out = layer(x);
  ((out.output * rank_rows(dy_global, c.tokens_per_rank, rank)).sum() + out.aux_loss).backward();

  const Tolerance tol = tolerance_for(torch::kFloat64);
  check_close(out.output, rank_rows(ref.output, c.tokens_per_rank, rank), tol, "output");
  check_close(x.grad(), rank_rows(xs.grad(), c.tokens_per_rank, rank), tol, "grad x");
  check_close(group_sum(out.aux_loss), ref.aux_loss, tol, "aux loss summed over ranks");
  REQUIRE(torch::equal(out.tokens_per_expert, ref.tokens_per_expert));
  check_close(group_sum(layer->router->weight.grad()), single->router->weight.grad(), tol,
              "router weight grad summed over ranks");
  for (int64_t l = 0; l < c.experts_per_rank; ++l) {
    INFO("local expert " << l << " = global expert " << first + l);
    check_close(layer->experts->fc1->expert_weights()[l].grad(),
                single->experts->fc1->expert_weights()[first + l].grad(), tol, "fc1 grad");
    check_close(layer->experts->fc2->expert_weights()[l].grad(),
                single->experts->fc2->expert_weights()[first + l].grad(), tol, "fc2 grad");
  }
}

// The [ep_nccl] cases' group (one rendezvous per process), made on first use: Gloo for CPU
// tensors and NCCL on this rank's GPU (LOCAL_RANK, made the current device). False, after a
// visible skip, without a GPU for each local rank (the same decision on every rank of a host, so
// that no rank joins the rendezvous alone).
bool nccl_group_available() {
  const char* local_world_env = std::getenv("LOCAL_WORLD_SIZE");
  const char* world_env = local_world_env ? local_world_env : std::getenv("WORLD_SIZE");
  REQUIRE(world_env != nullptr);
  const int64_t local_world = std::stoll(world_env);
  if (!cuda_available() || torch::cuda::device_count() < local_world) {
    WARN("SKIPPED: no CUDA device for each of the " << local_world << " local ranks");
    return false;
  }
  return true;
}

const torchmoe::ProcessGroupOptions& nccl_test_group() {
  static const torchmoe::ProcessGroupOptions group =
      torchmoe::ProcessGroupOptions(
          torchmoe::distributed::init_process_group(torch::kCUDA, test_timeout()))
          .timeout(test_timeout());
  return group;
}

// 1, 2, ... tokens per rank: a different, uneven load on every rank.
std::vector<int64_t> uneven_tokens(int64_t ranks, int64_t base, int64_t step) {
  std::vector<int64_t> sizes;
  for (int64_t r = 0; r < ranks; ++r) sizes.push_back(base + step * r);
  return sizes;
}

}  // namespace

TEST_CASE("MoELayer expert parallel equals the single-process layer: uneven batches", "[ep]") {
  check_against_single_process(
      {/*experts_per_rank=*/2, /*topk=*/2, uneven_tokens(test_world(), 5, 7), {}});
  check_against_single_process(
      {/*experts_per_rank=*/1, /*topk=*/1, uneven_tokens(test_world(), 9, 4), {}});
}

TEST_CASE("MoELayer expert parallel: a rank without tokens, an expert and a rank receiving none",
          "[ep]") {
  const int64_t ep = test_world(), per_rank = 3;
  // Rank 1 has no tokens of its own, and expert 0 and all of rank 1's experts are blocked, so
  // rank 1 receives nothing either.
  std::vector<int64_t> tokens = uneven_tokens(ep, 6, 5);
  tokens[1] = 0;
  std::vector<int64_t> blocked = {0};
  for (int64_t l = 0; l < per_rank; ++l) blocked.push_back(per_rank + l);
  check_against_single_process({per_rank, /*topk=*/2, tokens, blocked});
}

TEST_CASE("MoELayer expert parallel in capacity mode equals the single-process layer", "[ep]") {
  const std::vector<int64_t> tokens(test_world(), 11);
  check_against_single_process({/*experts_per_rank=*/2, /*topk=*/2, tokens, {}, true});
  std::vector<int64_t> blocked = {0, 3};  // an expert, and half a rank's shard, receive nothing
  check_against_single_process({/*experts_per_rank=*/2, /*topk=*/2, tokens, blocked, true});
}

TEST_CASE("MoELayer capacity mode drops what the dropless exchange drops", "[ep]") {
  const int64_t ep = test_world(), hidden = 12, experts = 2 * ep, topk = 2;
  torch::manual_seed(31);
  MoELayerOptions options(hidden, 20, experts, topk);
  options.params_dtype(torch::kFloat64).expert_parallel(test_group());
  options.router().capacity_factor(0.75);
  // E experts keep at most E·C of the T·k = 26 slots: some are dropped on every rank.
  REQUIRE(experts * torchmoe::expert_capacity(13, options.router()) < 13 * topk);
  MoELayer dropless(options);
  MoELayerOptions padded_options = options;
  padded_options.pad_to_capacity(true);
  MoELayer padded(padded_options);
  {
    const torch::NoGradGuard no_grad;
    for (const auto& item : dropless->named_parameters()) {
      padded->named_parameters()[item.key()].copy_(item.value());
    }
  }
  // Rank-dependent tokens; the same count on every rank, as capacity mode needs.
  torch::manual_seed(100 + test_rank());
  const torch::Tensor x = torch::randn({13, hidden}, torch::kFloat64);
  const torch::Tensor dy = torch::randn({13, hidden}, torch::kFloat64);
  const torch::Tensor x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
  const torchmoe::MoEOutput a = dropless(x1), b = padded(x2);
  ((a.output * dy).sum() + a.aux_loss).backward();
  ((b.output * dy).sum() + b.aux_loss).backward();
  const Tolerance tol = tolerance_for(torch::kFloat64);
  check_close(b.output, a.output, tol, "output");
  check_close(x2.grad(), x1.grad(), tol, "grad x");
  for (const auto& item : dropless->named_parameters()) {
    check_close(padded->named_parameters()[item.key()].grad(), item.value().grad(), tol,
                "grad " + item.key());
  }
}

// Capacity mode's all-to-all sizes follow from T: every rank refuses different token counts (one
// all-reduce, the first time a layer sees a count), and then runs with equal ones.
TEST_CASE("MoELayer capacity mode refuses different token counts on the ranks", "[ep]") {
  const int64_t ep = test_world(), rank = test_rank(), hidden = 8;
  MoELayerOptions options(hidden, 8, 2 * ep, 1);
  options.params_dtype(torch::kFloat64).expert_parallel(test_group()).pad_to_capacity(true);
  options.router().capacity_factor(2.0);
  MoELayer layer(options);
  const std::string range = "from 5 to " + std::to_string(5 + ep - 1) + " across the group";
  REQUIRE_THROWS_WITH(layer(torch::randn({5 + rank, hidden}, torch::kFloat64)),
                      Contains("MoELayer (pad_to_capacity): every rank must have the same token "
                               "count, got " +
                               std::to_string(5 + rank) + " on rank " + std::to_string(rank) +
                               " of " + std::to_string(ep)) &&
                          Contains(range));
  // Equal counts run (the second 6 without a check, 7 with one); a later mismatch is refused too.
  for (const int64_t tokens : {6, 6, 7}) {
    const torchmoe::MoEOutput out = layer(torch::randn({tokens, hidden}, torch::kFloat64));
    CHECK(out.output.sizes() == torch::IntArrayRef({tokens, hidden}));
  }
  REQUIRE_THROWS_WITH(
      layer(torch::randn({8 + rank, hidden}, torch::kFloat64)),
      Contains("every rank must have the same token count, got " + std::to_string(8 + rank)));
}

// The names of the functions that feed the layer's all-to-alls, from its output's graph.
std::vector<std::string> all_to_all_inputs(const torch::Tensor& output) {
  std::vector<std::string> names;
  std::vector<torch::autograd::Node*> stack{output.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    const bool exchange = node->name().find("AllToAllFunction") != std::string::npos;
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (exchange && edge.function) names.push_back(edge.function->name());
      stack.push_back(edge.function.get());
    }
  }
  return names;
}

// Dropless expert parallelism over NCCL, one GPU per local rank (ctest: ep_nccl_n1, ep_nccl_n2;
// skipped without them), bf16: the received rows go through the experts' routed forward
// (route_received), which the Gloo cases above, on the CPU, run as a grouped copy, GroupedMLP and
// the ungrouping. Every rank has tokens (uneven counts), so with two ranks each receives rows from
// both in blocks that the map must interleave; an expert that no token chooses gets none. The
// reference is the single-process layer on the rank's own tokens (the same router product, so the
// same routing in bf16; no aux loss, so each token's gradient is its own): the output and x's
// gradient equal it, the local experts' gradients its gradients summed over the ranks, and the
// router's summed gradient its summed one, within bf16 rounding (a token's k rows are summed in a
// different order). On the sm90 kernel fc2 writes the rows that go back itself: the reverse
// all-to-all reads GroupedLinearFunction's output, not an ungrouping.
TEST_CASE("MoELayer dropless expert parallel over NCCL equals the single-process layer",
          "[ep_nccl]") {
  if (!nccl_group_available()) return;
  const torchmoe::ProcessGroupOptions& group = nccl_test_group();
  const torch::Device device(torch::kCUDA, c10::cuda::current_device());
  const int64_t rank = group.group()->getRank(), world = group.group()->getSize();
  const int64_t hidden = 128, ffn = 256, per_rank = 4, experts = per_rank * world;
  const auto bf16 = torch::TensorOptions().device(device).dtype(torch::kBFloat16);
  torch::manual_seed(31);  // the same global batch and parameters on every rank
  MoELayerOptions options(hidden, ffn, experts, 2);
  options.params_dtype(torch::kBFloat16).device(device);
  options.router().aux_loss_coeff(0.0).expert_bias(true);
  options.experts().linear().single_grouped_weight(true);  // [E, out, in]: one gradient to sum
  MoELayer single(options);
  block_experts(single, {1});
  const std::vector<int64_t> tokens = uneven_tokens(world, 160, 48);
  const int64_t total = std::accumulate(tokens.begin(), tokens.end(), int64_t{0});
  const torch::Tensor x_global = torch::randn({total, hidden}, bf16);
  const torch::Tensor dy_global = torch::randn({total, hidden}, bf16);
  const torch::Tensor dy = rank_rows(dy_global, tokens, rank);

  const torch::Tensor xs = rank_rows(x_global, tokens, rank).clone().requires_grad_(true);
  const torchmoe::MoEOutput ref = single(xs);
  (ref.output * dy).sum().backward();

  MoELayerOptions ep_options = options;
  ep_options.expert_parallel(group);
  MoELayer layer(ep_options);
  const int64_t first = rank * per_rank;
  copy_shard(layer, single, first);
  const torch::Tensor x = xs.detach().clone().requires_grad_(true);
  const torchmoe::MoEOutput out = layer(x);
  (out.output * dy).sum().backward();
  if (at::cuda::getCurrentDeviceProperties()->major == 9) {
    const std::vector<std::string> inputs = all_to_all_inputs(out.output);
    CHECK(std::any_of(inputs.begin(), inputs.end(), [](const std::string& n) {
      return n.find("GroupedLinearFunction") != std::string::npos;
    }));
    CHECK(std::none_of(inputs.begin(), inputs.end(), [](const std::string& n) {
      return n.find("UnpermuteFunction") != std::string::npos;
    }));
  }

  // Every rank's collectives before any check can fail, so that the ranks stay paired.
  const auto sum_over_ranks = [&](const torch::Tensor& t) {
    return group_sum(t.detach().to(torch::kFloat), group);
  };
  const torch::Tensor router_grad = sum_over_ranks(layer->router->weight.grad());
  const torch::Tensor router_grad_ref = sum_over_ranks(single->router->weight.grad());
  const auto grouped_grad = [](const torchmoe::GroupedLinear& linear) {
    return linear->weight_parameters().front().grad();
  };
  const torch::Tensor fc1_grad_ref = sum_over_ranks(grouped_grad(single->experts->fc1));
  const torch::Tensor fc2_grad_ref = sum_over_ranks(grouped_grad(single->experts->fc2));

  // bf16's relative step, and an absolute floor at 1% of the largest expected value for the
  // elements that rounding in a different summation order leaves near zero.
  const auto close = [](const torch::Tensor& actual, const torch::Tensor& expected,
                        const std::string& what) {
    const double scale = expected.abs().max().item<double>();
    check_close(actual.to(torch::kFloat), expected.to(torch::kFloat), {1.6e-2, 1e-2 * scale}, what);
  };
  close(out.output, ref.output, "output");
  close(x.grad(), xs.grad(), "grad x");
  close(router_grad, router_grad_ref, "router weight grad summed over ranks");
  close(grouped_grad(layer->experts->fc1), fc1_grad_ref.narrow(0, first, per_rank),
        "fc1 grad of the local experts");
  close(grouped_grad(layer->experts->fc2), fc2_grad_ref.narrow(0, first, per_rank),
        "fc2 grad of the local experts");
}

// Capacity mode over NCCL, one GPU per local rank (ctest: ep_nccl_n1, ep_nccl_n2; skipped without
// them): bf16 CUDA tensors, so the check's all-reduce, the router's count all-reduce and the
// all-to-alls run on NCCL. A mismatch is refused on every rank (with two ranks or more); equal
// counts run forward and backward (with the aux loss from the group's counts); the forward at a
// count the layer has checked is captured in a CUDA graph and replayed on new data to a fresh
// eager forward's bits; a new count during a capture is refused before the capacity all-to-alls
// (the router's all-reduce, already captured, is never replayed).
TEST_CASE("MoELayer capacity mode over NCCL: the token-count check, backward and a capture",
          "[ep_nccl]") {
  if (!nccl_group_available()) return;
  const torchmoe::ProcessGroupOptions& group = nccl_test_group();
  const torch::Device device(torch::kCUDA, c10::cuda::current_device());
  const int64_t rank = group.group()->getRank(), world = group.group()->getSize(), hidden = 64;
  MoELayerOptions options(hidden, 128, 4 * world, 2);
  options.params_dtype(torch::kBFloat16)
      .device(device)
      .expert_parallel(group)
      .pad_to_capacity(true);
  options.router().capacity_factor(2.0).aux_loss_coeff(1e-2);
  MoELayer layer(options);
  const auto bf16 = torch::TensorOptions().device(device).dtype(torch::kBFloat16);
  if (world > 1) {  // one rank has nothing to disagree with
    REQUIRE_THROWS_WITH(layer(torch::randn({100 + rank, hidden}, bf16)),
                        Contains("every rank must have the same token count, got " +
                                 std::to_string(100 + rank) + " on rank " + std::to_string(rank)) &&
                            Contains("from 100 to " + std::to_string(100 + world - 1)));
  }
  for (const int64_t tokens : {128, 256}) {
    const torch::Tensor x = torch::randn({tokens, hidden}, bf16).requires_grad_(true);
    const torchmoe::MoEOutput out = layer(x);
    REQUIRE(out.output.sizes() == x.sizes());
    CHECK(out.aux_loss.item<float>() > 0.0f);
    (out.output.to(torch::kFloat).square().sum() + out.aux_loss).backward();
    CHECK(out.output.isfinite().all().item<bool>());
    CHECK(x.grad().isfinite().all().item<bool>());
    CHECK(x.grad().abs().max().item<float>() > 0.0f);
  }
  // A capture cannot use the default stream; the eager forward on the side stream first makes
  // the workspaces and NCCL's state for it (256 tokens are already checked: no host sync).
  const c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool(false, device.index()));
  const torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({256, hidden}, bf16);
  layer(x);
  torch::cuda::synchronize();
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  torch::Tensor captured;
  try {
    captured = layer(x).output;
  } catch (...) {
    graph.capture_end();  // the stream leaves capture mode before the error propagates
    throw;
  }
  graph.capture_end();
  // New tokens in the captured input: the replay must route and exchange them, not the
  // capture's.
  x.copy_(torch::randn({256, hidden}, bf16));
  const torch::Tensor eager = layer(x).output;
  graph.replay();
  torch::cuda::synchronize();
  CHECK(torch::equal(captured, eager));
  const torch::Tensor unchecked = torch::randn({512, hidden}, bf16);
  at::cuda::CUDAGraph refused;
  refused.capture_begin();
  CHECK_THROWS_WITH(layer(unchecked),
                    Contains("token count must be checked against the other ranks with a host "
                             "sync, which a CUDA graph capture cannot make"));
  refused.capture_end();
}

TEST_CASE("MoELayer expert parallel: argument errors", "[ep]") {
  const int64_t ep = test_world();
  MoELayerOptions options(8, 8, 2 * ep + 1, 1);
  options.expert_parallel(test_group());
  REQUIRE_THROWS_WITH(MoELayer(options),
                      Contains("num_experts must be divisible by the expert-parallel size"));
  MoELayerOptions null_group(8, 8, 2 * ep, 1);
  null_group.expert_parallel(c10::intrusive_ptr<c10d::ProcessGroup>());
  REQUIRE_THROWS_WITH(MoELayer(null_group), Contains("must hold a process group"));
  MoELayerOptions no_capacity(8, 8, 2 * ep, 1);
  no_capacity.expert_parallel(test_group()).pad_to_capacity(true);
  REQUIRE_THROWS_WITH(MoELayer(no_capacity),
                      Contains("pad_to_capacity needs router().capacity_factor"));
  MoELayerOptions no_ep(8, 8, 2 * ep, 1);
  no_ep.pad_to_capacity(true).router().capacity_factor(1.0);
  REQUIRE_THROWS_AS(MoELayer(no_ep), c10::NotImplementedError);
  // Expert parallelism turned on after the layer holds all E experts: every rank refuses before
  // any exchange (a rank feeding E/ep-expert chunks to E experts would compute garbage).
  MoELayer built(MoELayerOptions(8, 8, 2 * ep, 1));
  built->options.expert_parallel(test_group());
  REQUIRE_THROWS_WITH(
      built(torch::randn({3, 8})),
      Contains("does not match the router (" + std::to_string(2 * ep) +
               " experts) and the experts (" + std::to_string(2 * ep) + " on this rank)"));
}

TEST_CASE("init_process_group: a bad environment is an error naming the variable", "[ep]") {
  test_group();  // made from the good environment first
  const std::string world = std::getenv("WORLD_SIZE");
  setenv("WORLD_SIZE", "two", 1);
  REQUIRE_THROWS_WITH(torchmoe::distributed::init_process_group(torch::kCPU),
                      Contains("WORLD_SIZE must be an integer in [1, ") && Contains("got 'two'"));
  setenv("WORLD_SIZE", world.c_str(), 1);
  const std::string master = std::getenv("MASTER_ADDR");
  unsetenv("MASTER_ADDR");
  REQUIRE_THROWS_WITH(torchmoe::distributed::init_process_group(torch::kCPU),
                      Contains("environment variable MASTER_ADDR must be set"));
  setenv("MASTER_ADDR", master.c_str(), 1);
  REQUIRE_THROWS_WITH(torchmoe::distributed::init_process_group(torch::Device("meta")),
                      Contains("device must be CPU (Gloo) or CUDA (NCCL and Gloo), got meta"));
  // A GPU the machine does not have (more processes than GPUs), before any rendezvous.
  REQUIRE_THROWS_WITH(torchmoe::distributed::init_process_group(torch::Device(torch::kCUDA, 100)),
                      Contains("this process's GPU is cuda:100 (the device given), but ") &&
                          Contains("CUDA devices are visible: run at most"));
  const std::string local_rank = std::getenv("LOCAL_RANK") ? std::getenv("LOCAL_RANK") : "";
  setenv("LOCAL_RANK", "100", 1);
  REQUIRE_THROWS_WITH(torchmoe::distributed::init_process_group(torch::kCUDA),
                      Contains("this process's GPU is cuda:100 (LOCAL_RANK)"));
  if (local_rank.empty()) {
    unsetenv("LOCAL_RANK");
  } else {
    setenv("LOCAL_RANK", local_rank.c_str(), 1);
  }
}
