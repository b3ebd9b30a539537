#include "torchmoe/kernels/grouped_gemm_cublaslt.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <unordered_map>

#include "torchmoe/kernels/cuda_check.h"
#include "torchmoe/kernels/split_quantize.h"

namespace torchmoe::kernels {
namespace {

// Largest power of two (capped at 16 bytes) that divides the address; cuBLASLt picks kernels by it.
uint8_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint8_t alignment = 1;
  while (alignment < 16 && address % (2u * alignment) == 0) alignment *= 2;
  return alignment;
}

// The column-major problem cuBLASLt sees for one matmul (row-major operands pass as their
// transposes).
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

// C[m, n] = A[m, kk] · B[n, kk]ᵀ row-major is D(n×m) = Bᵀ-op(kk×n stored) · A(kk×m stored).
BlasProblem fp8_problem(const Fp8GemmGroup& g, int64_t n) {
  const auto m = static_cast<uint64_t>(g.m), kk = static_cast<uint64_t>(g.kk);
  const auto un = static_cast<uint64_t>(n);
  return {CUBLAS_OP_T, CUBLAS_OP_N, kk, un, kk, m, un, m, g.b, g.a};
}

constexpr int32_t kNoScaleMode = -1;  // 16/32-bit operands: no scale attributes

// Everything that selects descriptors and an algorithm. Shapes, types and alignments, not
// pointers: those are set on the descriptor at each launch.
struct PlanKey {
  cublasOperation_t trans_a, trans_b;
  uint64_t a_rows, a_cols, b_rows, b_cols, d_rows, d_cols;
  cudaDataType_t a_type, b_type, d_type;
  cublasComputeType_t compute;
  int32_t a_scale_mode, b_scale_mode;  // cublasLtMatmulMatrixScale_t or kNoScaleMode
  bool fast_accumulation;              // CUBLASLT_MATMUL_DESC_FAST_ACCUM: no split accumulation
  cublasLtEpilogue_t epilogue;
  uint8_t align_a, align_b, align_d, align_bias;
  size_t workspace_bytes;
  int device;

  auto fields() const {
    return std::make_tuple(trans_a, trans_b, a_rows, a_cols, b_rows, b_cols, d_rows, d_cols, a_type,
                           b_type, d_type, compute, a_scale_mode, b_scale_mode, fast_accumulation,
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

PlanKey plan_key(const BlasProblem& p, cudaDataType_t a_type, cudaDataType_t b_type,
                 cudaDataType_t d_type, cublasComputeType_t compute, const void* output,
                 size_t workspace_bytes, int device) {
  PlanKey key{};
  key.trans_a = p.trans_a;
  key.trans_b = p.trans_b;
  key.a_rows = p.a_rows;
  key.a_cols = p.a_cols;
  key.b_rows = p.b_rows;
  key.b_cols = p.b_cols;
  key.d_rows = p.d_rows;
  key.d_cols = p.d_cols;
  key.a_type = a_type;
  key.b_type = b_type;
  key.d_type = d_type;
  key.compute = compute;
  key.a_scale_mode = key.b_scale_mode = kNoScaleMode;
  key.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  key.align_a = alignment_of(p.a);
  key.align_b = alignment_of(p.b);
  key.align_d = alignment_of(output);
  key.align_bias = 16;
  key.workspace_bytes = workspace_bytes;
  key.device = device;
  return key;
}

void set_epilogue(PlanKey& key, cublasLtEpilogue_t epilogue, const void* bias) {
  key.epilogue = epilogue;
  key.align_bias = bias != nullptr ? alignment_of(bias) : 16;
}

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

// The pointers a matmul sets on its descriptor. The algorithm is chosen with them in place: with
// FP8 scale pointers unset, the heuristic returns algorithms that cublasLtMatmul then refuses once
// they are set (measured on the H100, cuBLAS 13.1).
struct DescPointers {
  const void* bias = nullptr;      // the epilogue's pointer (BIAS or BGRADB), or null
  const float* a_scale = nullptr;  // cuBLAS's A and B scale pointers (FP8), or null
  const float* b_scale = nullptr;
};

void set_pointers(cublasLtMatmulDesc_t desc, const DescPointers& pointers) {
  if (pointers.bias != nullptr) set_desc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, pointers.bias);
  if (pointers.a_scale != nullptr) {
    set_desc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, pointers.a_scale);
    set_desc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, pointers.b_scale);
  }
}

// Returns null when cuBLASLt has no algorithm for the combination (e.g. an epilogue it does not
// support for these types); throws on any other failure.
std::shared_ptr<Plan> make_plan(const PlanKey& key, const DescPointers& pointers,
                                cublasLtHandle_t handle) {
  auto plan = std::make_shared<Plan>();
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&plan->desc, key.compute, CUDA_R_32F));
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, key.trans_a);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, key.trans_b);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, key.epilogue);
  if (key.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    // The bias (gradient) has the output's type. Said explicitly: FP8 kernels with an fp32 output
    // otherwise read a bf16 bias.
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(key.d_type));
  }
  set_pointers(plan->desc, pointers);
  if (key.a_scale_mode != kNoScaleMode) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, key.a_scale_mode);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, key.b_scale_mode);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{key.fast_accumulation});
  }
  TORCHMOE_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&plan->a, key.a_type, key.a_rows, key.a_cols, key.a_rows));
  TORCHMOE_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&plan->b, key.b_type, key.b_rows, key.b_cols, key.b_rows));
  TORCHMOE_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&plan->d, key.d_type, key.d_rows, key.d_cols, key.d_rows));

  PreferenceHandle pref;
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{key.workspace_bytes});
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32_t{key.align_a});
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, uint32_t{key.align_b});
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, uint32_t{key.align_d});
  set_pref(pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, uint32_t{key.align_d});
  // Split-K kernels may add their partial sums in the output type (INPLACE, OUTPUT_TYPE schemes).
  // For fp16/bf16 outputs that rounds mid-reduction (measured: ~1% error on dgrad/wgrad), so
  // only fp32 reductions are allowed there: all math in fp32, one rounding at the store.
  const uint32_t reductions = key.d_type == CUDA_R_32F
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
// host at launch time only. MoE split sizes change every step, so the cache is bounded. A call
// holds its plans by shared pointer: it finds all its groups' plans before launching any, and a
// clear in between (measured: 8 MoE layers of 32 experts fill 4096 entries within a few steps)
// must not free the ones it already holds.
constexpr size_t kMaxCachedPlans = 4096;

