// GroupedLinear on the CPU: accuracy matrix (TE's test_grouped_linear_accuracy axes), edge shapes,
// finite-difference gradients, bad input, state-dict layouts, tensor-parallel metadata.

#include <sstream>

#include "modules/grouped_linear_case.h"

using torchmoe::GroupedLinear;
using torchmoe::GroupedLinearOptions;
using torchmoe::ParallelMode;
using namespace torchmoe::test;
using Catch::Matchers::Contains;

TEST_CASE("GroupedLinear CPU accuracy matrix vs float64 reference", "[modules][grouped_linear]") {
  const auto dtype = GENERATE(torch::kFloat32, torch::kFloat64);
  const int64_t groups = GENERATE(1, 3, 6);
  const bool bias = GENERATE(false, true);
  const bool fuse = GENERATE(false, true);
  const bool delay = GENERATE(false, true);
  const auto layout =
      GENERATE(Layout::kDiscrete, Layout::kSingleWeight, Layout::kSingleWeightAndBias);
  // CPU shape (192, 48) -> 80 keeps CI fast; the CUDA matrix runs TE's (2048, 768) -> 3072.
  run_module_case(
      matrix_case(dtype, torch::kCPU, groups, bias, fuse, delay, layout, 192, 7 + groups));
}

TEST_CASE("GroupedLinear CPU at TE's shape (2048x768 -> 3072)", "[modules][grouped_linear]") {
  ModuleCase c =
      matrix_case(torch::kFloat32, torch::kCPU, 3, true, false, false, Layout::kDiscrete, 2048, 3);
  c.in = 768;
  c.out = 3072;
  run_module_case(c);
}

TEST_CASE("GroupedLinear CPU edge shapes", "[modules][grouped_linear]") {
  ModuleCase c;
  c.dtype = torch::kFloat64;
  SECTION("all splits zero, zero rows") { c.splits = {0, 0, 0}; }
  SECTION("all splits zero with fused accumulation keeps main-grad") {
    c.splits = {0, 0};
    c.fuse = true;
  }
  SECTION("odd split sizes 1, 7, 127") { c.splits = {1, 7, 127}; }
  SECTION("one expert holds every row") { c.splits = {0, 50, 0, 0}; }
  SECTION("3-D input [batch, seq, in]") {
    c.splits = {5, 0, 19};
    c.lead_shape = std::vector<int64_t>{4, 6};
  }
  SECTION("1-D input is one row") {
    c.splits = {0, 1};
    c.lead_shape = std::vector<int64_t>{};
  }
  SECTION("m_splits as an integer tensor") {
    c.splits = {3, 9, 0, 4};
    c.splits_as_tensor = true;
  }
  SECTION("odd feature sizes") {
    c.splits = {6, 3};
    c.in = 7;
    c.out = 5;
  }
  run_module_case(c);
}

TEST_CASE("GroupedLinear fused main-grad: first micro-batch overwrites, later ones add",
          "[modules][grouped_linear]") {
  ModuleCase c;
  c.dtype = torch::kFloat32;
  c.splits = {10, 0, 22};
  c.fuse = true;
  c.is_first_microbatch =
      GENERATE(std::optional<bool>{}, std::optional<bool>{true}, std::optional<bool>{false});
  c.delay = GENERATE(false, true);
  c.single_weight = GENERATE(false, true);
  run_module_case(c);
}

TEST_CASE("GroupedLinear delayed wgrad runs FIFO over micro-batches and matches eager",
          "[modules][grouped_linear]") {
  const bool single = GENERATE(false, true);
  torch::manual_seed(5);
  auto opts = GroupedLinearOptions(3, 6, 4)
                  .params_dtype(torch::kFloat64)
                  .single_grouped_weight(single)
                  .single_grouped_bias(single);
  GroupedLinear eager(opts);
  GroupedLinear delayed(GroupedLinearOptions(opts).delay_wgrad_compute(true));
  delayed->load_state_dict({{"weight", torch::stack(eager->expert_weights())},
                            {"bias", torch::stack(eager->expert_biases())}});
  const std::vector<std::vector<int64_t>> micro_splits = {{2, 0, 3}, {1, 4, 0}, {0, 0, 2}};
  for (const auto& splits : micro_splits) {
    const torch::Tensor x = torch::randn({splits[0] + splits[1] + splits[2], 6}, torch::kFloat64);
    eager(x, splits).sin().sum().backward();
    delayed(x, splits).sin().sum().backward();
  }
  REQUIRE(delayed->pending_wgrad_count() == 3);
  for (int i = 0; i < 3; ++i) delayed->backward_dw();
  auto e = eager->named_parameters(), d = delayed->named_parameters();
  for (const auto& item : e) {
    INFO(item.key());
    check_close(d[item.key()].grad(), item.value().grad(), {1e-12, 1e-12}, item.key());
  }
}

