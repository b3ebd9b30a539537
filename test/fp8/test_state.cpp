// FP8 delayed-scaling state: its buffers in GroupedLinear and GroupedMLP, the checkpoint round
// trip through torch::save / torch::load and load_state_dict, dtype and clone behaviour, the
// update through the module helper ([cuda]), and the amax reduction's checks in one process (its
// collective runs in test_reduce_amax_ep.cpp).

#include <torchmoe/fp8/state.h>
#include <torchmoe/modules/grouped_linear.h>
#include <torchmoe/modules/grouped_mlp.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <sstream>
#include <string>
#include <unordered_map>

#include "test_utils.h"

using namespace torchmoe::fp8;
using Catch::Matchers::Contains;
using torchmoe::GroupedLinear;
using torchmoe::GroupedLinearOptions;
using torchmoe::GroupedMLP;
using torchmoe::GroupedMLPOptions;

namespace {

constexpr TensorRole kAllRoles[] = {TensorRole::kInput, TensorRole::kWeight,
                                    TensorRole::kGradOutput};

// Fills every FP8 buffer of `state` with distinct values, as a few training steps would.
void fill_state(Fp8StateImpl& state) {
  torch::NoGradGuard no_grad;
  double base = 1.0;
  for (TensorRole role : kAllRoles) {
    const DelayedScalingTensors& t = state.tensors(role);
    t.amax_history.uniform_(0.5, 8.0);
    t.scale.fill_(base);
    t.scale_inv.fill_(1.0 / base);
    base *= 2.0;
  }
}

void check_same_state(const Fp8StateImpl& a, const Fp8StateImpl& b) {
  for (TensorRole role : kAllRoles) {
    INFO(role_name(role));
    CHECK(a.tensors(role).amax_history.equal(b.tensors(role).amax_history));
    CHECK(a.tensors(role).scale.equal(b.tensors(role).scale));
    CHECK(a.tensors(role).scale_inv.equal(b.tensors(role).scale_inv));
  }
}

std::unordered_map<std::string, torch::Tensor> state_dict(const torch::nn::Module& m) {
  std::unordered_map<std::string, torch::Tensor> state;
  for (const auto& p : m.named_parameters()) state[p.key()] = p.value();
  for (const auto& b : m.named_buffers()) state[b.key()] = b.value();
  return state;
}

}  // namespace

TEST_CASE("Fp8State starts as TransformerEngine's and names its buffers", "[fp8][state]") {
  Fp8State state(Fp8StateOptions(3, 5));
  const auto buffers = state->named_buffers();
  CHECK(buffers.size() == 9);
  for (const std::string role : {"input", "weight", "grad_output"}) {
    INFO(role);
    REQUIRE(buffers.contains(role + "_amax_history"));
    CHECK(buffers[role + "_amax_history"].sizes() == torch::IntArrayRef({5, 3}));
    CHECK(buffers[role + "_amax_history"].eq(0).all().item<bool>());
    CHECK(buffers[role + "_scale"].sizes() == torch::IntArrayRef({3}));
    CHECK(buffers[role + "_scale"].eq(1).all().item<bool>());
    CHECK(buffers[role + "_scale_inv"].eq(1).all().item<bool>());
    CHECK(buffers[role + "_scale_inv"].scalar_type() == torch::kFloat32);
  }
  // tensors() hands out the registered buffers themselves.
  CHECK(state->tensors(TensorRole::kWeight).scale.is_same(buffers["weight_scale"]));
  std::ostringstream printed;
  printed << *state;
  CHECK(printed.str() == "torchmoe::fp8::Fp8State(num_gemms=3, amax_history_len=5)");
  CHECK_THROWS_WITH(Fp8State(Fp8StateOptions(3, 0)),
                    Contains("fp8::Fp8State: amax_history_len must be >= 1, got 0"));
  CHECK_THROWS_WITH(Fp8State(Fp8StateOptions(0, 4)),
                    Contains("fp8::Fp8State: num_gemms must be positive, got 0"));
}

