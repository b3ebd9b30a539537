#include "torchmoe/kernels/grouped_gemm_cublaslt.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <unordered_map>

#include "torchmoe/kernels/cuda_check.h"

namespace torchmoe::kernels {
namespace {

// Largest power of two (capped at 16 bytes) that divides the address; cuBLASLt picks kernels by it.
uint8_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint8_t alignment = 1;
  while (alignment < 16 && address % (2u * alignment) == 0) alignment *= 2;
  return alignment;
}

// The column-major problem cuBLASLt sees for one group (see the header for the row-major view).
struct BlasProblem {
  cublasOperation_t trans_a, trans_b;
  uint64_t a_rows, a_cols, b_rows, b_cols, d_rows, d_cols;  // as stored; ld = rows
  const void* a;
  const void* b;
};

BlasProblem blas_problem(GemmKind kind, const GemmGroup& g, int64_t n, int64_t k) {
  const auto rows = static_cast<uint64_t>(g.rows);
  const auto un = static_cast<uint64_t>(n), uk = static_cast<uint64_t>(k);
  switch (kind) {
    case GemmKind::kFprop:  // D(n×rows) = Wᵀ-op(k×n stored) · x(k×rows stored)
      return {CUBLAS_OP_T, CUBLAS_OP_N, uk, un, uk, rows, un, rows, g.weight, g.input};
    case GemmKind::kDgrad:  // D(k×rows) = W(k×n stored) · dy(n×rows stored)
      return {CUBLAS_OP_N, CUBLAS_OP_N, uk, un, un, rows, uk, rows, g.weight, g.grad_output};
    case GemmKind::kWgrad:  // D(k×n) = x(k×rows stored) · dyᵀ-op(n×rows stored)
      return {CUBLAS_OP_N, CUBLAS_OP_T, uk, rows, un, rows, uk, un, g.input, g.grad_output};
  }
  TORCH_INTERNAL_ASSERT(false, "unknown GemmKind");
}

struct PlanKey {
  GemmKind kind;
  int64_t rows, n, k;
  ScalarType input_type, output_type;
  bool accumulate, allow_tf32;
  cublasLtEpilogue_t epilogue;
  uint8_t align_a, align_b, align_d, align_bias;
  size_t workspace_bytes;
  int device;

  auto fields() const {
    return std::make_tuple(kind, rows, n, k, input_type, output_type, accumulate, allow_tf32,
                           epilogue, align_a, align_b, align_d, align_bias, workspace_bytes,
                           device);
  }
  bool operator==(const PlanKey& other) const { return fields() == other.fields(); }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = 0;
    std::apply([&h](const auto&... field) { ((h = h * 1000003u ^ hash_field(field)), ...); },
               key.fields());
    return h;
  }
  template <typename T>
  static size_t hash_field(const T& value) {
    if constexpr (std::is_enum_v<T>) {
      return std::hash<std::underlying_type_t<T>>{}(static_cast<std::underlying_type_t<T>>(value));
    } else {
      return std::hash<T>{}(value);
    }
  }
};

// Descriptors and the chosen algorithm for one PlanKey, built once and reused.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    // Destruction failures are not actionable here; the descriptors are host memory only.
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

struct PreferenceHandle {
  cublasLtMatmulPreference_t pref = nullptr;
  PreferenceHandle() { TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref)); }
  ~PreferenceHandle() { cublasLtMatmulPreferenceDestroy(pref); }
};

template <typename T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

template <typename T>
void set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
              const T& value) {
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
}

