#include "torchmoe/ops/grouped_gemm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <string>

#include "torchmoe/kernels/grouped_gemm_cublaslt.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

// ---- validation shared by every backend --------------------------------------------------------

void check_splits(const char* op, c10::IntArrayRef m_splits, size_t num_groups, int64_t rows) {
  TORCH_CHECK(m_splits.size() == num_groups, op, ": m_splits must have one entry per group (",
              num_groups, "), got ", m_splits.size());
  int64_t sum = 0;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    TORCH_CHECK(m_splits[g] >= 0, op, ": m_splits[", g, "] must be non-negative, got ",
                m_splits[g]);
    sum += m_splits[g];
  }
  TORCH_CHECK(sum == rows, op, ": m_splits must sum to the number of rows (", rows, "), got ",
              m_splits, " (sum ", sum, ")");
}

void check_operand(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                   c10::IntArrayRef shape) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a defined tensor");
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(),
              " like the input, got ", t.device());
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_rows_operand(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.dim() == 2, op, ": ", name, " must be a 2-D [rows, features] tensor",
              t.defined() ? ", got " + std::to_string(t.dim()) + "-D" : std::string());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must have a floating dtype, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// Weights: G tensors [n, k] of the operand's dtype and device. Returns {n, k}.
std::pair<int64_t, int64_t> check_weights(const char* op, at::TensorList weights,
                                          const at::Tensor& like) {
  TORCH_CHECK(!weights.empty(), op, ": weights must hold at least one tensor");
  TORCH_CHECK(weights[0].defined() && weights[0].dim() == 2, op,
              ": weights must be 2-D [out_features, in_features] tensors");
  const int64_t n = weights[0].size(0), k = weights[0].size(1);
  for (size_t g = 0; g < weights.size(); ++g) {
    const std::string name = "weights[" + std::to_string(g) + "]";
    check_operand(op, name.c_str(), weights[g], like, {n, k});
    TORCH_CHECK(weights[g].scalar_type() == like.scalar_type(), op, ": ", name,
                " must have the input's dtype ", like.scalar_type(), ", got ",
                weights[g].scalar_type());
  }
  return {n, k};
}

void check_vectors(const char* op, const char* what, at::TensorList vectors, size_t num_groups,
                   int64_t n, const at::Tensor& like) {
  if (vectors.empty()) return;
  TORCH_CHECK(vectors.size() == num_groups, op, ": ", what,
              " must be empty or hold one tensor per ", "group (", num_groups, "), got ",
              vectors.size());
  for (size_t g = 0; g < vectors.size(); ++g) {
    const std::string name = std::string(what) + "[" + std::to_string(g) + "]";
    check_operand(op, name.c_str(), vectors[g], like, {n});
    TORCH_CHECK(vectors[g].scalar_type() == like.scalar_type(), op, ": ", name,
                " must have the input's dtype ", like.scalar_type(), ", got ",
                vectors[g].scalar_type());
  }
}

// ---- CUDA: cuBLASLt ---------------------------------------------------------------------------

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

// Runs the groups through cuBLASLt on the current stream of the operands' device. The workspace is
// taken from the caching allocator, so it is recycled between calls and stream-ordered.
kernels::GroupedGemmResult run_cublaslt(const at::Tensor& like, kernels::GroupedGemmParams params) {
  const c10::cuda::CUDAGuard guard(like.device());
  params.allow_tf32 = at::globalContext().allowTF32CuBLAS();
  size_t nonempty = 0;
  for (const auto& g : params.groups) nonempty += g.rows > 0;
  const size_t num_streams = std::max<size_t>(1, std::min(cublaslt_stream_count(), nonempty));

  kernels::CublasLtEnv env;
  env.handle = at::cuda::getCurrentCUDABlasLtHandle();
  env.stream = at::cuda::getCurrentCUDAStream().stream();
  for (size_t i = 1; i < num_streams; ++i) {
    env.side_streams.push_back(at::cuda::getStreamFromPool(false, like.device().index()).stream());
  }
  // cuBLASLt's Hopper kernels want up to 32 MiB each; older GPUs need far less.
  const size_t per_stream =
      at::cuda::getCurrentDeviceProperties()->major >= 9 ? (32u << 20) : (4u << 20);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(per_stream * num_streams)}, like.options().dtype(at::kByte));
  env.workspace = workspace.data_ptr();
  env.workspace_bytes = per_stream * num_streams;
  return kernels::run_grouped_gemm_cublaslt(params, env);
}

const void* rows_at(const at::Tensor& t, int64_t row) {
  return static_cast<const char*>(t.const_data_ptr()) + row * t.size(1) * t.element_size();
}

void* mutable_rows_at(at::Tensor& t, int64_t row) {
  return static_cast<char*>(t.data_ptr()) + row * t.size(1) * t.element_size();
}

// Calls fn(g, first_row, rows) for every group, in order.
template <typename Fn>
void for_each_group(c10::IntArrayRef m_splits, Fn&& fn) {
  int64_t first_row = 0;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    fn(g, first_row, m_splits[g]);
    first_row += m_splits[g];
  }
}