TEST_CASE("GroupedLinear without FP8 state has no extra buffers or children", "[fp8][state]") {
  GroupedLinear m(GroupedLinearOptions(3, 8, 4));
  CHECK(m->named_buffers().is_empty());
  CHECK(m->children().empty());
  CHECK_FALSE(m->fp8_state());
  // Its state dict is the parameters alone, as before FP8 existed, and loads as before.
  GroupedLinear target(GroupedLinearOptions(3, 8, 4));
  std::stringstream stream;
  torch::save(m, stream);
  torch::load(target, stream);
  CHECK(target->expert_weights()[1].equal(m->expert_weights()[1]));
  CHECK_THROWS_WITH(GroupedLinear(GroupedLinearOptions(3, 8, 4).fp8_amax_history_len(-1)),
                    Contains("GroupedLinear: fp8_amax_history_len must be >= 0 (0: no FP8 "
                             "state), got -1"));
}

TEST_CASE("GroupedLinear FP8 state round-trips through torch::save / torch::load", "[fp8][state]") {
  const bool single = GENERATE(false, true);
  INFO("single_grouped_weight=" << single);
  const auto options = GroupedLinearOptions(3, 16, 8)
                           .single_grouped_weight(single)
                           .single_grouped_bias(single)
                           .fp8_amax_history_len(4);
  GroupedLinear source(options);
  REQUIRE(source->fp8_state());
  const auto buffers = source->named_buffers();
  CHECK(buffers.size() == 9);
  CHECK(buffers.contains("fp8_state.input_amax_history"));
  CHECK(buffers.contains("fp8_state.grad_output_scale_inv"));
  CHECK(buffers["fp8_state.weight_amax_history"].sizes() == torch::IntArrayRef({4, 3}));
  fill_state(*source->fp8_state());

  GroupedLinear target(options);
  SECTION("torch::save / torch::load") {
    std::stringstream stream;
    torch::save(source, stream);
    torch::load(target, stream);
  }
  SECTION("load_state_dict from named parameters and buffers") {
    target->load_state_dict(state_dict(*source));
  }
  check_same_state(*target->fp8_state(), *source->fp8_state());
  for (int g = 0; g < 3; ++g) CHECK(target->expert_weights()[g].equal(source->expert_weights()[g]));
  // Copied into the target's own buffers, not shared with the source's.
  CHECK_FALSE(target->fp8_state()
                  ->tensors(TensorRole::kInput)
                  .scale.is_same(source->fp8_state()->tensors(TensorRole::kInput).scale));
}