// Returns null when cuBLASLt has no algorithm for the combination (e.g. an epilogue it does not
// support for these types); throws on any other failure.
std::unique_ptr<Plan> make_plan(const PlanKey& key, const BlasProblem& p, const void* bias_ptr,
                                cublasLtHandle_t handle) {
  auto plan = std::make_unique<Plan>();
  const bool fp32 = key.input_type == ScalarType::kFloat32;
  const cublasComputeType_t compute =
      fp32 && key.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F));
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, p.trans_a);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, p.trans_b);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, key.epilogue);
  if (key.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
  }
  const cudaDataType_t in = cuda_type(key.input_type), out = cuda_type(key.output_type);
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->a, in, p.a_rows, p.a_cols, p.a_rows));
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->b, in, p.b_rows, p.b_cols, p.b_rows));
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&plan->d, out, p.d_rows, p.d_cols, p.d_rows));

  PreferenceHandle pref;
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{key.workspace_bytes});
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32_t{key.align_a});
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, uint32_t{key.align_b});
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, uint32_t{key.align_d});
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, uint32_t{key.align_d});
  // Split-K kernels may add their partial sums in the output type (INPLACE, OUTPUT_TYPE schemes).
  // For fp16/bf16 outputs that rounds mid-reduction (measured: ~1% error on dgrad/wgrad), so
  // only fp32 reductions are allowed there: all math in fp32, one rounding at the store.
  const uint32_t reductions = key.output_type == ScalarType::kFloat32
                                  ? uint32_t{CUBLASLT_REDUCTION_SCHEME_MASK}
                                  : uint32_t{CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reductions);

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan->desc, plan->a, plan->b, plan->d, plan->d, pref.pref, 1, &result, &found);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) {
    return nullptr;
  }
  TORCHMOE_CUBLASLT_CHECK(status);
  plan->algo = result.algo;
  return plan;
}

// Plans are cached per host thread, so the descriptors need no locking; cuBLASLt reads them on the
// host at launch time only. MoE split sizes change every step, so the cache is bounded.
constexpr size_t kMaxCachedPlans = 4096;

const Plan* find_plan(const PlanKey& key, const BlasProblem& p, const void* bias_ptr,
                      cublasLtHandle_t handle) {
  thread_local std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> cache;
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= kMaxCachedPlans) cache.clear();
    it = cache.emplace(key, make_plan(key, p, bias_ptr, handle)).first;
  }
  return it->second.get();
}

// Events used to fork side streams from the caller's stream and join them back, per device.
cudaEvent_t fork_join_event(int device, size_t index) {
  thread_local std::unordered_map<int, std::vector<cudaEvent_t>> events;
  auto& pool = events[device];
  while (pool.size() <= index) {
    cudaEvent_t event = nullptr;
    TORCHMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    pool.push_back(event);
  }
  return pool[index];
}

const char* kind_name(GemmKind kind) {
  switch (kind) {
    case GemmKind::kFprop:
      return "fprop";
    case GemmKind::kDgrad:
      return "dgrad";
    case GemmKind::kWgrad:
      return "wgrad";
  }
  return "?";
}

}  // namespace

