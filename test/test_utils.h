#pragma once
// Shared test helpers: an independent float64 reference for grouped linear (per-group at::linear
// under autograd), dtype tolerances, comparisons that report where they fail, the CUDA skip, and
// the FP8 guard of a step that runs under a recipe or in 16 bits.

#include <ATen/cuda/CUDAContext.h>
#include <torch/torch.h>
#include <torchmoe/fp8/autocast.h>
#include <torchmoe/ops/types.h>
#include <catch2/catch.hpp>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace torchmoe::test {

inline bool cuda_available() { return torch::cuda::is_available(); }

// CUDA cases skip visibly; ctest turns this line into a "Skipped" result.
#define TORCHMOE_REQUIRE_CUDA()                \
  do {                                         \
    if (!::torchmoe::test::cuda_available()) { \
      WARN("SKIPPED: no CUDA device");         \
      return;                                  \
    }                                          \
  } while (0)

// A case generated on the CPU and on CUDA (`cuda` the generated flag): the CUDA run returns with a
// warning when there is no GPU, which does not mark the test skipped (its CPU run counts).
#define TORCHMOE_RETURN_IF_NO_GPU_FOR(cuda)                     \
  do {                                                          \
    if ((cuda) && !::torchmoe::test::cuda_available()) {        \
      WARN("no CUDA device: this case's CUDA run is left out"); \
      return;                                                   \
    }                                                           \
  } while (0)

// An sm_90 GPU (H100/H200), where the sm90 grouped GEMM kernel runs.
inline bool sm90_available() {
  if (!cuda_available()) return false;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major == 9 && prop->minor == 0;
}

// sm90-only cases skip visibly elsewhere; the line also matches ctest's skip pattern.
#define TORCHMOE_REQUIRE_SM90()                         \
  do {                                                  \
    TORCHMOE_REQUIRE_CUDA();                            \
    if (!::torchmoe::test::sm90_available()) {          \
      WARN("SKIPPED: no CUDA device with sm_90 found"); \
      return;                                           \
    }                                                   \
  } while (0)

// Why the forced grouped GEMM `backend` cannot run bf16 layers of n, k multiples of 8 here, or
// empty: cases that force a CUDA backend skip visibly with it.
inline std::string gemm_backend_skip_reason(torchmoe::GemmBackend backend) {
  if (!cuda_available()) return "no CUDA device";
  switch (backend) {
    case torchmoe::GemmBackend::kSm90:
      return sm90_available() ? "" : "no CUDA device with sm_90 found";
    case torchmoe::GemmBackend::kCublasLtGrouped: {
      const torchmoe::LoadedCublasLt lt = torchmoe::loaded_cublaslt();
      if (!lt.grouped) {
        return "the loaded cuBLASLt " + std::to_string(lt.version) +
               " has no grouped matmul (needs 130800 or newer)";
      }
      return at::cuda::getCurrentDeviceProperties()->major >= 9 ? "" : "device older than sm_90";
    }
    default:
      return "";
  }
}

#define TORCHMOE_REQUIRE_GEMM_BACKEND(backend)                                              \
  do {                                                                                      \
    const std::string torchmoe_skip_ = ::torchmoe::test::gemm_backend_skip_reason(backend); \
    if (!torchmoe_skip_.empty()) {                                                          \
      WARN("SKIPPED: " << torchmoe_skip_);                                                  \
      return;                                                                               \
    }                                                                                       \
  } while (0)

struct Tolerance {
  double rtol;
  double atol;
};

// TransformerEngine's grouped-linear tolerances against a float64 reference (fp32 with TF32 off).
inline Tolerance tolerance_for(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kFloat64:
      return {1e-10, 1e-10};
    case torch::kFloat32:
      return {1.3e-6, 1e-5};
    case torch::kFloat16:
      return {1e-3, 1e-5};
    case torch::kBFloat16:
      return {1.6e-2, 1e-5};
    default:
      FAIL("no tolerance for dtype " << dtype);
      return {0, 0};
  }
}

// A step's recipe, or none: 16 bits.
using MaybeRecipe = std::optional<fp8::Recipe>;

// While the returned guard lives: FP8 under `recipe` when there is one and `enabled`, else off.
inline fp8::Autocast autocast_for(const MaybeRecipe& recipe, bool enabled = true) {
  if (recipe && enabled) return fp8::Autocast(*recipe);
  return fp8::Autocast(false);
}