kernels::GroupedGemmParams gemm_params(kernels::GemmKind kind, int64_t n, int64_t k,
                                       at::ScalarType input_type, at::ScalarType output_type) {
  kernels::GroupedGemmParams params;
  params.kind = kind;
  params.n = n;
  params.k = k;
  params.input_type = kernel_type(input_type);
  params.output_type = kernel_type(output_type);
  return params;
}

}  // namespace

GemmBackend select_backend(const at::Tensor& operand) {
  const at::ScalarType dtype = operand.scalar_type();
  if (operand.is_cpu() && at::isFloatingType(dtype)) return GemmBackend::kReference;
  if (operand.is_cuda() && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) {
    return GemmBackend::kCublasLt;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, "torchmoe grouped GEMM: no backend for ", operand.device(),
                              " tensors of dtype ", dtype,
                              " (supported: CPU floating dtypes; CUDA float32, float16, bfloat16)");
}

std::vector<int64_t> splits_to_host(const at::Tensor& m_splits) {
  TORCH_CHECK(m_splits.defined(), "m_splits must be a defined tensor");
  TORCH_CHECK(m_splits.dim() == 1, "m_splits must be a 1-D tensor, got ", m_splits.dim(), "-D");
  TORCH_CHECK(at::isIntegralType(m_splits.scalar_type(), /*includeBool=*/false),
              "m_splits must have an integer dtype, got ", m_splits.scalar_type());
  const at::Tensor host = m_splits.to(at::kCPU, at::kLong).contiguous();
  const int64_t* data = host.const_data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + host.numel());
}