TEST_CASE("GroupedLinear finite-difference gradients (float64)", "[modules][grouped_linear]") {
  const bool single = GENERATE(false, true);
  const bool delay = GENERATE(false, true);
  torch::manual_seed(11);
  GroupedLinear m(GroupedLinearOptions(3, 4, 3)
                      .params_dtype(torch::kFloat64)
                      .single_grouped_weight(single)
                      .single_grouped_bias(single)
                      .delay_wgrad_compute(delay));
  {
    torch::NoGradGuard no_grad;
    for (torch::Tensor b : m->expert_biases()) b.uniform_(-1, 1);
  }
  const std::vector<int64_t> splits = {2, 0, 3};
  const torch::Tensor x = torch::randn({5, 4}, torch::kFloat64).requires_grad_(true);
  const torch::Tensor w_out = torch::randn({5, 3}, torch::kFloat64);
  auto loss = [&] { return (m(x, splits).tanh() * w_out).sum(); };
  loss().backward();
  if (delay) m->backward_dw();

  std::vector<std::pair<std::string, torch::Tensor>> leaves = {{"input", x}};
  for (const auto& p : m->named_parameters()) leaves.emplace_back(p.key(), p.value());
  check_finite_differences(loss, leaves);
}

TEST_CASE("GroupedLinear accepts non-contiguous input", "[modules][grouped_linear]") {
  GroupedLinear m(GroupedLinearOptions(2, 8, 5));
  const torch::Tensor base = torch::randn({8, 6});
  const torch::Tensor strided = base.t();  // [6, 8], not contiguous
  REQUIRE_FALSE(strided.is_contiguous());
  const std::vector<int64_t> splits = {4, 2};
  check_close(m(strided, splits), m(strided.contiguous(), splits), {0, 0}, "output");
}

TEST_CASE("GroupedLinear rejects bad input with clear errors",
          "[modules][grouped_linear][errors]") {
  GroupedLinear m(GroupedLinearOptions(3, 8, 4));
  const torch::Tensor x = torch::randn({10, 8});
  SECTION("wrong number of splits") {
    REQUIRE_THROWS_WITH(m(x, std::vector<int64_t>{5, 5}),
                        Contains("m_splits must have num_gemms=3 entries, got 2"));
  }
  SECTION("negative split") {
    REQUIRE_THROWS_WITH(m(x, std::vector<int64_t>{6, -1, 5}),
                        Contains("m_splits[1] must be non-negative, got -1"));
  }
  SECTION("splits that do not sum to the rows") {
    REQUIRE_THROWS_WITH(m(x, std::vector<int64_t>{3, 3, 3}),
                        Contains("GroupedLinear: m_splits must sum to the number of rows (10)") &&
                            Contains("sum 9"));
  }
  SECTION("non-integer split tensor") {
    REQUIRE_THROWS_WITH(m(x, torch::tensor({3.0, 3.0, 4.0})),
                        Contains("m_splits must have an integer dtype, got Float"));
  }
  SECTION("split tensor without data") {
    REQUIRE_THROWS_WITH(
        m(x, torch::empty({3}, torch::TensorOptions(torch::kLong).device(torch::kMeta))),
        Contains("m_splits must be on the CPU or a CUDA device, got meta"));
  }
  SECTION("split tensor of the wrong rank") {
    REQUIRE_THROWS_WITH(m(x, torch::ones({3, 1}, torch::kLong)),
                        Contains("m_splits must be a 1-D tensor, got 2-D"));
  }
  SECTION("input last dim != in_features") {
    REQUIRE_THROWS_WITH(
        m(torch::randn({10, 7}), std::vector<int64_t>{3, 3, 4}),
        Contains("input's last dimension must be in_features=8") && Contains("[10, 7]"));
  }
  SECTION("input dtype != params dtype") {
    REQUIRE_THROWS_WITH(m(x.to(torch::kFloat64), std::vector<int64_t>{3, 3, 4}),
                        Contains("GroupedLinear: input must have the parameters' dtype Float, got "
                                 "Double"));
  }
  SECTION("input on another device than the parameters") {
    REQUIRE_THROWS_WITH(m(torch::empty({10, 8}, torch::kMeta), std::vector<int64_t>{3, 3, 4}),
                        Contains("input must be on the parameters' device cpu, got meta"));
  }
  SECTION("0-d input") {
    REQUIRE_THROWS_WITH(m(torch::tensor(1.0f), std::vector<int64_t>{0, 0, 0}),
                        Contains("got a 0-d tensor"));
  }
  SECTION("backward_dw with delay_wgrad_compute off") {
    REQUIRE_THROWS_WITH(m->backward_dw(), Contains("delay_wgrad_compute is off"));
  }
  SECTION("backward_dw with nothing queued") {
    GroupedLinear d(GroupedLinearOptions(3, 8, 4).delay_wgrad_compute(true));
    REQUIRE_THROWS_WITH(d->backward_dw(), Contains("no weight-gradient computation is queued"));
  }
}

