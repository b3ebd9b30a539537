// The per-group cuBLASLt backend: one cuBLASLt matmul per group with host split sizes, spread over
// the caller's stream and a few side streams (kernels/grouped_gemm_cublaslt.h).

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "torchmoe/kernels/grouped_gemm_cublaslt.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/grouped_gemm_backends.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops::detail {
namespace {

// Streams a grouped GEMM may spread over (the caller's plus side streams). TE uses 4; measured
// trade-offs are in docs/performance.md. TORCHMOE_CUBLASLT_STREAMS overrides (1 = no side streams).
size_t cublaslt_stream_count() {
  static const size_t count = [] {
    const char* env = std::getenv("TORCHMOE_CUBLASLT_STREAMS");
    if (env == nullptr) return size_t{4};
    const long value = std::strtol(env, nullptr, 10);
    TORCH_CHECK(value >= 1 && value <= 32, "TORCHMOE_CUBLASLT_STREAMS must be in [1, 32], got '",
                env, "'");
    return static_cast<size_t>(value);
  }();
  return count;
}

}  // namespace

kernels::GroupedGemmResult run_cublaslt(const at::Tensor& like, kernels::GroupedGemmParams params) {
  const c10::cuda::CUDAGuard guard(like.device());
  params.allow_tf32 = at::globalContext().allowTF32CuBLAS();
  size_t nonempty = 0;
  for (const auto& g : params.groups) nonempty += g.rows > 0;
  const CublasLtLaunch launch = cublaslt_launch(like, nonempty);
  return kernels::run_grouped_gemm_cublaslt(params, launch.env);
}

namespace {

const void* rows_at(const at::Tensor& t, int64_t row) {
  return static_cast<const char*>(t.const_data_ptr()) + row * t.size(1) * t.element_size();
}

void* mutable_rows_at(const at::Tensor& t, int64_t row) {
  return const_cast<void*>(rows_at(t, row));
}

kernels::GroupedGemmParams params_for(kernels::GemmKind kind, const GemmPlan& plan,
                                      at::ScalarType output_type) {
  kernels::GroupedGemmParams params;
  params.kind = kind;
  params.n = plan.shape.n;
  params.k = plan.shape.k;
  params.input_type = kernel_type(plan.dtype);
  params.output_type = kernel_type(output_type);
  params.groups.reserve(plan.shape.groups);
  return params;
}

}  // namespace

CublasLtLaunch cublaslt_launch(const at::Tensor& like, size_t nonempty) {
  const size_t num_streams = std::max<size_t>(1, std::min(cublaslt_stream_count(), nonempty));
  CublasLtLaunch launch;
  kernels::CublasLtEnv& env = launch.env;
  env.handle = at::cuda::getCurrentCUDABlasLtHandle();
  env.stream = at::cuda::getCurrentCUDAStream().stream();
  for (size_t i = 1; i < num_streams; ++i) {
    env.side_streams.push_back(at::cuda::getStreamFromPool(false, like.device().index()).stream());
  }
  // cuBLASLt's Hopper kernels want up to 32 MiB each; older GPUs need far less.
  const size_t per_stream =
      at::cuda::getCurrentDeviceProperties()->major >= 9 ? (32u << 20) : (4u << 20);
  launch.workspace =
      new_empty({static_cast<int64_t>(per_stream * num_streams)}, like.options().dtype(at::kByte));
  env.workspace = launch.workspace.data_ptr();
  env.workspace_bytes = per_stream * num_streams;
  return launch;
}

void cublaslt_forward(const GemmPlan& plan, const at::Tensor& input, const CheckedGroups& weights,
                      const CheckedGroups& biases, at::Tensor& output) {
  auto params = params_for(kernels::GemmKind::kFprop, plan, plan.dtype);
  for_each_group(plan.m_splits.host(), [&](size_t g, int64_t first, int64_t rows) {
    kernels::GemmGroup group;
    group.rows = rows;
    group.input = rows_at(input, first);
    group.weight = weights.data(g);
    group.output = mutable_rows_at(output, first);
    group.bias = biases.empty() ? nullptr : biases.data(g);
    params.groups.push_back(group);
  });
  run_cublaslt(input, std::move(params));
}

void cublaslt_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                    const CheckedGroups& weights, at::Tensor& grad_input) {
  auto params = params_for(kernels::GemmKind::kDgrad, plan, plan.dtype);
  for_each_group(plan.m_splits.host(), [&](size_t g, int64_t first, int64_t rows) {
    kernels::GemmGroup group;
    group.rows = rows;
    group.grad_output = rows_at(grad_output, first);
    group.weight = weights.data(g);
    group.output = mutable_rows_at(grad_input, first);
    params.groups.push_back(group);
  });
  run_cublaslt(grad_output, std::move(params));
}

void cublaslt_wgrad(const GemmPlan& plan, const at::Tensor& input, const at::Tensor& grad_output,
                    const CheckedGroups& weight_grads, bool accumulate,
                    const CheckedGroups& bias_grads) {
  auto params = params_for(kernels::GemmKind::kWgrad, plan, weight_grads.tensors[0].scalar_type());
  params.accumulate = accumulate;
  for_each_group(plan.m_splits.host(), [&](size_t g, int64_t first, int64_t rows) {
    kernels::GemmGroup group;
    group.rows = rows;
    group.input = rows_at(input, first);
    group.grad_output = rows_at(grad_output, first);
    group.output = weight_grads.mutable_data(g);
    group.bias_grad = bias_grads.empty() ? nullptr : bias_grads.mutable_data(g);
    params.groups.push_back(group);
  });
  const kernels::GroupedGemmResult result = run_cublaslt(input, std::move(params));
  if (!bias_grads.empty() && !result.bias_grad_computed) {
    host_bias_grad(plan.m_splits.host(), grad_output, bias_grads);
  }
}

}  // namespace torchmoe::ops::detail