std::shared_ptr<const Plan> find_plan(const PlanKey& key, const DescPointers& pointers,
                                      cublasLtHandle_t handle) {
  thread_local std::unordered_map<PlanKey, std::shared_ptr<Plan>, PlanKeyHash> cache;
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= kMaxCachedPlans) cache.clear();
    it = cache.emplace(key, make_plan(key, pointers, handle)).first;
  }
  return it->second;
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

// One matmul with its plan and the pointers set on the descriptor at launch.
struct LtCall {
  std::shared_ptr<const Plan> plan;
  BlasProblem problem{};
  void* output = nullptr;
  DescPointers pointers;
};

// How many streams a call of `nonempty` matmuls spreads over, and each stream's workspace.
struct StreamSplit {
  size_t streams = 1;
  size_t workspace_per_stream = 0;
};

StreamSplit split_streams(const CublasLtEnv& env, size_t nonempty) {
  StreamSplit split;
  split.streams = std::max<size_t>(1, std::min(env.side_streams.size() + 1, nonempty));
  split.workspace_per_stream = (env.workspace_bytes / split.streams) / 256 * 256;
  return split;
}

// The side streams forked from the caller's stream joined back into it, also when a launch
// between throws: the caller frees the outputs and the workspace in its stream's order, which
// must then include what the side streams were given (and a capture must end joined).
class StreamJoin {
 public:
  StreamJoin(const CublasLtEnv& env, int device) : env_(env), device_(device) {}
  StreamJoin(const StreamJoin&) = delete;
  StreamJoin& operator=(const StreamJoin&) = delete;
  void forked(size_t streams) { forked_ = streams; }
  // Throws on a CUDA error; the destructor's join (after another exception) cannot.
  void join() {
    join_streams([](cudaError_t status) { TORCHMOE_CUDA_CHECK(status); });
    forked_ = 0;
  }
  ~StreamJoin() {
    join_streams([](cudaError_t) {});
  }

 private:
  template <typename Check>
  void join_streams(Check check) {
    for (size_t i = 1; i < forked_; ++i) {
      cudaEvent_t join = fork_join_event(device_, i);
      check(cudaEventRecord(join, env_.side_streams[i - 1]));
      check(cudaStreamWaitEvent(env_.stream, join, 0));
    }
  }
  const CublasLtEnv& env_;
  int device_;
  size_t forked_ = 0;
};