TEST_CASE("GroupedLinear rejects bad main-grad buffers", "[modules][grouped_linear][errors]") {
  GroupedLinear m(GroupedLinearOptions(2, 8, 4).fuse_wgrad_accumulation(true));
  REQUIRE(m->main_grads().size() == 2);
  SECTION("wrong count") {
    REQUIRE_THROWS_WITH(m->set_main_grads({torch::zeros({4, 8})}),
                        Contains("expected 2 buffer(s), got 1"));
  }
  SECTION("wrong shape") {
    REQUIRE_THROWS_WITH(m->set_main_grads({torch::zeros({4, 8}), torch::zeros({8, 4})}),
                        Contains("buffer 1 must have shape [4, 8], got [8, 4]"));
  }
  SECTION("wrong dtype") {
    REQUIRE_THROWS_WITH(
        m->set_main_grads({torch::zeros({4, 8}), torch::zeros({4, 8}, torch::kFloat64)}),
        Contains("buffer 1 must be float32, got Double"));
  }
  SECTION("wrong device") {
    REQUIRE_THROWS_WITH(
        m->set_main_grads({torch::zeros({4, 8}, torch::kMeta), torch::zeros({4, 8})}),
        Contains("buffer 0 must be on cpu, got meta"));
  }
  SECTION("views of one flat buffer are accepted and receive the gradients") {
    const torch::Tensor flat = torch::zeros({2 * 4 * 8});
    m->set_main_grads({flat.narrow(0, 0, 32).view({4, 8}), flat.narrow(0, 32, 32).view({4, 8})});
    m(torch::randn({5, 8}), std::vector<int64_t>{2, 3}).sum().backward();
    CHECK(flat.abs().sum().item<double>() > 0);
  }
  SECTION("without fuse_wgrad_accumulation") {
    GroupedLinear plain(GroupedLinearOptions(2, 8, 4));
    REQUIRE_THROWS_WITH(plain->set_main_grads({}), Contains("fuse_wgrad_accumulation is off"));
  }
}

TEST_CASE("GroupedLinear rejects bad options", "[modules][grouped_linear][errors]") {
  REQUIRE_THROWS_WITH(GroupedLinear(GroupedLinearOptions(0, 8, 4)),
                      Contains("num_gemms must be positive, got 0"));
  REQUIRE_THROWS_WITH(GroupedLinear(GroupedLinearOptions(2, -1, 4)),
                      Contains("in_features must be positive, got -1"));
  REQUIRE_THROWS_WITH(GroupedLinear(GroupedLinearOptions(2, 8, 0)),
                      Contains("out_features must be positive, got 0"));
  REQUIRE_THROWS_WITH(GroupedLinear(GroupedLinearOptions(2, 8, 4).params_dtype(torch::kInt32)),
                      Contains("params_dtype must be a floating dtype other than FP8, got Int"));
  REQUIRE_THROWS_WITH(
      GroupedLinear(GroupedLinearOptions(2, 8, 4).params_dtype(torch::kFloat8_e4m3fn)),
      Contains("params_dtype must be a floating dtype other than FP8, got Float8_e4m3fn"));
  REQUIRE_THROWS_WITH(
      GroupedLinear(
          GroupedLinearOptions(2, 9, 4).bias(false).tp_size(2).parallel_mode(ParallelMode::kRow)),
      Contains("tp_size=2 must divide in_features=9 in row-parallel mode"));
  REQUIRE_THROWS_WITH(
      GroupedLinear(GroupedLinearOptions(2, 8, 5).bias(false).tp_size(2).parallel_mode(
          ParallelMode::kColumn)),
      Contains("tp_size=2 must divide out_features=5 in column-parallel mode"));
  REQUIRE_THROWS_WITH(GroupedLinear(GroupedLinearOptions(2, 8, 4).tp_size(2)),
                      Contains("bias is not supported with tensor parallelism (tp_size=2)"));
  // reset() on a built layer: refused before it drops the parameters it holds.
  GroupedLinear built(GroupedLinearOptions(2, 8, 4).fp8_amax_history_len(2));
  const torch::Tensor w0 = built->expert_weights()[0];
  REQUIRE_THROWS_WITH(built->reset(), Contains("GroupedLinear::reset: the layer is built already"));
  REQUIRE_THROWS_WITH(built->fp8_state()->reset(),
                      Contains("fp8::Fp8State::reset: the state is built already"));
  REQUIRE(built->expert_weights().size() == 2);
  CHECK(built->expert_weights()[0].is_same(w0));
  CHECK(built->fp8_state()
            ->tensors(torchmoe::fp8::TensorRole::kInput)
            .amax_history.is_same(built->fp8_state()->named_buffers()["input_amax_history"]));
  CHECK(built(torch::randn({3, 8}), std::vector<int64_t>{1, 2}).sizes() ==
        torch::IntArrayRef({3, 4}));
}