GroupedGemmResult run_grouped_gemm_cublaslt(const GroupedGemmParams& params,
                                            const CublasLtEnv& env) {
  TORCH_INTERNAL_ASSERT(env.handle != nullptr, "run_grouped_gemm_cublaslt: null cuBLASLt handle");
  TORCH_INTERNAL_ASSERT(params.n > 0 && params.k > 0, "run_grouped_gemm_cublaslt: empty features");
  TORCH_INTERNAL_ASSERT(!params.accumulate || params.kind == GemmKind::kWgrad,
                        "run_grouped_gemm_cublaslt: only wgrad accumulates");
  int device = 0;
  TORCHMOE_CUDA_CHECK(cudaGetDevice(&device));

  const bool is_wgrad = params.kind == GemmKind::kWgrad;
  const size_t in_size = element_size(params.input_type);
  const size_t out_size = element_size(params.output_type);
  bool wants_bias_grad = false;
  size_t nonempty = 0;
  for (const GemmGroup& g : params.groups) {
    wants_bias_grad |= is_wgrad && g.bias_grad != nullptr;
    nonempty += g.rows > 0;
  }
  // The epilogue writes the bias gradient in the output type; fuse it only when that is the bias's
  // own type (not for low-precision inputs accumulating into fp32 main-grad).
  bool fuse_bias_grad = wants_bias_grad && params.input_type == params.output_type;
  GroupedGemmResult result{fuse_bias_grad};

  const size_t num_streams = std::max<size_t>(1, std::min(env.side_streams.size() + 1, nonempty));
  const size_t workspace_per_stream = (env.workspace_bytes / num_streams) / 256 * 256;
  auto stream_at = [&](size_t i) { return i == 0 ? env.stream : env.side_streams[i - 1]; };

  if (num_streams > 1) {
    cudaEvent_t fork = fork_join_event(device, 0);
    TORCHMOE_CUDA_CHECK(cudaEventRecord(fork, env.stream));
    for (size_t i = 1; i < num_streams; ++i) {
      TORCHMOE_CUDA_CHECK(cudaStreamWaitEvent(stream_at(i), fork, 0));
    }
  }

  const float alpha = 1.0f;
  const float beta = params.accumulate ? 1.0f : 0.0f;
  size_t issued = 0;
  for (const GemmGroup& g : params.groups) {
    TORCH_INTERNAL_ASSERT(g.rows >= 0, "run_grouped_gemm_cublaslt: negative group size");
    if (g.rows == 0) {
      // fprop/dgrad own no rows of an empty group; wgrad owns dW_g and db_g, which are zero.
      if (is_wgrad && !params.accumulate) {
        TORCHMOE_CUDA_CHECK(
            cudaMemsetAsync(g.output, 0, params.n * params.k * out_size, env.stream));
      }
      if (fuse_bias_grad && g.bias_grad != nullptr) {
        TORCHMOE_CUDA_CHECK(cudaMemsetAsync(g.bias_grad, 0, params.n * in_size, env.stream));
      }
      continue;
    }
    const size_t stream_index = issued++ % num_streams;
    const BlasProblem problem = blas_problem(params.kind, g, params.n, params.k);

    const void* bias_ptr = nullptr;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    if (params.kind == GemmKind::kFprop && g.bias != nullptr) {
      epilogue = CUBLASLT_EPILOGUE_BIAS;
      bias_ptr = g.bias;
    } else if (fuse_bias_grad && g.bias_grad != nullptr) {
      epilogue = CUBLASLT_EPILOGUE_BGRADB;
      bias_ptr = g.bias_grad;
    }
    PlanKey key{};
    key.kind = params.kind;
    key.rows = g.rows;
    key.n = params.n;
    key.k = params.k;
    key.input_type = params.input_type;
    key.output_type = params.output_type;
    key.accumulate = params.accumulate;
    key.allow_tf32 = params.allow_tf32;
    key.epilogue = epilogue;
    key.align_a = alignment_of(problem.a);
    key.align_b = alignment_of(problem.b);
    key.align_d = alignment_of(g.output);
    key.align_bias = bias_ptr ? alignment_of(bias_ptr) : 16;
    key.workspace_bytes = workspace_per_stream;
    key.device = device;

    const Plan* plan = find_plan(key, problem, bias_ptr, env.handle);
    if (plan == nullptr && epilogue == CUBLASLT_EPILOGUE_BGRADB) {
      // No fused bias-gradient kernel for this case: the caller reduces dy instead.
      fuse_bias_grad = false;
      result.bias_grad_computed = false;
      epilogue = CUBLASLT_EPILOGUE_DEFAULT;
      key.epilogue = epilogue;
      key.align_bias = 16;
      bias_ptr = nullptr;
      plan = find_plan(key, problem, bias_ptr, env.handle);
    }
    TORCH_CHECK(plan != nullptr, "torchmoe: cuBLASLt has no algorithm for grouped ",
                kind_name(params.kind), " with rows=", g.rows, ", n=", params.n, ", k=", params.k);
    if (bias_ptr != nullptr) {
      set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
    }
    void* workspace = static_cast<char*>(env.workspace) + stream_index * workspace_per_stream;
    TORCHMOE_CUBLASLT_CHECK(cublasLtMatmul(env.handle, plan->desc, &alpha, problem.a, plan->a,
                                           problem.b, plan->b, &beta, g.output, plan->d, g.output,
                                           plan->d, &plan->algo, workspace, workspace_per_stream,
                                           stream_at(stream_index)));
  }

  for (size_t i = 1; i < num_streams; ++i) {
    cudaEvent_t join = fork_join_event(device, i);
    TORCHMOE_CUDA_CHECK(cudaEventRecord(join, stream_at(i)));
    TORCHMOE_CUDA_CHECK(cudaStreamWaitEvent(env.stream, join, 0));
  }
  return result;
}

}  // namespace torchmoe::kernels