// Issues the matmuls round-robin over the caller's stream and the side streams, which fork from
// and join back into it.
void launch_calls(const std::vector<LtCall>& calls, float beta, const StreamSplit& split,
                  const CublasLtEnv& env, int device) {
  auto stream_at = [&](size_t i) { return i == 0 ? env.stream : env.side_streams[i - 1]; };
  const size_t num_streams = std::min(split.streams, std::max<size_t>(1, calls.size()));
  StreamJoin joined(env, device);
  if (num_streams > 1) {
    // Every join event made now, so that the destructor's join only looks them up.
    fork_join_event(device, num_streams - 1);
    cudaEvent_t fork = fork_join_event(device, 0);
    TORCHMOE_CUDA_CHECK(cudaEventRecord(fork, env.stream));
    for (size_t i = 1; i < num_streams; ++i) {
      TORCHMOE_CUDA_CHECK(cudaStreamWaitEvent(stream_at(i), fork, 0));
      joined.forked(i + 1);
    }
  }
  const float alpha = 1.0f;
  for (size_t i = 0; i < calls.size(); ++i) {
    const LtCall& c = calls[i];
    const size_t stream_index = i % num_streams;
    set_pointers(c.plan->desc, c.pointers);
    void* workspace = static_cast<char*>(env.workspace) + stream_index * split.workspace_per_stream;
    TORCHMOE_CUBLASLT_CHECK(cublasLtMatmul(env.handle, c.plan->desc, &alpha, c.problem.a, c.plan->a,
                                           c.problem.b, c.plan->b, &beta, c.output, c.plan->d,
                                           c.output, c.plan->d, &c.plan->algo, workspace,
                                           split.workspace_per_stream, stream_at(stream_index)));
  }
  joined.join();
}