TEST_CASE("GroupedLinear parameters, init and printing", "[modules][grouped_linear]") {
  SECTION("TE parameter names, discrete") {
    GroupedLinear m(GroupedLinearOptions(3, 8, 4));
    const auto params = m->named_parameters();
    for (const char* name : {"weight0", "weight1", "weight2", "bias0", "bias1", "bias2"}) {
      CHECK(params.contains(name));
    }
    CHECK(params.size() == 6);
    CHECK(params["bias1"].eq(0).all().item<bool>());
    // kaiming_uniform_(a=sqrt(5)) as torch::nn::Linear: bound 1/sqrt(in_features).
    CHECK(params["weight2"].abs().max().item<double>() <= 1.0 / std::sqrt(8.0));
  }
  SECTION("single grouped layout") {
    GroupedLinear m(
        GroupedLinearOptions(3, 8, 4).single_grouped_weight(true).single_grouped_bias(true));
    const auto params = m->named_parameters();
    CHECK(params.size() == 2);
    CHECK(params["weight"].sizes() == torch::IntArrayRef({3, 4, 8}));
    CHECK(params["bias"].sizes() == torch::IntArrayRef({3, 4}));
  }
  SECTION("init_method is called once per expert weight") {
    int calls = 0;
    GroupedLinear m(GroupedLinearOptions(3, 8, 4).single_grouped_weight(true).init_method(
        [&](torch::Tensor& w) {
          CHECK(w.sizes() == torch::IntArrayRef({4, 8}));
          w.fill_(++calls);
        }));
    CHECK(calls == 3);
    CHECK(m->named_parameters()["weight"][2].eq(3).all().item<bool>());
  }
  SECTION("pretty_print") {
    std::ostringstream s;
    s << GroupedLinear(GroupedLinearOptions(6, 768, 3072).bias(false));
    CHECK(s.str() ==
          "torchmoe::GroupedLinear(num_gemms=6, in_features=768, out_features=3072, "
          "bias=false)");
  }
  SECTION("discrete weights: parameters of their own over one allocation, 16-byte spaced") {
    // 3 x 5 weights: 15 elements, 60 bytes in float32 and 30 in bf16, so each slot is rounded up
    // (64 and 32 bytes; float64's 120 to 128).
    const auto dtype = GENERATE(torch::kFloat32, torch::kBFloat16);
    GroupedLinear m(GroupedLinearOptions(3, 5, 3).bias(false).params_dtype(dtype));
    const std::vector<torch::Tensor> w = m->expert_weights();
    const auto check_packed = [](const std::vector<torch::Tensor>& ws, uintptr_t slot_bytes) {
      const auto address = [](const torch::Tensor& t) {
        return reinterpret_cast<uintptr_t>(t.const_data_ptr());
      };
      for (size_t g = 0; g < ws.size(); ++g) {
        CHECK(address(ws[g]) == address(ws[0]) + g * slot_bytes);
        CHECK(address(ws[g]) % 16 == 0);
        CHECK(ws[g].storage().is_alias_of(ws[0].storage()));
        CHECK((ws[g].is_leaf() && ws[g].requires_grad() && ws[g].is_contiguous()));
        CHECK(ws[g].sizes() == torch::IntArrayRef({3, 5}));
      }
    };
    check_packed(w, dtype == torch::kBFloat16 ? 32 : 64);
    const int64_t version0 = w[0]._version(), version1 = w[1]._version();
    const torch::Tensor before = w[0].clone();
    {
      torch::NoGradGuard no_grad;
      w[1].fill_(3);
    }
    CHECK(w[1]._version() == version1 + 1);
    CHECK(w[0]._version() == version0);
    CHECK(w[0].equal(before));
    CHECK(w[2].ne(3).any().item<bool>());
    // to() and clone() keep the layout (LibTorch's own give each weight a storage of its own),
    // the values and the parameters themselves.
    const std::vector<torch::Tensor> values = {w[0].clone(), w[1].clone(), w[2].clone()};
    auto copy = std::dynamic_pointer_cast<torchmoe::GroupedLinearImpl>(m->clone());
    REQUIRE(copy);
    check_packed(copy->expert_weights(), dtype == torch::kBFloat16 ? 32 : 64);
    m->to(torch::kFloat64);
    check_packed(m->expert_weights(), 128);
    for (int g = 0; g < 3; ++g) {
      CHECK(m->expert_weights()[g].is_same(w[g]));
      CHECK(m->expert_weights()[g].equal(values[g].to(torch::kFloat64)));
      CHECK(copy->expert_weights()[g].equal(values[g]));
    }
  }
  SECTION("clone is independent") {
    GroupedLinear m(GroupedLinearOptions(2, 4, 3));
    auto copy = std::dynamic_pointer_cast<torchmoe::GroupedLinearImpl>(m->clone());
    REQUIRE(copy);
    torch::NoGradGuard no_grad;
    copy->named_parameters()["weight0"].fill_(7);
    CHECK_FALSE(m->named_parameters()["weight0"].eq(7).all().item<bool>());
  }
}