// Elementwise |actual - expected| <= atol + rtol * |expected|, no NaN; reports the worst element.
inline void check_close(const torch::Tensor& actual, const torch::Tensor& expected, Tolerance tol,
                        const std::string& what) {
  INFO(what);
  REQUIRE(actual.defined());
  REQUIRE(actual.sizes() == expected.sizes());
  const torch::Tensor a = actual.detach().to(torch::kCPU, torch::kFloat64);
  const torch::Tensor e = expected.detach().to(torch::kCPU, torch::kFloat64);
  REQUIRE_FALSE(a.isnan().any().item<bool>());
  if (a.numel() == 0) return;
  const torch::Tensor excess = (a - e).abs() - (tol.atol + tol.rtol * e.abs());
  const int64_t worst = excess.flatten().argmax().item<int64_t>();
  const double worst_excess = excess.flatten()[worst].item<double>();
  INFO("worst element " << worst << ": actual " << a.flatten()[worst].item<double>()
                        << ", expected " << e.flatten()[worst].item<double>() << " (rtol "
                        << tol.rtol << ", atol " << tol.atol << ")");
  CHECK(worst_excess <= 0.0);
}

// Random split sizes summing to `rows`, with split `zero_at` forced empty (unless < 0).
inline std::vector<int64_t> random_splits(int64_t groups, int64_t rows, int64_t zero_at,
                                          uint64_t seed) {
  std::vector<int64_t> splits(groups, 0);
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> eligible;
  for (int64_t g = 0; g < groups; ++g) {
    if (g != zero_at) eligible.push_back(g);
  }
  if (eligible.empty()) return splits;  // one group, forced empty: only valid when rows == 0
  const torch::Tensor picks =
      torch::randint(static_cast<int64_t>(eligible.size()), {rows}, gen, torch::kLong);
  for (int64_t r = 0; r < rows; ++r) ++splits[eligible[picks[r].item<int64_t>()]];
  return splits;
}

struct Reference {
  torch::Tensor output, grad_input;
  std::vector<torch::Tensor> grad_weights, grad_biases;
};

// float64 per-group at::linear, differentiated by autograd with upstream gradient grad_output.
inline Reference reference_grouped_linear(const torch::Tensor& input,
                                          const std::vector<int64_t>& splits,
                                          const std::vector<torch::Tensor>& weights,
                                          const std::vector<torch::Tensor>& biases,
                                          const torch::Tensor& grad_output) {
  torch::AutoGradMode enable(true);
  const int64_t in = weights[0].size(1), out = weights[0].size(0);
  auto leaf = [](const torch::Tensor& t) {
    return t.detach().to(torch::kFloat64).requires_grad_(true);
  };
  const torch::Tensor x = leaf(input.reshape({-1, in}));
  std::vector<torch::Tensor> w, b, pieces;
  int64_t offset = 0;
  for (size_t g = 0; g < weights.size(); ++g) {
    w.push_back(leaf(weights[g]));
    b.push_back(biases.empty() ? torch::Tensor() : leaf(biases[g]));
    pieces.push_back(torch::linear(x.narrow(0, offset, splits[g]), w[g], b[g]));
    offset += splits[g];
  }
  const torch::Tensor y = torch::cat(pieces, 0);
  const torch::Tensor dy = grad_output.detach().to(torch::kFloat64).reshape({-1, out});
  (y * dy).sum().backward();
  Reference ref;
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape.back() = out;
  ref.output = y.detach().reshape(out_shape);
  ref.grad_input = x.grad().reshape(input.sizes());
  for (size_t g = 0; g < weights.size(); ++g) {
    ref.grad_weights.push_back(w[g].grad().defined() ? w[g].grad() : torch::zeros_like(w[g]));
    if (!biases.empty()) {
      ref.grad_biases.push_back(b[g].grad().defined() ? b[g].grad() : torch::zeros_like(b[g]));
    }
  }
  return ref;
}

// Compares each leaf's .grad (already computed by the caller's backward) with central finite
// differences of `loss` (a float64 scalar function of the leaves), element by element.
template <typename Loss>
void check_finite_differences(Loss&& loss,
                              const std::vector<std::pair<std::string, torch::Tensor>>& leaves,
                              double eps = 1e-6, double rtol = 1e-6, double atol = 1e-8) {
  torch::NoGradGuard no_grad;
  for (const auto& [name, leaf] : leaves) {
    INFO(name);
    REQUIRE(leaf.grad().defined());
    const torch::Tensor flat = leaf.view(-1);
    const torch::Tensor analytic = leaf.grad().reshape(-1);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double saved = flat[i].item<double>();
      flat[i].fill_(saved + eps);
      const double plus = loss().template item<double>();
      flat[i].fill_(saved - eps);
      const double minus = loss().template item<double>();
      flat[i].fill_(saved);
      const double numeric = (plus - minus) / (2 * eps);
      INFO("element " << i);
      CHECK(analytic[i].item<double>() == Approx(numeric).epsilon(rtol).margin(atol));
    }
  }
}

}  // namespace torchmoe::test