at::Tensor grouped_linear_forward(const at::Tensor& input, c10::IntArrayRef m_splits,
                                  at::TensorList weights, at::TensorList biases) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_forward";
  check_rows_operand(op, "input", input);
  const auto [n, k] = check_weights(op, weights, input);
  TORCH_CHECK(input.size(1) == k, op, ": input must have ", k, " features (weights are [", n, ", ",
              k, "]), got ", input.size(1));
  check_vectors(op, "biases", biases, weights.size(), n, input);
  check_splits(op, m_splits, weights.size(), input.size(0));

  at::Tensor output = at::empty({input.size(0), n}, input.options());
  switch (select_backend(input)) {
    case GemmBackend::kReference:
      for_each_group(m_splits, [&](size_t g, int64_t first, int64_t rows) {
        if (rows == 0) return;
        at::Tensor out_g = output.narrow(0, first, rows);
        const at::Tensor in_g = input.narrow(0, first, rows);
        if (biases.empty()) {
          at::mm_out(out_g, in_g, weights[g].t());
        } else {
          at::addmm_out(out_g, biases[g], in_g, weights[g].t());
        }
      });
      return output;
    case GemmBackend::kCublasLt: {
      auto params =
          gemm_params(kernels::GemmKind::kFprop, n, k, input.scalar_type(), input.scalar_type());
      for_each_group(m_splits, [&](size_t g, int64_t first, int64_t rows) {
        kernels::GemmGroup group;
        group.rows = rows;
        group.input = rows_at(input, first);
        group.weight = weights[g].const_data_ptr();
        group.output = mutable_rows_at(output, first);
        group.bias = biases.empty() ? nullptr : biases[g].const_data_ptr();
        params.groups.push_back(group);
      });
      run_cublaslt(input, std::move(params));
      return output;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GemmBackend");
}

at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, c10::IntArrayRef m_splits,
                                at::TensorList weights) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_dgrad";
  check_rows_operand(op, "grad_output", grad_output);
  const auto [n, k] = check_weights(op, weights, grad_output);
  TORCH_CHECK(grad_output.size(1) == n, op, ": grad_output must have ", n,
              " features (weights are [", n, ", ", k, "]), got ", grad_output.size(1));
  check_splits(op, m_splits, weights.size(), grad_output.size(0));

  at::Tensor grad_input = at::empty({grad_output.size(0), k}, grad_output.options());
  switch (select_backend(grad_output)) {
    case GemmBackend::kReference:
      for_each_group(m_splits, [&](size_t g, int64_t first, int64_t rows) {
        if (rows == 0) return;
        at::Tensor out_g = grad_input.narrow(0, first, rows);
        at::mm_out(out_g, grad_output.narrow(0, first, rows), weights[g]);
      });
      return grad_input;
    case GemmBackend::kCublasLt: {
      auto params = gemm_params(kernels::GemmKind::kDgrad, n, k, grad_output.scalar_type(),
                                grad_output.scalar_type());
      for_each_group(m_splits, [&](size_t g, int64_t first, int64_t rows) {
        kernels::GemmGroup group;
        group.rows = rows;
        group.grad_output = rows_at(grad_output, first);
        group.weight = weights[g].const_data_ptr();
        group.output = mutable_rows_at(grad_input, first);
        params.groups.push_back(group);
      });
      run_cublaslt(grad_output, std::move(params));
      return grad_input;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GemmBackend");
}

void grouped_bias_grad(const at::Tensor& grad_output, c10::IntArrayRef m_splits,
                       at::TensorList bias_grads_out) {
  constexpr const char* op = "torchmoe::ops::grouped_bias_grad";
  check_rows_operand(op, "grad_output", grad_output);
  TORCH_CHECK(!bias_grads_out.empty(), op, ": bias_grads_out must hold one tensor per group");
  check_vectors(op, "bias_grads_out", bias_grads_out, bias_grads_out.size(), grad_output.size(1),
                grad_output);
  check_splits(op, m_splits, bias_grads_out.size(), grad_output.size(0));
  // One reduction per group on every backend: at::sum accumulates in fp32 for 16-bit inputs and
  // rounds once, and returns zeros for an empty group.
  for_each_group(m_splits, [&](size_t g, int64_t first, int64_t rows) {
    at::Tensor out_g = bias_grads_out[g];
    at::sum_out(out_g, grad_output.narrow(0, first, rows), {0});
  });
}

void grouped_linear_wgrad(const at::Tensor& input, const at::Tensor& grad_output,
                          c10::IntArrayRef m_splits, at::TensorList weight_grads_out,
                          bool accumulate, at::TensorList bias_grads_out) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_wgrad";
  check_rows_operand(op, "input", input);
  check_rows_operand(op, "grad_output", grad_output);
  TORCH_CHECK(grad_output.device() == input.device(), op, ": grad_output must be on ",
              input.device(), " like the input, got ", grad_output.device());
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), op,
              ": grad_output must have the input's dtype ", input.scalar_type(), ", got ",
              grad_output.scalar_type());
  TORCH_CHECK(grad_output.size(0) == input.size(0), op, ": grad_output must have the input's ",
              input.size(0), " rows, got ", grad_output.size(0));
  TORCH_CHECK(!weight_grads_out.empty(), op, ": weight_grads_out must hold one tensor per group");
  const int64_t n = grad_output.size(1), k = input.size(1);
  const at::ScalarType grad_type = weight_grads_out[0].scalar_type();
  TORCH_CHECK(grad_type == input.scalar_type() || grad_type == at::kFloat, op,
              ": weight_grads_out must have the input's dtype ", input.scalar_type(),
              " or float32, got ", grad_type);
  // Adding into a 16-bit buffer would round twice (cuBLASLt's beta = 1 epilogue was measured
  // rounding the product before the add); accumulation is for fp32 main-grad buffers.
  TORCH_CHECK(!accumulate || grad_type == at::kFloat || grad_type == at::kDouble, op,
              ": accumulate requires float32 (or float64) weight_grads_out, got ", grad_type);
  for (size_t g = 0; g < weight_grads_out.size(); ++g) {
    const std::string name = "weight_grads_out[" + std::to_string(g) + "]";
    check_operand(op, name.c_str(), weight_grads_out[g], input, {n, k});
    TORCH_CHECK(weight_grads_out[g].scalar_type() == grad_type, op, ": ", name, " must have dtype ",
                grad_type, " like weight_grads_out[0], got ", weight_grads_out[g].scalar_type());
  }
  check_vectors(op, "bias_grads_out", bias_grads_out, weight_grads_out.size(), n, input);
  check_splits(op, m_splits, weight_grads_out.size(), input.size(0));

  switch (select_backend(input)) {
    case GemmBackend::kReference: {
      // Multiply in the wider of the operand and buffer types, so that fp32 main-grad receives
      // one rounding, as on the GPU.
      const at::ScalarType compute_type = at::promote_types(input.scalar_type(), grad_type);
      for_each_group(m_splits, [&](size_t g, int64_t first, int64_t rows) {
        if (rows == 0 && accumulate) return;
        at::Tensor out_g = weight_grads_out[g];
        const at::Tensor product = at::mm(grad_output.narrow(0, first, rows).t().to(compute_type),
                                          input.narrow(0, first, rows).to(compute_type));
        accumulate ? out_g.add_(product) : out_g.copy_(product);
      });
      if (!bias_grads_out.empty()) grouped_bias_grad(grad_output, m_splits, bias_grads_out);
      return;
    }
    case GemmBackend::kCublasLt: {
      auto params = gemm_params(kernels::GemmKind::kWgrad, n, k, input.scalar_type(), grad_type);
      params.accumulate = accumulate;
      for_each_group(m_splits, [&](size_t g, int64_t first, int64_t rows) {
        kernels::GemmGroup group;
        group.rows = rows;
        group.input = rows_at(input, first);
        group.grad_output = rows_at(grad_output, first);
        group.output = weight_grads_out[g].data_ptr();
        group.bias_grad = bias_grads_out.empty() ? nullptr : bias_grads_out[g].data_ptr();
        params.groups.push_back(group);
      });
      const kernels::GroupedGemmResult result = run_cublaslt(input, std::move(params));
      if (!bias_grads_out.empty() && !result.bias_grad_computed) {
        grouped_bias_grad(grad_output, m_splits, bias_grads_out);
      }
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GemmBackend");
}

}  // namespace torchmoe::ops