TEST_CASE("GroupedLinear state dict converts between layouts", "[modules][grouped_linear]") {
  auto discrete_opts = GroupedLinearOptions(3, 6, 5);
  auto grouped_opts =
      GroupedLinearOptions(3, 6, 5).single_grouped_weight(true).single_grouped_bias(true);
  const bool from_discrete = GENERATE(true, false);
  GroupedLinear source(from_discrete ? discrete_opts : grouped_opts);
  GroupedLinear target(from_discrete ? grouped_opts : discrete_opts);
  {
    torch::NoGradGuard no_grad;
    for (torch::Tensor b : source->expert_biases()) b.uniform_(-1, 1);
  }
  SECTION("torch::save / torch::load") {
    std::stringstream stream;
    torch::save(source, stream);
    torch::load(target, stream);
  }
  SECTION("load_state_dict from named parameters") {
    std::unordered_map<std::string, torch::Tensor> state;
    for (const auto& p : source->named_parameters()) state[p.key()] = p.value();
    target->load_state_dict(state);
  }
  for (int g = 0; g < 3; ++g) {
    CHECK(target->expert_weights()[g].equal(source->expert_weights()[g]));
    CHECK(target->expert_biases()[g].equal(source->expert_biases()[g]));
  }
  const torch::Tensor x = torch::randn({7, 6});
  const std::vector<int64_t> splits = {2, 5, 0};
  check_close(target(x, splits), source(x, splits), {0, 0}, "output after load");
}

TEST_CASE("GroupedLinear load_state_dict rejects incomplete or foreign state",
          "[modules][grouped_linear][errors]") {
  GroupedLinear m(GroupedLinearOptions(2, 4, 3));
  std::unordered_map<std::string, torch::Tensor> state = {{"weight0", torch::zeros({3, 4})},
                                                          {"bias0", torch::zeros({3})},
                                                          {"bias1", torch::zeros({3})}};
  REQUIRE_THROWS_WITH(m->load_state_dict(state), Contains("missing 'weight1'"));
  state["weight1"] = torch::zeros({4, 3});
  REQUIRE_THROWS_WITH(m->load_state_dict(state),
                      Contains("weight of expert 1 must have shape [3, 4], got [4, 3]"));
  state["weight1"] = torch::zeros({3, 4});
  state["extra"] = torch::zeros({1});
  REQUIRE_THROWS_WITH(m->load_state_dict(state), Contains("unexpected key 'extra'"));
  // A refused state changes nothing: the shapes are all checked first, the FP8 state's included.
  const torch::Tensor weight0 = m->expert_weights()[0].clone();
  state.erase("extra");
  state["bias1"] = torch::zeros({2});
  REQUIRE_THROWS_WITH(m->load_state_dict(state),
                      Contains("bias of expert 1 must have shape [3], got [2]"));
  CHECK(torch::equal(m->expert_weights()[0], weight0));
  GroupedLinear with_fp8(GroupedLinearOptions(2, 4, 3).fp8_amax_history_len(4));
  const torch::Tensor fp8_weight0 = with_fp8->expert_weights()[0].clone();
  state["bias1"] = torch::zeros({3});
  state["fp8_state.input_amax_history"] = torch::zeros({16, 2});
  REQUIRE_THROWS_WITH(with_fp8->load_state_dict(state),
                      Contains("'fp8_state.input_amax_history' must have shape [4, 2]"));
  CHECK(torch::equal(with_fp8->expert_weights()[0], fp8_weight0));
  // Integers would be converted without a word; a meta tensor would fail after weight0 is copied.
  state.erase("fp8_state.input_amax_history");
  state["weight1"] = torch::zeros({3, 4}, torch::kLong);
  REQUIRE_THROWS_WITH(m->load_state_dict(state),
                      Contains("weight of expert 1 must be a floating strided tensor with data, "
                               "got Long"));
  state["weight0"] = torch::ones({3, 4});
  state["weight1"] = torch::zeros({3, 4}, torch::kMeta);
  REQUIRE_THROWS_WITH(m->load_state_dict(state), Contains("on meta"));
  CHECK(torch::equal(m->expert_weights()[0], weight0));
  // An archive of more experts than the layer's: it would load its first two, truncated.
  GroupedLinear three(GroupedLinearOptions(3, 4, 3));
  std::stringstream archive;
  torch::save(three, archive);
  REQUIRE_THROWS_WITH(torch::load(m, archive),
                      Contains("GroupedLinear::load: the archive has 'weight2', so more experts "
                               "than the layer's num_gemms (2)"));
}

