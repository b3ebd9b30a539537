// The one decision of a grouped GEMM layer call (ops/grouped_gemm.h, plan_grouped_gemms): which
// backend runs each product, for 16-bit and FP8 products, and the split sizes every GEMM of the
// call reads.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/ops/grouped_gemm.h"
#include "torchmoe/ops/grouped_gemm_backends.h"

namespace torchmoe::ops {
namespace {

using detail::backend_name;
using detail::check_host_splits;

// Device sizes can only be checked for what the host knows without a copy.
void check_device_splits(const char* op, const at::Tensor& m_splits, const at::Tensor& input) {
  TORCH_CHECK(m_splits.device() == input.device(), op, ": m_splits must be on ", input.device(),
              " like the input, or on the host, got ", m_splits.device());
}

GemmBackend env_backend_choice() {
  static const GemmBackend choice = [] {
    const char* env = std::getenv("TORCHMOE_GROUPED_GEMM_BACKEND");
    if (env == nullptr || std::strcmp(env, "auto") == 0) return GemmBackend::kAuto;
    if (std::strcmp(env, "cublaslt") == 0) return GemmBackend::kCublasLt;
    if (std::strcmp(env, "sm90") == 0) return GemmBackend::kSm90;
    if (std::strcmp(env, "cublaslt_grouped") == 0) return GemmBackend::kCublasLtGrouped;
    TORCH_CHECK(false,
                "TORCHMOE_GROUPED_GEMM_BACKEND must be auto, cublaslt, sm90 or cublaslt_grouped, "
                "got '",
                env, "'");
  }();
  return choice;
}

// Why a CUDA backend cannot run this bf16/fp16/fp32 call, or nullptr.
const char* refusal(GemmBackend backend, const at::Tensor& input, const GemmShape& shape,
                    int64_t rows) {
  switch (backend) {
    case GemmBackend::kSm90:
      return detail::sm90_refusal(input, shape, rows);
    case GemmBackend::kCublasLtGrouped:
      return detail::cublaslt_grouped_refusal(input, shape, rows);
    case GemmBackend::kCublasLt:
      return nullptr;
    case GemmBackend::kReference:
      return "it runs CPU tensors only";
    case GemmBackend::kAuto:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "refusal: kAuto is a choice, not a backend");
}

// kAuto's candidates per product (indexed by GemmKind: fprop, dgrad, wgrad) for bf16/fp16,
// fastest first, from bench_grouped_linear on the H100 (docs/performance.md, "cuBLASLt grouped
// matmul and kAuto's choice"): the sm90 kernel and the cuBLASLt grouped matmul are level on GPU
// time (sm90 / grouped geomean fprop 1.01, dgrad 1.02, wgrad 0.99, each product ahead or behind by
// up to 10% with the shape and the skew of the splits, which planning does not see), and the
// grouped matmul costs ~30-60 us of host time per call against ~10, which a GroupedMLP of small
// experts does not hide (moe-lm step 1.58 ms vs 0.88). So sm90 leads; the grouped matmul takes what
// sm90 refuses (more than 1024 groups; devices newer than sm_90).
constexpr GemmBackend kAutoOrder16[3][3] = {
    {GemmBackend::kSm90, GemmBackend::kCublasLtGrouped, GemmBackend::kCublasLt},
    {GemmBackend::kSm90, GemmBackend::kCublasLtGrouped, GemmBackend::kCublasLt},
    {GemmBackend::kSm90, GemmBackend::kCublasLtGrouped, GemmBackend::kCublasLt},
};

struct ProductBackends {
  GemmBackend fprop, dgrad, wgrad;
};

// kAuto's backends: per product the first candidate that takes the call. A refusal depends on
// the call, not the product, so each candidate is asked once (sm90's asks the CUDA runtime).
ProductBackends auto_backends(const at::Tensor& input, const GemmShape& shape, int64_t rows) {
  if (input.scalar_type() == at::kFloat) {
    return {GemmBackend::kCublasLt, GemmBackend::kCublasLt, GemmBackend::kCublasLt};
  }
  std::optional<bool> takes[static_cast<int>(GemmBackend::kReference) + 1];
  auto first = [&](kernels::GemmKind kind) {
    for (GemmBackend candidate : kAutoOrder16[static_cast<int>(kind)]) {
      std::optional<bool>& t = takes[static_cast<int>(candidate)];
      if (!t) t = refusal(candidate, input, shape, rows) == nullptr;
      if (*t) return candidate;
    }
    TORCH_INTERNAL_ASSERT(false, "kAuto: per-group cuBLASLt refused a call");
  };
  return {first(kernels::GemmKind::kFprop), first(kernels::GemmKind::kDgrad),
          first(kernels::GemmKind::kWgrad)};
}

// kAuto's FP8 threshold: experts of at least this many weight elements run per group when host
// sizes are at hand (see select_fp8_backends).
constexpr int64_t kFp8LargeExpert = int64_t{1} << 24;

// One FP8 product's operands as the plan's options quantize them: A (activations or gradients)
// and B (the weights, or the input in wgrad), and how many block scales each copy it reads holds.
struct Fp8Operands {
  const SplitQuantizeOptions& a;
  const SplitQuantizeOptions& b;
  int64_t a_scales = 0, b_scales = 0;
};

Fp8Operands fp8_operands(kernels::GemmKind kind, const Fp8GemmOptions& o, const GemmShape& shape,
                         int64_t rows) {
  using kernels::columnwise_block_scales;
  using kernels::rowwise_block_scales;
  const auto groups = static_cast<int64_t>(shape.groups);
  const int64_t weight_rows = groups * shape.n;
  auto count = [&](const SplitQuantizeOptions& q, bool rowwise, int64_t r, int64_t k) {
    if (!kernels::is_block_scaling(q.scaling)) return groups;
    return rowwise ? rowwise_block_scales(q.scaling, r, k, groups)
                   : columnwise_block_scales(q.scaling, r, k, groups);
  };
  switch (kind) {
    case kernels::GemmKind::kFprop:
      return {o.input, o.weight, count(o.input, true, rows, shape.k),
              count(o.weight, true, weight_rows, shape.k)};
    case kernels::GemmKind::kDgrad:
      return {o.grad_output, o.weight, count(o.grad_output, true, rows, shape.n),
              count(o.weight, false, weight_rows, shape.k)};
    case kernels::GemmKind::kWgrad:
      return {o.grad_output, o.input, count(o.grad_output, false, rows, shape.n),
              count(o.input, false, rows, shape.k)};
  }
  TORCH_INTERNAL_ASSERT(false, "fp8_operands: unknown GemmKind");
}

// Whether a device-split backend takes one FP8 product's operands. The sm90 kernel takes an e4m3
// B operand (every recipe's weights and wgrad input), per-tensor scales, or BlockScaling's default
// blocks (a 1x128 A with 128x128 weights in fprop and dgrad, with a 1x128 input in wgrad) whose
// scale offsets fit its 32-bit arithmetic; the grouped matmul takes per-tensor scales. A product
// that neither takes runs per group (kCublasLt).
bool takes_fp8_operands(GemmBackend backend, kernels::GemmKind kind, const Fp8Operands& p) {
  using kernels::is_block_scaling;
  const bool per_tensor = !is_block_scaling(p.a.scaling) && !is_block_scaling(p.b.scaling);
  if (backend == GemmBackend::kCublasLtGrouped) return per_tensor;
  if (backend != GemmBackend::kSm90) return backend == GemmBackend::kCublasLt;
  constexpr int64_t kMaxOffset = std::numeric_limits<int32_t>::max();
  const QuantizeScaling b_blocks = kind == kernels::GemmKind::kWgrad
                                       ? QuantizeScaling::kBlock1x128
                                       : QuantizeScaling::kBlock128x128;
  const bool blocks = p.a.scaling == QuantizeScaling::kBlock1x128 && p.b.scaling == b_blocks &&
                      p.a_scales <= kMaxOffset && p.b_scales <= kMaxOffset;
  return p.b.format == Fp8Format::kE4M3 && (per_tensor || blocks);
}

// FP8 products (ops/grouped_gemm_fp8.h): the layer's backend (the sm90 kernel, the cuBLASLt
// grouped matmul or per-group cuBLASLt FP8 matmuls), then per product that backend where it takes
// the product's operands (as `fp8` quantizes them), else per-group matmuls.
// host_sizes: the call's split sizes are known on the host.
ProductBackends select_fp8_backends(const char* op, const at::Tensor& input, const GemmShape& shape,
                                    int64_t rows, GemmBackend choice, bool host_sizes,
                                    const Fp8GemmOptions& fp8) {
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK_NOT_IMPLEMENTED(
      input.is_cuda() && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16), op,
      ": FP8 runs on CUDA float32, float16 or bfloat16 tensors, got ", dtype, " on ",
      input.device());
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(input.device().index());
  TORCH_CHECK_NOT_IMPLEMENTED(props->major * 10 + props->minor >= 89, op,
                              ": FP8 GEMMs need a GPU of compute capability 8.9 or newer, got ",
                              props->major, ".", props->minor);
  TORCH_CHECK_NOT_IMPLEMENTED(shape.n % 16 == 0 && shape.k % 16 == 0, op,
                              ": FP8 needs in_features and out_features that are multiples of 16 "
                              "(FP8 GEMM operands), got in_features ",
                              shape.k, ", out_features ", shape.n);
  TORCH_CHECK(choice != GemmBackend::kReference, op,
              ": the reference grouped GEMM backend has no FP8 products");
  if (choice == GemmBackend::kAuto) choice = env_backend_choice();
  if (choice == GemmBackend::kAuto) {
    // kAuto's FP8 table, from bench_grouped_linear_fp8 on the H100 (docs/performance.md, "FP8
    // GroupedLinear"): large experts (mixtral's and deepseek-v3's, 117 M and 29 M weight elements)
    // run per group when the sizes are on the host: the sm90 kernel's split accumulation in dgrad
    // and wgrad makes it 0.91-0.94x per-group cuBLASLt there, against 1.2-3.2x on small experts
    // (4.2 M and fewer); with device sizes alone, per-group matmuls would need a host sync.
    // Otherwise the first of sm90, the grouped matmul and per-group matmuls that can run the call.
    const bool large = shape.n * shape.k >= kFp8LargeExpert;
    if (large && host_sizes) {
      choice = GemmBackend::kCublasLt;
    } else if (detail::sm90_refusal(input, shape, rows, /*fp8=*/true) == nullptr) {
      choice = GemmBackend::kSm90;
    } else if (detail::cublaslt_grouped_refusal(input, shape, rows) == nullptr) {
      choice = GemmBackend::kCublasLtGrouped;
    } else {
      choice = GemmBackend::kCublasLt;
    }
  }
  if (choice != GemmBackend::kCublasLt) {
    const char* why = choice == GemmBackend::kSm90
                          ? detail::sm90_refusal(input, shape, rows, /*fp8=*/true)
                          : detail::cublaslt_grouped_refusal(input, shape, rows);
    TORCH_CHECK_NOT_IMPLEMENTED(why == nullptr, op, ": the ", backend_name(choice),
                                " grouped GEMM backend cannot run this FP8 call: ", why);
  }
  auto product = [&](kernels::GemmKind kind) {
    return takes_fp8_operands(choice, kind, fp8_operands(kind, fp8, shape, rows))
               ? choice
               : GemmBackend::kCublasLt;
  };
  return {product(kernels::GemmKind::kFprop), product(kernels::GemmKind::kDgrad),
          product(kernels::GemmKind::kWgrad)};
}

ProductBackends select_backends(const char* op, const at::Tensor& input, const GemmShape& shape,
                                int64_t rows, GemmBackend choice) {
  const at::ScalarType dtype = input.scalar_type();
  if (input.is_cpu() && at::isFloatingType(dtype)) {
    TORCH_CHECK_NOT_IMPLEMENTED(choice == GemmBackend::kAuto || choice == GemmBackend::kReference,
                                op, ": the ", backend_name(choice),
                                " grouped GEMM backend runs on CUDA tensors only, got ",
                                input.device());
    return {GemmBackend::kReference, GemmBackend::kReference, GemmBackend::kReference};
  }
  // The environment overrides kAuto on CUDA only: the CPU has one backend.
  if (choice == GemmBackend::kAuto) choice = env_backend_choice();
  TORCH_CHECK_NOT_IMPLEMENTED(
      input.is_cuda() && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16), op,
      ": no grouped GEMM backend for ", input.device(), " tensors of dtype ", dtype,
      " (supported: CPU floating dtypes; CUDA float32, float16, bfloat16)");
  if (choice != GemmBackend::kAuto) {
    const char* why = refusal(choice, input, shape, rows);
    TORCH_CHECK_NOT_IMPLEMENTED(why == nullptr, op, ": the ", backend_name(choice),
                                " grouped GEMM backend cannot run this call: ", why, " (dtype ",
                                dtype, ", out_features ", shape.n, ", in_features ", shape.k, ", ",
                                shape.groups, " groups)");
    return {choice, choice, choice};
  }
  return auto_backends(input, shape, rows);
}

}  // namespace

