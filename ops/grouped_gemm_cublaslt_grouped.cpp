// The cuBLASLt grouped backend: one cuBLASLt grouped matmul per product with the split sizes on
// the device (kernels/grouped_gemm_cublaslt_grouped.h), the bias gradient from the device-split
// column sums. Taken only when the process loaded cuBLASLt >= 13.8.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>
#include <string>

#include "torchmoe/kernels/grouped_gemm_cublaslt_grouped.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/grouped_gemm_backends.h"
#include "torchmoe/ops/kernel_types.h"
#include "torchmoe/ops/types.h"

namespace torchmoe::ops::detail {
namespace {

kernels::CublasLtGroupedParams params_for(kernels::GemmKind kind, const GemmPlan& plan) {
  auto p = device_split_params<kernels::CublasLtGroupedParams>(kind, plan);
  p.allow_tf32 = at::globalContext().allowTF32CuBLAS();
  return p;
}

// The call's group arrays (and a biased fprop's fp32 product) come from the caching allocator:
// stream-ordered, recycled between calls, and part of a captured graph's pool. The cuBLASLt
// workspace is ATen's, kept per handle and stream for its own cuBLASLt matmuls: allocating 32 MiB
// per call cost host time and, inside a captured graph, handed later buffers of the step memory
// that this call's kernels write at replay.
struct Launch {
  kernels::CublasLtGroupedEnv env;
  at::Tensor arrays;
  at::Tensor product;  // a biased fprop's fp32 product, to which the bias is added (one rounding)
};

// For the 16-bit and the FP8 params alike.
template <typename Params>
Launch environment(const at::Tensor& like, const Params& p) {
  Launch launch;
  launch.arrays =
      new_empty({static_cast<int64_t>(kernels::cublaslt_grouped_array_bytes(p.num_groups))},
                like.options().dtype(at::kByte));
  kernels::CublasLtGroupedEnv& env = launch.env;
  env.handle = at::cuda::getCurrentCUDABlasLtHandle();
  env.stream = at::cuda::getCurrentCUDAStream().stream();
  env.arrays = launch.arrays.data_ptr();
  env.workspace = at::cuda::getCUDABlasLtWorkspace();
  env.workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  if (p.kind == kernels::GemmKind::kFprop && !p.bias.empty()) {
    launch.product = new_empty({p.rows, p.n}, like.options().dtype(at::kFloat));
    env.fprop_product = launch.product.mutable_data_ptr<float>();
  }
  return launch;
}

void launch(const at::Tensor& like, const kernels::CublasLtGroupedParams& p) {
  const c10::cuda::CUDAGuard guard(like.device());
  const Launch launch = environment(like, p);
  kernels::run_grouped_gemm_cublaslt_grouped(p, launch.env);
}

// The refusal for an old cuBLASLt names the version and file the process loaded, built once.
const char* library_refusal() {
  static const std::string refusal = [] {
    const kernels::LoadedCublasLt& lt = kernels::loaded_cublaslt();
    if (lt.grouped) return std::string();
    const size_t v = lt.version;
    return "it needs cuBLASLt >= 13.8 (grouped matmul; TransformerEngine reports CUDA-graph replay "
           "deadlocks in it up to 13.7), but this process loaded cuBLASLt " +
           std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
           std::to_string(v % 100) + " from " + (lt.library.empty() ? "?" : lt.library) +
           (lt.version >= kernels::kCublasLtGroupedMinVersion
                ? " without the grouped entry point"
                : "; pip install nvidia-cublas==13.10.0.20 into torch's environment "
                  "(docs/build.md)");
  }();
  return refusal.empty() ? nullptr : refusal.c_str();
}

// cuBLASLt's grouped matmul takes each group's matrix at a 16-byte-aligned address.
void check_aligned(const CheckedGroups& groups, const char* what) {
  TORCH_CHECK(groups.aligned, "torchmoe grouped GEMM: the cuBLASLt grouped backend needs ", what,
              " that start on 16-byte boundaries");
}

}  // namespace

const char* cublaslt_grouped_refusal(const at::Tensor& input, const GemmShape& shape,
                                     int64_t rows) {
  const at::ScalarType dtype = input.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat) {
    return "it takes bfloat16, float16 and float32 operands only";
  }
  if (const char* refusal = library_refusal()) return refusal;
  if (at::cuda::getDeviceProperties(input.device().index())->major < 9) {
    return "cuBLASLt's grouped matmul runs on sm_90 and newer devices only";
  }
  if (shape.n <= 0 || shape.k <= 0 || shape.n % 8 != 0 || shape.k % 8 != 0) {
    return "in_features and out_features must be positive multiples of 8 (every group's rows "
           "start on 16-byte boundaries)";
  }
  if (shape.groups == 0 || shape.groups > static_cast<size_t>(INT_MAX)) return "no groups";
  if (!shape.aligned)
    return "weights, biases and main-grad buffers must start on 16-byte boundaries";
  if (rows > INT32_MAX || shape.n > INT32_MAX || shape.k > INT32_MAX) {
    return "cuBLASLt's grouped shapes are 32-bit: rows and features must be below 2^31";
  }
  return nullptr;
}