TEST_CASE("GroupedLinear tensor-parallel metadata", "[modules][grouped_linear]") {
  SECTION("row parallel") {
    GroupedLinear m(
        GroupedLinearOptions(2, 8, 6).bias(false).tp_size(2).parallel_mode(ParallelMode::kRow));
    CHECK(m->in_features_per_partition == 4);
    CHECK(m->out_features_per_partition == 6);
    CHECK(m->named_parameters()["weight1"].sizes() == torch::IntArrayRef({6, 4}));
    const auto a = m->tensor_parallel_attributes("weight1");
    CHECK(a.is_parallel);
    CHECK(a.partition_dim == 1);
    CHECK(a.partition_stride == 1);
    const torch::Tensor y = m(torch::randn({3, 4}), std::vector<int64_t>{1, 2});
    CHECK(y.sizes() == torch::IntArrayRef({3, 6}));
  }
  SECTION("row parallel, grouped weight: partition dim 2 of [G, out, in]") {
    GroupedLinear m(GroupedLinearOptions(2, 8, 6)
                        .bias(false)
                        .tp_size(2)
                        .single_grouped_weight(true)
                        .parallel_mode(ParallelMode::kRow));
    CHECK(m->tensor_parallel_attributes("weight").partition_dim == 2);
  }
  SECTION("column parallel") {
    GroupedLinear m(
        GroupedLinearOptions(2, 8, 6).bias(false).tp_size(3).parallel_mode(ParallelMode::kColumn));
    CHECK(m->out_features_per_partition == 2);
    CHECK(m->tensor_parallel_attributes("weight0").partition_dim == 0);
    GroupedLinear g(GroupedLinearOptions(2, 8, 6)
                        .bias(false)
                        .tp_size(3)
                        .single_grouped_weight(true)
                        .parallel_mode(ParallelMode::kColumn));
    CHECK(g->tensor_parallel_attributes("weight").partition_dim == 1);
  }
  SECTION("column-parallel bias (tp_size 1)") {
    GroupedLinear m(GroupedLinearOptions(2, 8, 6).parallel_mode(ParallelMode::kColumn));
    const auto a = m->tensor_parallel_attributes("bias1");
    CHECK(a.is_parallel);
    CHECK(a.partition_dim == 0);
  }
  SECTION("unknown parameter") {
    GroupedLinear m(GroupedLinearOptions(2, 8, 6));
    REQUIRE_THROWS_WITH(m->tensor_parallel_attributes("weight9"),
                        Contains("no parameter named 'weight9'"));
  }
}

TEST_CASE("GroupedLinear CPU 16-bit dtypes", "[modules][grouped_linear]") {
  ModuleCase c;
  c.dtype = GENERATE(torch::kBFloat16, torch::kFloat16);
  c.splits = {40, 0, 23};
  c.fuse = GENERATE(false, true);
  run_module_case(c);
}