namespace detail {

const char* backend_name(GemmBackend backend) {
  switch (backend) {
    case GemmBackend::kAuto:
      return "auto";
    case GemmBackend::kReference:
      return "reference";
    case GemmBackend::kCublasLt:
      return "cublaslt";
    case GemmBackend::kSm90:
      return "sm90";
    case GemmBackend::kCublasLtGrouped:
      return "cublaslt_grouped";
  }
  return "?";
}

}  // namespace detail

std::vector<GemmPlan> plan_grouped_gemms(const char* op, const at::Tensor& input,
                                         c10::ArrayRef<GemmShape> shapes,
                                         const SplitSizes& m_splits, GemmBackend choice,
                                         const at::Tensor& gather_rows,
                                         const std::optional<Fp8GemmOptions>& fp8) {
  TORCH_CHECK(!shapes.empty(), op, ": needs at least one layer's GemmShape to plan, got none");
  TORCH_CHECK(input.defined() && input.dim() == 2, op,
              ": the input must be a 2-D [rows, features] tensor");
  for (size_t i = 0; i < shapes.size(); ++i) {
    TORCH_CHECK(shapes[i].groups >= 1 && shapes[i].n > 0 && shapes[i].k > 0, op, ": shapes[", i,
                "] must have groups >= 1 and positive n (out features) and k (in features), got ",
                "groups ", shapes[i].groups, ", n ", shapes[i].n, ", k ", shapes[i].k);
    TORCH_CHECK(shapes[i].groups == shapes[0].groups, op, ": every layer planned together must ",
                "have shapes[0]'s ", shapes[0].groups, " groups, got ", shapes[i].groups,
                " in shapes[", i, "]");
  }
  if (gather_rows.defined()) detail::check_gather_rows(op, gather_rows, input);
  const int64_t rows = gather_rows.defined() ? gather_rows.size(0) : input.size(0);
  const size_t groups = shapes[0].groups;
  TORCH_CHECK(m_splits.size() == groups, op, ": m_splits must have num_gemms=", groups,
              " entries, got ", m_splits.size());
  if (m_splits.has_device()) check_device_splits(op, m_splits.device(), input);
  std::vector<GemmPlan> plans(shapes.size());
  bool host_needed = false, device_needed = false;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const ProductBackends backends =
        fp8 ? select_fp8_backends(op, input, shapes[i], rows, choice, m_splits.has_host(), *fp8)
            : select_backends(op, input, shapes[i], rows, choice);
    plans[i].fp8 = fp8;
    plans[i].backend = backends.fprop;
    plans[i].dgrad_backend = backends.dgrad;
    plans[i].wgrad_backend = backends.wgrad;
    plans[i].gathers_rows = fp8 || backends.fprop == GemmBackend::kSm90;
    plans[i].forward_scatters = !fp8 && backends.fprop == GemmBackend::kSm90;
    plans[i].dgrad_scatters = !fp8 && backends.dgrad == GemmBackend::kSm90;
    plans[i].shape = shapes[i];
    plans[i].rows = rows;
    plans[i].dtype = input.scalar_type();
    plans[i].device = input.device();
    for (GemmBackend b : {backends.fprop, backends.dgrad, backends.wgrad}) {
      (detail::reads_device_splits(b) ? device_needed : host_needed) = true;
    }
  }
  // One set of sizes for every layer: host sizes checked once (copied from the device once if
  // only device sizes were given), device sizes uploaded once if only host sizes were.
  std::vector<int64_t> host;
  if (m_splits.has_host()) {
    host = m_splits.host().vec();
  } else if (host_needed) {
    const at::Tensor copy = m_splits.device().to(at::kCPU, at::kLong);
    host.assign(copy.const_data_ptr<int64_t>(), copy.const_data_ptr<int64_t>() + copy.numel());
  }
  const bool has_host = m_splits.has_host() || host_needed;
  if (has_host) check_host_splits(op, host, rows);
  at::Tensor device;
  if (device_needed) device = detail::device_splits(m_splits, input);
  const SplitSizes resolved = !device.defined() ? SplitSizes(host)
                              : has_host        ? SplitSizes(std::move(host), device)
                                                : SplitSizes(device);
  for (GemmPlan& plan : plans) plan.m_splits = resolved;
  return plans;
}

}  // namespace torchmoe::ops