int current_device() {
  int device = 0;
  TORCHMOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

cudaDataType_t fp8_type(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

int32_t scale_mode(QuantizeScaling scaling) {
  switch (scaling) {
    case QuantizeScaling::kCurrent:
    case QuantizeScaling::kDelayed:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case QuantizeScaling::kBlock1x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case QuantizeScaling::kBlock128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown QuantizeScaling");
}

}  // namespace

GroupedGemmResult run_grouped_gemm_cublaslt(const GroupedGemmParams& params,
                                            const CublasLtEnv& env) {
  TORCH_INTERNAL_ASSERT(env.handle != nullptr, "run_grouped_gemm_cublaslt: null cuBLASLt handle");
  TORCH_INTERNAL_ASSERT(params.n > 0 && params.k > 0, "run_grouped_gemm_cublaslt: empty features");
  TORCH_INTERNAL_ASSERT(!params.accumulate || params.kind == GemmKind::kWgrad,
                        "run_grouped_gemm_cublaslt: only wgrad accumulates");
  const int device = current_device();

  const bool is_wgrad = params.kind == GemmKind::kWgrad;
  const size_t in_size = element_size(params.input_type);
  const size_t out_size = element_size(params.output_type);
  bool wants_bias_grad = false;
  size_t nonempty = 0;
  for (const GemmGroup& g : params.groups) {
    TORCH_INTERNAL_ASSERT(g.rows >= 0, "run_grouped_gemm_cublaslt: negative group size");
    wants_bias_grad |= is_wgrad && g.bias_grad != nullptr;
    nonempty += g.rows > 0;
  }
  // The epilogue writes the bias gradient in the output type; fuse it only when that is the bias's
  // own type (not for low-precision inputs accumulating into fp32 main-grad).
  bool fuse_bias_grad = wants_bias_grad && params.input_type == params.output_type;
  const StreamSplit split = split_streams(env, nonempty);
  const bool fp32 = params.input_type == ScalarType::kFloat32;
  const cublasComputeType_t compute =
      fp32 && params.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const cudaDataType_t in = cuda_type(params.input_type), out = cuda_type(params.output_type);

  std::vector<LtCall> calls;
  calls.reserve(nonempty);
  for (const GemmGroup& g : params.groups) {
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
    LtCall call;
    call.problem = blas_problem(params.kind, g, params.n, params.k);
    call.output = g.output;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    if (params.kind == GemmKind::kFprop && g.bias != nullptr) {
      epilogue = CUBLASLT_EPILOGUE_BIAS;
      call.pointers.bias = g.bias;
    } else if (fuse_bias_grad && g.bias_grad != nullptr) {
      epilogue = CUBLASLT_EPILOGUE_BGRADB;
      call.pointers.bias = g.bias_grad;
    }
    PlanKey key =
        plan_key(call.problem, in, in, out, compute, g.output, split.workspace_per_stream, device);
    set_epilogue(key, epilogue, call.pointers.bias);
    call.plan = find_plan(key, call.pointers, env.handle);
    if (call.plan == nullptr && epilogue == CUBLASLT_EPILOGUE_BGRADB) {
      // No fused bias-gradient kernel for this case: the caller reduces dy instead, for every
      // group (earlier groups' fused results are simply overwritten).
      fuse_bias_grad = false;
      call.pointers.bias = nullptr;
      set_epilogue(key, CUBLASLT_EPILOGUE_DEFAULT, nullptr);
      call.plan = find_plan(key, call.pointers, env.handle);
    }
    TORCH_CHECK(call.plan != nullptr, "torchmoe: cuBLASLt has no algorithm for grouped ",
                kind_name(params.kind), " with rows=", g.rows, ", n=", params.n, ", k=", params.k);
    calls.push_back(call);
  }
  launch_calls(calls, params.accumulate ? 1.0f : 0.0f, split, env, device);
  return GroupedGemmResult{fuse_bias_grad};
}

Fp8GemmResult run_grouped_gemm_cublaslt_fp8(const Fp8GroupedGemmParams& params,
                                            const CublasLtEnv& env) {
  TORCH_INTERNAL_ASSERT(env.handle != nullptr, "run_grouped_gemm_cublaslt_fp8: null handle");
  TORCH_INTERNAL_ASSERT(params.n > 0, "run_grouped_gemm_cublaslt_fp8: empty n");
  TORCH_INTERNAL_ASSERT(params.a_format == Fp8Format::kE4M3 || params.b_format == Fp8Format::kE4M3,
                        "run_grouped_gemm_cublaslt_fp8: e5m2 × e5m2 has no FP8 kernel");
  TORCH_INTERNAL_ASSERT(!params.accumulate || params.output_type == ScalarType::kFloat32,
                        "run_grouped_gemm_cublaslt_fp8: only fp32 outputs accumulate");
  const int device = current_device();
  size_t nonempty = 0;
  for (const Fp8GemmGroup& g : params.groups) {
    TORCH_INTERNAL_ASSERT(g.m >= 0 && g.kk >= 0 && g.kk % 16 == 0,
                          "run_grouped_gemm_cublaslt_fp8: bad group shape m=", g.m, " kk=", g.kk);
    nonempty += g.m > 0 && g.kk > 0;
  }
  const StreamSplit split = split_streams(env, nonempty);
  const size_t out_size = element_size(params.output_type);
  const cudaDataType_t out = cuda_type(params.output_type);
  const bool block = is_block_scaling(params.a_scaling) || is_block_scaling(params.b_scaling);

  Fp8GemmResult result{true};
  std::vector<LtCall> calls;
  std::vector<PlanKey> keys;
  calls.reserve(nonempty);
  keys.reserve(nonempty);
  for (const Fp8GemmGroup& g : params.groups) {
    if (g.m == 0) continue;
    if (g.kk == 0) {
      // Nothing to reduce (wgrad of an empty split): the product is zero.
      TORCH_INTERNAL_ASSERT(g.bias == nullptr, "run_grouped_gemm_cublaslt_fp8: bias with kk=0");
      if (!params.accumulate) {
        TORCHMOE_CUDA_CHECK(cudaMemsetAsync(g.output, 0, g.m * params.n * out_size, env.stream));
      }
      continue;
    }
    LtCall call;
    call.problem = fp8_problem(g, params.n);
    call.output = g.output;
    // cuBLAS's A is our B and its B our A (the product is computed transposed).
    call.pointers.a_scale = g.b_scale_inv;
    call.pointers.b_scale = g.a_scale_inv;
    PlanKey key = plan_key(call.problem, fp8_type(params.b_format), fp8_type(params.a_format), out,
                           CUBLAS_COMPUTE_32F, g.output, split.workspace_per_stream, device);
    key.a_scale_mode = scale_mode(params.b_scaling);
    key.b_scale_mode = scale_mode(params.a_scaling);
    // Block-scaled kernels promote every block anyway and take no fast-accumulation flag.
    key.fast_accumulation = !params.split_accumulator && !block;
    if (g.bias != nullptr && result.bias_applied) {
      set_epilogue(key, CUBLASLT_EPILOGUE_BIAS, g.bias);
      call.pointers.bias = g.bias;
      call.plan = find_plan(key, call.pointers, env.handle);
      // No bias epilogue for these types: the caller adds every bias (so none may be fused).
      result.bias_applied = call.plan != nullptr;
    }
    keys.push_back(key);
    calls.push_back(call);
  }
  for (size_t i = 0; i < calls.size(); ++i) {
    LtCall& call = calls[i];
    if (call.plan != nullptr && (result.bias_applied || call.pointers.bias == nullptr)) continue;
    set_epilogue(keys[i], CUBLASLT_EPILOGUE_DEFAULT, nullptr);
    call.pointers.bias = nullptr;
    call.plan = find_plan(keys[i], call.pointers, env.handle);
    TORCH_CHECK(call.plan != nullptr,
                "torchmoe: cuBLASLt has no FP8 algorithm for m=", call.problem.d_cols,
                ", n=", params.n, ", k=", call.problem.a_rows, " (operands ",
                params.a_format == Fp8Format::kE4M3 ? "e4m3" : "e5m2", " × ",
                params.b_format == Fp8Format::kE4M3 ? "e4m3" : "e5m2", ")");
  }
  launch_calls(calls, params.accumulate ? 1.0f : 0.0f, split, env, device);
  return result;
}

}  // namespace torchmoe::kernels