TEST_CASE("GroupedLinear follows ->to(dtype) as torch::nn::Linear does",
          "[modules][grouped_linear]") {
  const bool fuse = GENERATE(false, true);
  const bool single = GENERATE(false, true);
  INFO("fuse=" << fuse << " single=" << single);
  GroupedLinear m(GroupedLinearOptions(2, 4, 3)
                      .fuse_wgrad_accumulation(fuse)
                      .single_grouped_weight(single)
                      .single_grouped_bias(single));
  m->to(torch::kFloat64);
  const torch::Tensor x = torch::randn({5, 4}, torch::kFloat64).requires_grad_(true);
  const std::vector<int64_t> splits = {2, 3};
  const torch::Tensor y = m(x, splits);
  CHECK(y.scalar_type() == torch::kFloat64);
  const torch::Tensor dy = torch::randn({5, 3}, torch::kFloat64);
  y.backward(dy);
  const Reference ref =
      reference_grouped_linear(x, splits, m->expert_weights(), m->expert_biases(), dy);
  check_close(y, ref.output, tolerance_for(torch::kFloat64), "output");
  check_close(x.grad(), ref.grad_input, tolerance_for(torch::kFloat64), "grad_input");
  if (fuse) {
    // Main-grad buffers stay float32 (one rounding of the float64 product).
    std::vector<torch::Tensor> main = m->main_grads();
    if (single) main = main[0].unbind(0);
    for (size_t g = 0; g < 2; ++g) {
      CHECK(main[g].scalar_type() == torch::kFloat32);
      check_close(main[g], ref.grad_weights[g], tolerance_for(torch::kFloat32), "main_grad");
    }
  }
  // A float input is now the wrong dtype, and the message names the parameters' dtype.
  REQUIRE_THROWS_WITH(m(torch::randn({5, 4}), splits),
                      Contains("GroupedLinear: input must have the parameters' dtype Double, got "
                               "Float"));
}

TEST_CASE("GroupedLinear backward refuses weights modified in place after forward",
          "[modules][grouped_linear][errors]") {
  const bool single = GENERATE(false, true);
  INFO("single=" << single);
  GroupedLinear m(GroupedLinearOptions(2, 4, 3).single_grouped_weight(single));
  const torch::Tensor x = torch::randn({5, 4}).requires_grad_(true);
  const torch::Tensor y = m(x, std::vector<int64_t>{2, 3});
  {
    torch::NoGradGuard no_grad;
    m->expert_weights()[1].mul_(2);  // an optimizer step between forward and backward
  }
  REQUIRE_THROWS_WITH(y.sum().backward(), Contains("GroupedLinear backward: weight ") &&
                                              Contains("was modified in place after the forward"));
}

TEST_CASE("GroupedLinear without a gradient to compute runs no autograd node",
          "[modules][grouped_linear]") {
  GroupedLinear m(GroupedLinearOptions(3, 6, 5));
  const torch::Tensor x = torch::randn({9, 6});
  const std::vector<int64_t> splits = {4, 0, 5};
  const torch::Tensor with_graph = m(x, splits);
  REQUIRE(with_graph.grad_fn() != nullptr);  // the parameters require gradients
  torch::Tensor without;
  {
    torch::NoGradGuard no_grad;
    without = m(x, splits);
  }
  CHECK(without.grad_fn() == nullptr);
  CHECK_FALSE(without.requires_grad());
  CHECK(torch::equal(without, with_graph.detach()));
}