void cublaslt_grouped_forward(const GemmPlan& plan, const at::Tensor& input,
                              const CheckedGroups& weights, const CheckedGroups& biases,
                              at::Tensor& output) {
  check_aligned(weights, "weights");
  if (plan.rows == 0) return;
  const at::Tensor x = aligned_operand(input);
  kernels::CublasLtGroupedParams p = params_for(kernels::GemmKind::kFprop, plan);
  p.input = x.const_data_ptr();
  p.output = output.data_ptr();
  p.weight = group_address(weights);
  p.bias = group_address(biases);
  launch(x, p);
}

void cublaslt_grouped_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                            const CheckedGroups& weights, at::Tensor& grad_input) {
  check_aligned(weights, "weights");
  if (plan.rows == 0) return;
  const at::Tensor dy = aligned_operand(grad_output);
  kernels::CublasLtGroupedParams p = params_for(kernels::GemmKind::kDgrad, plan);
  p.grad_output = dy.const_data_ptr();
  p.output = grad_input.data_ptr();
  p.weight = group_address(weights);
  launch(dy, p);
}

void cublaslt_grouped_wgrad(const GemmPlan& plan, const at::Tensor& input,
                            const at::Tensor& grad_output, const CheckedGroups& weight_grads,
                            bool accumulate) {
  check_aligned(weight_grads, "weight gradient buffers");
  if (plan.rows == 0) {  // nothing to read: every group is empty
    if (!accumulate) {
      for (size_t g = 0; g < weight_grads.size(); ++g) weight_grads.tensors[g].zero_();
    }
    return;
  }
  const at::Tensor x = aligned_operand(input), dy = aligned_operand(grad_output);
  kernels::CublasLtGroupedParams p = params_for(kernels::GemmKind::kWgrad, plan);
  p.output_type = kernel_type(weight_grads.tensors[0].scalar_type());
  p.input = x.const_data_ptr();
  p.grad_output = dy.const_data_ptr();
  p.weight_grad = group_address(weight_grads);
  p.accumulate = accumulate;
  launch(x, p);
}

void cublaslt_grouped_fp8(const at::Tensor& like, const kernels::CublasLtGroupedFp8Params& p) {
  const c10::cuda::CUDAGuard guard(like.device());
  const Launch launch = environment(like, p);
  kernels::run_grouped_gemm_cublaslt_grouped_fp8(p, launch.env);
}

}  // namespace torchmoe::ops::detail

namespace torchmoe {

LoadedCublasLt loaded_cublaslt() { return kernels::loaded_cublaslt(); }

}  // namespace torchmoe