TEST_CASE("GroupedLinear FP8 state across checkpoints with and without it", "[fp8][state]") {
  GroupedLinear fp8_layer(GroupedLinearOptions(2, 16, 8).fp8_amax_history_len(4));
  fill_state(*fp8_layer->fp8_state());
  GroupedLinear plain(GroupedLinearOptions(2, 16, 8));

  SECTION("a checkpoint without FP8 state leaves the initial state") {
    GroupedLinear target(GroupedLinearOptions(2, 16, 8).fp8_amax_history_len(4));
    std::stringstream stream;
    torch::save(plain, stream);
    torch::load(target, stream);
    CHECK(target->expert_weights()[0].equal(plain->expert_weights()[0]));
    check_same_state(*target->fp8_state(), *Fp8State(Fp8StateOptions(2, 4)));
    target->load_state_dict(state_dict(*plain));
    check_same_state(*target->fp8_state(), *Fp8State(Fp8StateOptions(2, 4)));
  }
  SECTION("a layer without FP8 state ignores it") {
    std::stringstream stream;
    torch::save(fp8_layer, stream);
    torch::load(plain, stream);
    CHECK(plain->expert_weights()[1].equal(fp8_layer->expert_weights()[1]));
    CHECK_NOTHROW(plain->load_state_dict(state_dict(*fp8_layer)));
  }
  SECTION("another history length is an error") {
    GroupedLinear target(GroupedLinearOptions(2, 16, 8).fp8_amax_history_len(8));
    std::stringstream stream;
    torch::save(fp8_layer, stream);
    CHECK_THROWS_WITH(
        torch::load(target, stream),
        Contains("fp8::Fp8State: 'fp8_state.input_amax_history' must have shape [8, 2] "
                 "(num_gemms=2, amax_history_len=8), got [4, 2]"));
  }
  SECTION("a rejected checkpoint leaves the state whole") {
    GroupedLinear target(GroupedLinearOptions(2, 16, 8).fp8_amax_history_len(4));
    auto state = state_dict(*fp8_layer);
    state["fp8_state.grad_output_amax_history"] = torch::zeros({5, 2});
    CHECK_THROWS_WITH(target->load_state_dict(state),
                      Contains("'fp8_state.grad_output_amax_history' must have shape [4, 2]"));
    check_same_state(*target->fp8_state(), *Fp8State(Fp8StateOptions(2, 4)));
  }
  SECTION("an unknown FP8 key is an error") {
    auto state = state_dict(*fp8_layer);
    state["fp8_state.output_scale"] = torch::ones({2});
    CHECK_THROWS_WITH(
        fp8_layer->load_state_dict(state),
        Contains("fp8::Fp8State::load_state_dict: unexpected key 'fp8_state.output_scale'"));
  }
}

TEST_CASE("GroupedLinear FP8 state stays float32 through ->to(dtype) and is cloned",
          "[fp8][state]") {
  GroupedLinear m(GroupedLinearOptions(2, 16, 8).fp8_amax_history_len(3));
  fill_state(*m->fp8_state());
  const auto before = m->fp8_state()->clone();
  m->to(torch::kBFloat16);
  CHECK(m->expert_weights()[0].scalar_type() == torch::kBFloat16);
  m->to(torch::kCPU, torch::kFloat64);
  CHECK(m->expert_weights()[0].scalar_type() == torch::kFloat64);
  for (const auto& b : m->named_buffers()) {
    INFO(b.key());
    CHECK(b.value().scalar_type() == torch::kFloat32);
  }
  check_same_state(*m->fp8_state(), *std::dynamic_pointer_cast<Fp8StateImpl>(before));

  const auto copy = std::dynamic_pointer_cast<torchmoe::GroupedLinearImpl>(m->clone());
  REQUIRE(copy);
  REQUIRE(copy->fp8_state());
  check_same_state(*copy->fp8_state(), *m->fp8_state());
  torch::NoGradGuard no_grad;
  copy->fp8_state()->tensors(TensorRole::kWeight).scale.fill_(7);
  CHECK_FALSE(m->fp8_state()->tensors(TensorRole::kWeight).scale.eq(7).any().item<bool>());
}

TEST_CASE("GroupedMLP passes the FP8 state option to both layers", "[fp8][state]") {
  GroupedMLP mlp(
      GroupedMLPOptions(2, 16, 32).linear(GroupedLinearOptions(1, 1, 1).fp8_amax_history_len(6)));
  const auto buffers = mlp->named_buffers();
  CHECK(buffers.size() == 18);
  CHECK(buffers["fc1.fp8_state.input_amax_history"].sizes() == torch::IntArrayRef({6, 2}));
  CHECK(buffers.contains("fc2.fp8_state.grad_output_scale"));

  GroupedMLP target(
      GroupedMLPOptions(2, 16, 32).linear(GroupedLinearOptions(1, 1, 1).fp8_amax_history_len(6)));
  fill_state(*mlp->fc2->fp8_state());
  std::stringstream stream;
  torch::save(mlp, stream);
  torch::load(target, stream);
  check_same_state(*target->fc2->fp8_state(), *mlp->fc2->fp8_state());
}