// The layer keeps its calls' autograd edges to its G weights and biases (one fan-out node each)
// across calls; each case changes what those edges must follow and checks the gradients.
TEST_CASE("GroupedLinear's kept autograd edges follow its parameters",
          "[modules][grouped_linear]") {
  torch::manual_seed(11);
  const auto f64 = torch::kFloat64;
  GroupedLinear m(GroupedLinearOptions(3, 4, 2).params_dtype(f64));
  const std::vector<int64_t> splits = {2, 0, 3};
  const torch::Tensor x = torch::randn({5, 4}, f64);
  const torch::Tensor dy = torch::randn({5, 2}, f64);
  const auto reference = [&] {
    return reference_grouped_linear(x, splits, m->expert_weights(), m->expert_biases(), dy);
  };
  const auto zero_grads = [&] {
    for (torch::Tensor p : m->parameters()) p.mutable_grad() = torch::Tensor();
  };
  const auto tol = tolerance_for(f64);

  SECTION("calls in turn and in one graph accumulate") {
    m(x, splits).backward(dy);
    m(x, splits).backward(dy);
    (m(x, splits) + m(x, splits)).backward(dy);
    const Reference ref = reference();
    for (size_t g = 0; g < 3; ++g) {
      check_close(m->expert_weights()[g].grad(), 4 * ref.grad_weights[g], tol, "dW");
      check_close(m->expert_biases()[g].grad(), 4 * ref.grad_biases[g], tol, "db");
    }
  }
  SECTION("a frozen weight gets no gradient, and one again when unfrozen") {
    m(x, splits).backward(dy);  // edges kept with every weight requiring a gradient
    zero_grads();
    m->expert_weights()[1].requires_grad_(false);
    m(x, splits).backward(dy);
    const Reference ref = reference();
    CHECK_FALSE(m->expert_weights()[1].grad().defined());
    check_close(m->expert_weights()[0].grad(), ref.grad_weights[0], tol, "dW0");
    check_close(m->expert_weights()[2].grad(), ref.grad_weights[2], tol, "dW2");
    m->expert_weights()[1].requires_grad_(true);
    m(x, splits).backward(dy);
    check_close(m->expert_weights()[1].grad(), ref.grad_weights[1], tol, "dW1");
  }
  SECTION("->to(dtype) gives the parameters new accumulators") {
    m->to(torch::kFloat32);
    m(x.to(torch::kFloat32), splits).backward(dy.to(torch::kFloat32));
    m->to(f64);
    zero_grads();
    m(x, splits).backward(dy);
    const Reference ref = reference();
    for (size_t g = 0; g < 3; ++g) {
      REQUIRE(m->expert_weights()[g].grad().scalar_type() == f64);
      check_close(m->expert_weights()[g].grad(), ref.grad_weights[g], tol, "dW");
    }
  }
  SECTION("autograd::grad takes one weight's gradient through the fan-out") {
    m(x, splits).backward(dy);
    zero_grads();
    const torch::Tensor y = m(x, splits);
    const torch::Tensor w2 = m->expert_weights()[2];
    const std::vector<torch::Tensor> grads = torch::autograd::grad({y}, {w2}, {dy});
    check_close(grads[0], reference().grad_weights[2], tol, "dW2");
    CHECK_FALSE(w2.grad().defined());
  }
  SECTION("a retained graph runs twice; a freed one is refused") {
    const torch::Tensor retained = m(x, splits);
    retained.backward(dy, /*retain_graph=*/true);
    retained.backward(dy);
    for (size_t g = 0; g < 3; ++g) {
      check_close(m->expert_weights()[g].grad(), 2 * reference().grad_weights[g], tol, "dW");
    }
    const torch::Tensor y = m(x, splits);
    y.backward(dy);
    REQUIRE_THROWS_WITH(y.backward(dy),
                        Contains("GroupedLinear backward: trying to backward through the graph a "
                                 "second time"));
  }
}

// Only what the backward asks for is computed: autograd::grad of the input runs no weight-gradient
// GEMM, which with fused main-grad buffers would add into them and with delayed wgrad would queue.
TEST_CASE("GroupedLinear computes only the gradients autograd::grad asks for",
          "[modules][grouped_linear]") {
  torch::manual_seed(12);
  const auto f64 = torch::kFloat64;
  const bool fuse = GENERATE(false, true);
  INFO("fuse_wgrad_accumulation=" << fuse << " (else delay_wgrad_compute)");
  GroupedLinear m(GroupedLinearOptions(3, 4, 2)
                      .params_dtype(f64)
                      .fuse_wgrad_accumulation(fuse)
                      .delay_wgrad_compute(!fuse));
  const std::vector<int64_t> splits = {2, 0, 3};
  const torch::Tensor x = torch::randn({5, 4}, f64).requires_grad_(true);
  const torch::Tensor dy = torch::randn({5, 2}, f64);
  const torch::Tensor y = m(x, splits);
  const std::vector<torch::Tensor> dx = torch::autograd::grad({y}, {x}, {dy});
  const Reference ref =
      reference_grouped_linear(x, splits, m->expert_weights(), m->expert_biases(), dy);
  check_close(dx[0], ref.grad_input, tolerance_for(f64), "dx");
  if (fuse) {
    for (const torch::Tensor& main : m->main_grads()) CHECK(torch::all(main == 0).item<bool>());
  } else {
    CHECK(m->pending_wgrad_count() == 0);
  }
  for (const torch::Tensor& w : m->expert_weights()) CHECK_FALSE(w.grad().defined());
}

namespace {

// Hands its input no gradient: the function before it then receives an undefined one.
struct NoInputGradient : torch::autograd::Function<NoInputGradient> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    return {torch::Tensor()};
  }
};

}  // namespace

TEST_CASE("GroupedLinear backward takes an undefined output gradient as zeros",
          "[modules][grouped_linear]") {
  GroupedLinear m(GroupedLinearOptions(2, 4, 3).params_dtype(torch::kFloat64));
  const torch::Tensor x = torch::randn({5, 4}, torch::kFloat64).requires_grad_(true);
  const torch::Tensor y = NoInputGradient::apply(m(x, std::vector<int64_t>{2, 3}));
  (y.sum() + (x * 0).sum()).backward();  // x's second use makes its gradient defined either way
  CHECK(torch::all(x.grad() == 0).item<bool>());
  for (const torch::Tensor& w : m->expert_weights()) {
    REQUIRE(w.grad().defined());  // the layer's backward ran
    CHECK(torch::all(w.grad() == 0).item<bool>());
  }
}