TEST_CASE("fp8::update_delayed_scaling checks the recipe and is CUDA only",
          "[fp8][state][errors]") {
  GroupedMLP mlp(
      GroupedMLPOptions(2, 16, 32).linear(GroupedLinearOptions(1, 1, 1).fp8_amax_history_len(6)));
  CHECK_THROWS_WITH(
      update_delayed_scaling(*mlp, DelayedScaling().amax_history_len(5), Pass::kForward),
      Contains("fp8::Fp8State::update: the recipe's amax_history_len must be the state's 6 (the "
               "layer's fp8_amax_history_len), got 5"));
  CHECK_THROWS_AS(
      update_delayed_scaling(*mlp, DelayedScaling().amax_history_len(6), Pass::kForward),
      c10::NotImplementedError);
  GroupedLinear plain(GroupedLinearOptions(2, 16, 8));
  CHECK(update_delayed_scaling(*plain, DelayedScaling(), Pass::kForward) == 0);
}

TEST_CASE("fp8::reduce_amax: the group's checks, and when no collective runs",
          "[fp8][state][errors]") {
  GroupedMLP mlp(
      GroupedMLPOptions(2, 16, 32).linear(GroupedLinearOptions(1, 1, 1).fp8_amax_history_len(4)));
  fill_state(*mlp->fc1->fp8_state());
  const auto before = mlp->fc1->fp8_state()->clone();
  const auto same_as_before = [&] {
    check_same_state(*mlp->fc1->fp8_state(), *std::dynamic_pointer_cast<Fp8StateImpl>(before));
  };
  // Groups of this one process without a backend, as a CUDA-only (NCCL) group is for CPU state:
  // any collective on them is an error, so a call that passes ran none.
  const auto group_of = [](int size) {
    return torchmoe::ProcessGroupOptions(
        c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 0, size));
  };
  const auto recipe = DelayedScaling().amax_history_len(4);

  CHECK_THROWS_WITH(reduce_amax(*mlp, Pass::kForward, group_of(2)),
                    Contains("all_reduce_max_: the process group must have a backend for the "
                             "data's device cpu (Gloo for CPU, NCCL for CUDA)"));
  CHECK_THROWS_WITH(
      reduce_amax(*mlp, Pass::kForward, c10::intrusive_ptr<c10d::ProcessGroup>()),
      Contains("fp8::reduce_amax: the process group must be defined, got a null group"));
  CHECK_THROWS_WITH(
      mlp->fc1->fp8_state()->reduce_amax(Pass::kBackward, c10::intrusive_ptr<c10d::ProcessGroup>()),
      Contains("fp8::Fp8State::reduce_amax: the process group must be defined, got a null group"));
  // One rank: nothing to reduce.
  CHECK(reduce_amax(*mlp, Pass::kForward, group_of(1)) == 2);
  mlp->fc1->fp8_state()->reduce_amax(Pass::kBackward, group_of(1));
  // reduce_amax(false), or no group: the update runs no collective (and stops at the CPU op).
  CHECK_THROWS_AS(update_delayed_scaling(*mlp, DelayedScaling(recipe).reduce_amax(false),
                                         Pass::kForward, group_of(2)),
                  c10::NotImplementedError);
  CHECK_THROWS_AS(update_delayed_scaling(*mlp, recipe, Pass::kForward), c10::NotImplementedError);
  // A bad recipe is an error before the collective.
  CHECK_THROWS_WITH(update_delayed_scaling(*mlp, DelayedScaling().amax_history_len(5),
                                           Pass::kForward, group_of(2)),
                    Contains("the recipe's amax_history_len must be the state's 4"));
  // With reduce_amax and a group, the update reduces first.
  CHECK_THROWS_WITH(update_delayed_scaling(*mlp, recipe, Pass::kBackward, group_of(2)),
                    Contains("all_reduce_max_: the process group must have a backend"));
  CHECK_THROWS_WITH(mlp->fc2->fp8_state()->update(recipe, Pass::kBackward, group_of(2)),
                    Contains("all_reduce_max_: the process group must have a backend"));
  same_as_before();

  // The states of one model are reduced as one buffer, so they must be on one device.
  torch::nn::Module model;
  model.register_module("cpu", Fp8State(Fp8StateOptions(2, 4)));
  model.register_module("meta", Fp8State(Fp8StateOptions(2, 4).device(torch::kMeta)));
  CHECK_THROWS_WITH(
      reduce_amax(model, Pass::kForward, group_of(2)),
      Contains("fp8::reduce_amax: every FP8 state must be on one device, got cpu and meta"));
  // A model without FP8 state runs no collective.
  GroupedLinear plain(GroupedLinearOptions(2, 16, 8));
  CHECK(reduce_amax(*plain, Pass::kForward, group_of(2)) == 0);
}

TEST_CASE("fp8::update_delayed_scaling updates every layer's state on CUDA", "[fp8][state][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const int64_t history = 3;
  GroupedMLP mlp(GroupedMLPOptions(2, 16, 32).linear(
      GroupedLinearOptions(1, 1, 1).device(torch::kCUDA).fp8_amax_history_len(history)));
  const auto recipe = DelayedScaling().amax_history_len(history).margin(1);
  const auto fp32 = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA);
  // This step's amaxes, as the quantize would have recorded them in row 0.
  const torch::Tensor amax = torch::tensor({2.0f, 0.5f}, fp32);
  {
    torch::NoGradGuard no_grad;
    for (auto* layer : {mlp->fc1.get(), mlp->fc2.get()}) {
      for (TensorRole role : kAllRoles)
        layer->fp8_state()->tensors(role).amax_history[0].copy_(amax);
    }
  }
  // Forward: input and weight; grad_output keeps its scale of 1 and its unrolled history.
  CHECK(update_delayed_scaling(*mlp, recipe, Pass::kForward) == 2);
  const torch::Tensor e4m3 = torch::tensor({448.0f / 2 / 2.0f, 448.0f / 2 / 0.5f}, fp32);
  for (auto* layer : {mlp->fc1.get(), mlp->fc2.get()}) {
    for (TensorRole role : {TensorRole::kInput, TensorRole::kWeight}) {
      INFO(role_name(role));
      const DelayedScalingTensors& t = layer->fp8_state()->tensors(role);
      CHECK(t.amax_history[0].eq(0).all().item<bool>());
      CHECK(t.amax_history[history - 1].equal(amax));
      CHECK(t.scale.equal(e4m3));
      CHECK(t.scale_inv.equal(1.0f / e4m3));
    }
    const DelayedScalingTensors& grad = layer->fp8_state()->tensors(TensorRole::kGradOutput);
    CHECK(grad.scale.eq(1).all().item<bool>());
    CHECK(grad.amax_history[0].equal(amax));
  }
  // Backward: grad_output in e5m2 (HYBRID).
  CHECK(update_delayed_scaling(*mlp, recipe, Pass::kBackward) == 2);
  const torch::Tensor e5m2 = torch::tensor({57344.0f / 2 / 2.0f, 57344.0f / 2 / 0.5f}, fp32);
  for (auto* layer : {mlp->fc1.get(), mlp->fc2.get()}) {
    const DelayedScalingTensors& grad = layer->fp8_state()->tensors(TensorRole::kGradOutput);
    CHECK(grad.scale.equal(e5m2));
    CHECK(grad.amax_history[history - 1].equal(amax));
  }
  // The updated state survives a checkpoint into a fresh layer on the CPU.
  GroupedMLP target(GroupedMLPOptions(2, 16, 32).linear(
      GroupedLinearOptions(1, 1, 1).fp8_amax_history_len(history)));
  std::stringstream stream;
  torch::save(mlp, stream);
  torch::load(target, stream);
  CHECK(target->fc1->fp8_state()->tensors(TensorRole::kWeight).scale.equal(e4m3.cpu()));
}
