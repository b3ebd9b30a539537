// One cuBLASLt grouped matmul per product; contract in grouped_gemm_cublaslt_grouped.h.
//
// The device arrays of one call (`env.arrays`), written by setup_groups_kernel from the splits:
//
//   a[G] b[G] c[G] d[G]   void*   the groups' A, B, C and D in cuBLAS's column-major view (C and D
//                                 hold the same pointers: beta = 1 adds to what D holds)
//   a_rows a_cols ...     int32   rows and columns of each; the leading dimension is the rows
//   d_rows d_cols
//   starts[G + 1]         int64   first row of each group (clamped), the last entry the end
//   scalars[2]            fp32    alpha = 1 and beta (1 to accumulate, else 0), device pointer mode
//   a_scale[G] b_scale[G] float*  FP8: each group's scale pointer for cuBLAS's A and B
//
// Group g of kind    A (rows × cols)      B (rows × cols)      D (rows × cols)
//   kFprop  (TN)     W_g     (k × n)      x rows  (k × m_g)    y rows   (n × m_g)
//   kDgrad  (NN)     W_g     (k × n)      dy rows (n × m_g)    dx rows  (k × m_g)
//   kWgrad  (NT)     x rows  (k × m_g)    dy rows (n × m_g)    dW_g     (k × n)

#include "torchmoe/kernels/grouped_gemm_cublaslt_grouped.h"

#include <dlfcn.h>

#include <cub/block/block_scan.cuh>

#include <array>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/grouped_gemm_cublaslt.h"  // cuda_type

namespace torchmoe::kernels {
namespace {

// Attributes of cuBLAS >= 13.3 that the toolkit's headers may lack (values from cuBLAS 13.10's
// cublasLt.h; cuBLAS keeps enum values stable across minor versions).
constexpr auto kPrefAverageReduction = static_cast<cublasLtMatmulPreferenceAttributes_t>(13);
constexpr auto kPrefAverageRowsD = static_cast<cublasLtMatmulPreferenceAttributes_t>(14);
constexpr auto kPrefAverageColsD = static_cast<cublasLtMatmulPreferenceAttributes_t>(15);

// cublasLtGroupedMatrixLayoutInit_internal(layout, size, type, groups, rows, cols, ld).
using GroupedLayoutInit = cublasStatus_t (*)(cublasLtMatrixLayout_t, size_t, cudaDataType, int,
                                             const void*, const void*, const void*);

// Storage for a layout descriptor: cuBLAS 13.10's takes 112 bytes, more than the 64 of older
// headers' cublasLtMatrixLayoutOpaque_t; the init call fails cleanly if a later one needs more.
struct LayoutStorage {
  alignas(16) uint64_t data[64];
  cublasLtMatrixLayout_t get() { return reinterpret_cast<cublasLtMatrixLayout_t>(data); }
};

struct GroupedApi {
  LoadedCublasLt info;
  GroupedLayoutInit layout_init = nullptr;
};

const GroupedApi& grouped_api() {
  static const GroupedApi api = [] {
    GroupedApi a;
    a.info.version = cublasLtGetVersion();
    // The library that this process resolved cuBLASLt's symbols to (a preloaded one wins over
    // the one torch's wheel brings), found through one of its functions.
    Dl_info dl{};
    if (dladdr(reinterpret_cast<void*>(&cublasLtGetVersion), &dl) != 0 && dl.dli_fname != nullptr) {
      a.info.library = dl.dli_fname;
      if (void* handle = dlopen(dl.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
        a.layout_init = reinterpret_cast<GroupedLayoutInit>(
            dlsym(handle, "cublasLtGroupedMatrixLayoutInit_internal"));
        dlclose(handle);  // drops the reference taken by RTLD_NOLOAD; the library stays loaded
      }
    }
    a.info.grouped = a.info.version >= kCublasLtGroupedMinVersion && a.layout_init != nullptr;
    return a;
  }();
  return api;
}

// The arrays in env.arrays (see the file comment).
struct GroupArrays {
  const void** a;
  const void** b;
  const void** c;
  void** d;
  int32_t* ints;  // a_rows, a_cols, b_rows, b_cols, d_rows, d_cols, G each
  int64_t* starts;
  float* scalars;
  const float** a_scale;
  const float** b_scale;
};

// The arrays placed from `base` on, in the file comment's order, each 16-byte aligned; `bytes`,
// when given, receives the size they take.
GroupArrays group_arrays(uintptr_t base, int groups, size_t* bytes = nullptr) {
  const auto g = static_cast<size_t>(groups);
  uintptr_t at = base;
  const auto take = [&](size_t size) {
    const uintptr_t start = at;
    at += (size + 15) / 16 * 16;
    return start;
  };
  GroupArrays arrays;
  arrays.a = reinterpret_cast<const void**>(take(g * sizeof(void*)));
  arrays.b = reinterpret_cast<const void**>(take(g * sizeof(void*)));
  arrays.c = reinterpret_cast<const void**>(take(g * sizeof(void*)));
  arrays.d = reinterpret_cast<void**>(take(g * sizeof(void*)));
  arrays.ints = reinterpret_cast<int32_t*>(take(6 * g * sizeof(int32_t)));
  arrays.starts = reinterpret_cast<int64_t*>(take((g + 1) * sizeof(int64_t)));
  arrays.scalars = reinterpret_cast<float*>(take(2 * sizeof(float)));
  arrays.a_scale = reinterpret_cast<const float**>(take(g * sizeof(void*)));
  arrays.b_scale = reinterpret_cast<const float**>(take(g * sizeof(void*)));
  if (bytes != nullptr) *bytes = at - base;
  return arrays;
}

__device__ __forceinline__ const char* group_bytes(const GroupAddress& a, int g, size_t elem) {
  if (a.table != nullptr) return static_cast<const char*>(a.table[g]);
  return static_cast<const char*>(a.base) + static_cast<int64_t>(g) * a.group_stride * elem;
}

constexpr int kSetupThreads = 1024;

// Writes group g's A, B and D (C is D) in cuBLAS's view and their shapes, a_rows, a_cols,
// b_rows, b_cols, d_rows, d_cols (the file comment's table).
__device__ __forceinline__ void put_group(const GroupArrays& out, int g, int G, const void* a,
                                          const void* b, void* d, const int64_t (&shape)[6]) {
  out.a[g] = a;
  out.b[g] = b;
  out.c[g] = d;
  out.d[g] = d;
  for (int i = 0; i < 6; ++i) out.ints[i * G + g] = static_cast<int32_t>(shape[i]);
}

// Group g of a 16-bit call, from its first row `start` and clamped size m. in, outs: the element
// sizes of input_type and output_type.
__device__ __forceinline__ void place_group(const CublasLtGroupedParams& p, const GroupArrays& out,
                                            int g, int64_t start, int64_t m, int64_t /*start16*/,
                                            size_t in, size_t outs) {
  const int G = p.num_groups;
  const int64_t n = p.n, k = p.k;
  const auto* x = static_cast<const char*>(p.input);
  const auto* dy = static_cast<const char*>(p.grad_output);
  auto* y = static_cast<char*>(p.output);  // y or dx
  switch (p.kind) {
    case GemmKind::kFprop:
      put_group(out, g, G, group_bytes(p.weight, g, in), x + start * k * in, y + start * n * outs,
                {k, n, k, m, n, m});
      break;
    case GemmKind::kDgrad:
      put_group(out, g, G, group_bytes(p.weight, g, in), dy + start * n * in, y + start * k * outs,
                {k, n, n, m, k, m});
      break;
    case GemmKind::kWgrad:
      put_group(out, g, G, x + start * k * in, dy + start * n * in,
                const_cast<char*>(group_bytes(p.weight_grad, g, outs)), {k, m, n, m, k, n});
      break;
  }
}

// Group g of an FP8 call: TN for every kind (see the header), and its scale pointers. start16: the
// first row of its columnwise block (wgrad), the running sum of r16(m_h) before it.
__device__ __forceinline__ void place_group(const CublasLtGroupedFp8Params& p,
                                            const GroupArrays& out, int g, int64_t start, int64_t m,
                                            int64_t start16, size_t /*in*/, size_t outs) {
  const int G = p.num_groups;
  const int64_t n = p.n, k = p.k, m16 = (m + 15) / 16 * 16;
  const auto* a = static_cast<const char*>(p.a);
  const auto* b = static_cast<const char*>(p.b);
  auto* y = static_cast<char*>(p.output);  // y or dx
  switch (p.kind) {
    case GemmKind::kFprop:  // A' = W_g, B' = x rows, D = y rows
      put_group(out, g, G, b + g * n * k, a + start * k, y + start * n * outs, {k, n, k, m, n, m});
      break;
    case GemmKind::kDgrad:  // A' = W_gᵀ (columnwise), B' = dy rows, D = dx rows
      put_group(out, g, G, b + g * n * k, a + start * n, y + start * k * outs, {n, k, n, m, k, m});
      break;
    case GemmKind::kWgrad:  // A' = xᵀ block, B' = dyᵀ block, D = dW_g
      put_group(out, g, G, b + start16 * k, a + start16 * n,
                const_cast<char*>(group_bytes(p.weight_grad, g, outs)), {m16, k, m16, n, k, n});
      break;
  }
  // cuBLAS's A is our B and its B our A (the product is computed transposed).
  out.a_scale[g] = p.b_scale_inv + g;
  out.b_scale[g] = p.a_scale_inv + g;
}

// One block: a running scan of the clamped split sizes over chunks of kSetupThreads groups and,
// FP8, a second running sum, of r16(m_g), which places the columnwise blocks; then each group's
// entries (place_group).
template <typename Params>
__global__ void __launch_bounds__(kSetupThreads)
    setup_groups_kernel(const Params p, const GroupArrays out, size_t in, size_t outs) {
  constexpr bool kFp8 = std::is_same_v<Params, CublasLtGroupedFp8Params>;
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int G = p.num_groups;
  int64_t carry = 0, carry16 = 0;
  for (int base = 0; base < G; base += kSetupThreads) {
    const int g = base + static_cast<int>(threadIdx.x);
    const int64_t split = g < G ? split_at(p.m_splits, p.splits_int32, g, p.rows) : 0;
    int64_t before = 0, chunk_total = 0;
    Scan(scan_storage).ExclusiveSum(split, before, chunk_total);
    __syncthreads();  // scan_storage is reused by the next scan
    const int64_t start = min(carry + before, p.rows);
    const int64_t m = min(split, p.rows - start);  // split is 0 past the last group
    int64_t start16 = 0;
    if constexpr (kFp8) {
      // r16 of the clamped sizes needs the clamped start first: a second scan over them.
      int64_t before16 = 0, chunk16 = 0;
      Scan(scan_storage).ExclusiveSum((m + 15) / 16 * 16, before16, chunk16);
      __syncthreads();
      start16 = carry16 + before16;
      carry16 += chunk16;
    }
    if (g < G) {
      out.starts[g] = start;
      place_group(p, out, g, start, m, start16, in, outs);
    }
    carry += chunk_total;
  }
  if (threadIdx.x == 0) {
    out.starts[G] = min(carry, p.rows);
    out.scalars[0] = 1.0f;
    out.scalars[1] = p.accumulate ? 1.0f : 0.0f;
  }
}

// wgrad without accumulation: an empty group's dW_g is zero. Blocks of other groups return at
// once, so the common case costs one small launch; the grouped matmul does not promise to write
// a group whose reduction is empty.
constexpr int kZeroBlocksPerGroup = 32;

__global__ void zero_empty_groups_kernel(const int32_t* reduction, GroupAddress dw, size_t elem,
                                         int64_t bytes, int groups) {
  for (int g = blockIdx.y; g < groups; g += gridDim.y) {
    if (reduction[g] != 0) continue;
    auto* dst = reinterpret_cast<uint4*>(const_cast<char*>(group_bytes(dw, g, elem)));
    const int64_t vectors = bytes / 16;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[i] = make_uint4(0, 0, 0, 0);
    }
  }
}

// Empty groups' weight gradients zeroed (wgrad without accumulation). `reduction`: each group's
// reduction length, as the setup kernel wrote it.
void zero_empty_groups(const int32_t* reduction, const GroupAddress& weight_grad,
                       ScalarType output_type, int64_t n, int64_t k, int groups,
                       cudaStream_t stream) {
  const dim3 grid(kZeroBlocksPerGroup, std::min(groups, kMaxGridY));
  const size_t elem = element_size(output_type);
  zero_empty_groups_kernel<<<grid, 256, 0, stream>>>(reduction, weight_grad, elem,
                                                     n * k * static_cast<int64_t>(elem), groups);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

// y[r] = product[r] + b_g for every row r of group g, rounded once (rows past the last group are
// left alone). The product is the fp32 GEMM output; the row's group is found by binary search in
// starts[0..G].
template <typename T>
__global__ void add_bias_kernel(T* y, const float* product, int64_t rows, int64_t n,
                                GroupAddress bias, const int64_t* starts, int groups) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int lo = 0, hi = groups + 1;  // first index with starts[index] > r
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (starts[mid] <= r) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    const int g = lo - 1;
    if (g < 0 || g >= groups) continue;
    const T* b = group_ptr<T>(bias, g);
    const float* src = product + r * n;
    T* dst = y + r * n;
    for (int64_t c = 2 * threadIdx.x; c < n; c += 2 * blockDim.x) {
      const float2 v = *reinterpret_cast<const float2*>(src + c);
      store2(dst + c, v.x + to_float(b[c]), v.y + to_float(b[c + 1]));
    }
  }
}

// add_bias_kernel on `type`'s output y.
void launch_add_bias(void* y, ScalarType type, const float* product, int64_t rows, int64_t n,
                     GroupAddress bias, const int64_t* starts, int groups, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(rows, 8 * sm_count()));
  dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    add_bias_kernel<T>
        <<<blocks, 256, 0, stream>>>(static_cast<T*>(y), product, rows, n, bias, starts, groups);
  });
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

// The matmul descriptor and algorithm for one call shape, found once per host thread.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);  // host memory only; failure is not actionable
  }
};

using PlanKey = std::array<int64_t, 11>;

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = 0;
    for (int64_t v : key) h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return h;
  }
};

struct Layouts {
  LayoutStorage a, b, c, d;
};

// What the 16-bit and the FP8 grouped matmuls differ in, besides their setup kernels: the
// operands' types and the descriptor's attributes, the fields of the plan cache's key that stand
// for them, and where wgrad's reduction lengths are. run_grouped does the rest for both.
struct MatmulSpec {
  cudaDataType_t a_type, b_type;  // cuBLAS's A and B (C and D have the call's output type)
  size_t input_bytes;             // of an A or B element
  cublasComputeType_t compute;
  cublasOperation_t trans_a, trans_b;
  bool scaled = false;      // FP8: per-group scalar scales through the pointer arrays
  bool fast_accum = false;  // FP8: CUBLASLT_MATMUL_DESC_FAST_ACCUM (no split accumulation)
  // Key fields: the kind (FP8's negative, so that the two never share a plan; see find_plan),
  // the operand types and the one option that changes the descriptor (TF32, fast accumulation).
  int64_t key_kind, key_types, key_option;
  // Which of arrays.ints' G-entry runs (a_rows, a_cols, ...) holds wgrad's reduction lengths.
  int reduction_run;
};

MatmulSpec matmul_spec(const CublasLtGroupedParams& p) {
  MatmulSpec s;
  s.a_type = s.b_type = cuda_type(p.input_type);
  s.input_bytes = element_size(p.input_type);
  s.compute = p.input_type == ScalarType::kFloat32 && p.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                   : CUBLAS_COMPUTE_32F;
  s.trans_a = p.kind == GemmKind::kFprop ? CUBLAS_OP_T : CUBLAS_OP_N;
  s.trans_b = p.kind == GemmKind::kWgrad ? CUBLAS_OP_T : CUBLAS_OP_N;
  s.key_kind = static_cast<int64_t>(p.kind);
  s.key_types = static_cast<int64_t>(p.input_type);
  s.key_option = p.allow_tf32;
  s.reduction_run = 1;  // a_cols: wgrad's A is x's rows of the group (k × m_g)
  return s;
}

// TN for every kind; cuBLAS's A is our B and its B our A (the product is computed transposed).
MatmulSpec matmul_spec(const CublasLtGroupedFp8Params& p) {
  MatmulSpec s;
  s.a_type = p.b_format == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
  s.b_type = p.a_format == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
  s.input_bytes = 1;
  s.compute = CUBLAS_COMPUTE_32F;
  s.trans_a = CUBLAS_OP_T;
  s.trans_b = CUBLAS_OP_N;
  s.scaled = true;
  s.fast_accum = !p.split_accumulator;
  s.key_kind = -1 - static_cast<int64_t>(p.kind);
  s.key_types = static_cast<int64_t>(p.a_format) * 2 + static_cast<int64_t>(p.b_format);
  s.key_option = s.fast_accum;
  s.reduction_run = 0;  // a_rows: wgrad's A is x's columnwise block (r16(m_g) × k)
  return s;
}

void init_layouts(Layouts& l, const MatmulSpec& s, ScalarType output_type,
                  const GroupArrays& arrays, int G) {
  const GroupedLayoutInit init = grouped_api().layout_init;
  const cudaDataType_t out = cuda_type(output_type);
  const int32_t* ints = arrays.ints;
  TORCHMOE_CUBLASLT_CHECK(init(l.a.get(), sizeof(l.a.data), s.a_type, G, ints, ints + G, ints));
  TORCHMOE_CUBLASLT_CHECK(
      init(l.b.get(), sizeof(l.b.data), s.b_type, G, ints + 2 * G, ints + 3 * G, ints + 2 * G));
  TORCHMOE_CUBLASLT_CHECK(
      init(l.c.get(), sizeof(l.c.data), out, G, ints + 4 * G, ints + 5 * G, ints + 4 * G));
  TORCHMOE_CUBLASLT_CHECK(
      init(l.d.get(), sizeof(l.d.data), out, G, ints + 4 * G, ints + 5 * G, ints + 4 * G));
}

// Sets a grouped-average preference. The 13.10 header documents uint32_t values while
// TransformerEngine passes int64_t; whichever size this cuBLAS accepts is used.
void set_average(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                 int64_t value) {
  const auto narrow = static_cast<uint32_t>(value);
  if (cublasLtMatmulPreferenceSetAttribute(pref, attr, &narrow, sizeof(narrow)) ==
      CUBLAS_STATUS_SUCCESS) {
    return;
  }
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
}

// What the heuristic is told of a call besides its descriptor and layouts (and, with the spec's
// key fields, the plan cache's key).
struct CallShape {
  GemmKind kind;
  ScalarType output_type;
  int64_t n, k, rows;
  int groups;
};

// The algorithm for a descriptor (16-bit or FP8) and layouts: plan.found says whether there is
// one.
void choose_algorithm(Plan& plan, Layouts& layouts, const CallShape& c, size_t workspace_bytes,
                      cublasLtHandle_t handle) {
  cublasLtMatmulPreference_t pref = nullptr;
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                        cublasStatus_t (*)(cublasLtMatmulPreference_t)>
      pref_owner(pref, cublasLtMatmulPreferenceDestroy);
  const uint64_t workspace = workspace_bytes;
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)));
  // As in the per-group backend: split-K partial sums only in fp32 for 16-bit outputs.
  const uint32_t reductions = c.output_type == ScalarType::kFloat32
                                  ? uint32_t{CUBLASLT_REDUCTION_SCHEME_MASK}
                                  : uint32_t{CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions, sizeof(reductions)));
  // The averages steer the heuristic; the split sizes stay on the device, so the mean group is
  // rows / G.
  const int64_t mean_rows = std::max<int64_t>(1, c.rows / c.groups);
  const bool wgrad = c.kind == GemmKind::kWgrad;
  set_average(pref, kPrefAverageRowsD, c.kind == GemmKind::kFprop ? c.n : c.k);
  set_average(pref, kPrefAverageColsD, wgrad ? c.n : mean_rows);
  set_average(pref, kPrefAverageReduction,
              wgrad ? mean_rows : (c.kind == GemmKind::kFprop ? c.k : c.n));

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, layouts.a.get(), layouts.b.get(),
                                     layouts.c.get(), layouts.d.get(), pref, 1, &result, &found);
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) TORCHMOE_CUBLASLT_CHECK(status);
  plan.found = status == CUBLAS_STATUS_SUCCESS && found > 0;
  plan.algo = result.algo;
}

// cuBLAS >= 13.5's per-group scalar scale mode (absent from older headers).
constexpr int32_t kScalePerBatchScalar = 6;

template <typename T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

// The descriptor: device pointer mode, and for FP8 per-group scalar scales through the pointer
// arrays.
std::unique_ptr<Plan> make_plan(const MatmulSpec& s, const CallShape& shape, Layouts& layouts,
                                const GroupArrays& arrays, size_t workspace_bytes,
                                cublasLtHandle_t handle) {
  auto plan = std::make_unique<Plan>();
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&plan->desc, s.compute, CUDA_R_32F));
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, s.trans_a);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, s.trans_b);
  set_desc(plan->desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_DEVICE);
  if (s.scaled) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, kScalePerBatchScalar);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, kScalePerBatchScalar);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, arrays.a_scale);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, arrays.b_scale);
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{s.fast_accum});
  }
  choose_algorithm(*plan, layouts, shape, workspace_bytes, handle);
  return plan;
}

// The plan for a call, made on a miss. Per host thread, so no locking; bounded because MoE row
// counts may change every step. The 16-bit and FP8 keys share the cache (their kinds differ in
// sign). A call uses the returned plan before it looks up another, so a clear cannot free it.
const Plan& find_plan(const MatmulSpec& s, const CallShape& c, Layouts& layouts,
                      const GroupArrays& arrays, size_t workspace_bytes, cublasLtHandle_t handle) {
  int device = 0;
  TORCHMOE_CUDA_CHECK(cudaGetDevice(&device));
  const PlanKey key{s.key_kind,
                    s.key_types,
                    static_cast<int64_t>(c.output_type),
                    c.n,
                    c.k,
                    c.groups,
                    c.rows / c.groups,
                    s.key_option,
                    static_cast<int64_t>(workspace_bytes),
                    device,
                    reinterpret_cast<int64_t>(handle)};
  thread_local std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> cache;
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= 4096) cache.clear();
    it = cache.emplace(key, make_plan(s, c, layouts, arrays, workspace_bytes, handle)).first;
  }
  return *it->second;
}

const char* kind_name(GemmKind kind) {
  return kind == GemmKind::kFprop ? "fprop" : kind == GemmKind::kDgrad ? "dgrad" : "wgrad";
}

// Both entry points' body, for their checked params.
template <typename Params>
void run_grouped(const Params& p, const CublasLtGroupedEnv& env) {
  const GroupArrays arrays = group_arrays(reinterpret_cast<uintptr_t>(env.arrays), p.num_groups);
  // A bias is added to the fp32 product, rounding once as the fused epilogues of the other
  // backends do (adding it to a rounded 16-bit product measured errors of several percent where
  // product and bias cancel): the matmul then writes env.fprop_product, the bias kernel the output.
  const bool with_bias = p.kind == GemmKind::kFprop && !p.bias.empty();
  Params matmul = p;
  if (with_bias) {
    TORCH_INTERNAL_ASSERT(env.fprop_product != nullptr,
                          "run_grouped_gemm_cublaslt_grouped: a bias needs fprop_product");
    matmul.output = env.fprop_product;
    matmul.output_type = ScalarType::kFloat32;
  }
  const MatmulSpec spec = matmul_spec(matmul);
  const CallShape shape{matmul.kind, matmul.output_type, matmul.n,
                        matmul.k,    matmul.rows,        matmul.num_groups};
  // The plan first: a call refused for want of an algorithm launches nothing (the layouts and the
  // heuristic read only the arrays' addresses, which the setup kernel fills in stream order).
  Layouts layouts;
  init_layouts(layouts, spec, matmul.output_type, arrays, matmul.num_groups);
  const Plan& plan = find_plan(spec, shape, layouts, arrays, env.workspace_bytes, env.handle);
  TORCH_CHECK_NOT_IMPLEMENTED(
      plan.found, "torchmoe: cuBLASLt ", grouped_api().info.version,
      spec.scaled ? " has no grouped FP8 algorithm for " : " has no grouped-matmul algorithm for ",
      kind_name(p.kind), " with ", p.num_groups, " groups, n=", p.n, ", k=", p.k,
      spec.scaled ? "" : " and this dtype");
  setup_groups_kernel<<<1, kSetupThreads, 0, env.stream>>>(matmul, arrays, spec.input_bytes,
                                                           element_size(matmul.output_type));
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
  if (p.kind == GemmKind::kWgrad && !p.accumulate) {
    zero_empty_groups(arrays.ints + spec.reduction_run * p.num_groups, p.weight_grad, p.output_type,
                      p.n, p.k, p.num_groups, env.stream);
  }
  if (spec.scaled) {
    // The pointer arrays are this call's (the plan may come from another call).
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, arrays.a_scale);
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, arrays.b_scale);
  }
  const float* alpha = arrays.scalars;
  const float* beta = arrays.scalars + 1;
  TORCHMOE_CUBLASLT_CHECK(cublasLtMatmul(env.handle, plan.desc, alpha, arrays.a, layouts.a.get(),
                                         arrays.b, layouts.b.get(), beta, arrays.d, layouts.d.get(),
                                         arrays.d, layouts.d.get(), &plan.algo, env.workspace,
                                         env.workspace_bytes, env.stream));
  if (with_bias)
    launch_add_bias(p.output, p.output_type, env.fprop_product, p.rows, p.n, p.bias, arrays.starts,
                    p.num_groups, env.stream);
}

}  // namespace

const LoadedCublasLt& loaded_cublaslt() { return grouped_api().info; }

size_t cublaslt_grouped_array_bytes(int num_groups) {
  size_t bytes = 0;
  group_arrays(0, num_groups, &bytes);
  return bytes;
}

void run_grouped_gemm_cublaslt_grouped(const CublasLtGroupedParams& p,
                                       const CublasLtGroupedEnv& env) {
  TORCH_INTERNAL_ASSERT(grouped_api().info.grouped,
                        "run_grouped_gemm_cublaslt_grouped: the loaded cuBLASLt has no grouped "
                        "matmul (ops must refuse this backend)");
  TORCH_INTERNAL_ASSERT(p.num_groups > 0 && p.n > 0 && p.k > 0 && p.rows > 0,
                        "run_grouped_gemm_cublaslt_grouped: empty call");
  TORCH_INTERNAL_ASSERT(aligned16(env.arrays), "run_grouped_gemm_cublaslt_grouped: arrays");
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(env.workspace) % 256 == 0,
                        "run_grouped_gemm_cublaslt_grouped: workspace");
  run_grouped(p, env);
}

void run_grouped_gemm_cublaslt_grouped_fp8(const CublasLtGroupedFp8Params& p,
                                           const CublasLtGroupedEnv& env) {
  TORCH_INTERNAL_ASSERT(grouped_api().info.grouped,
                        "run_grouped_gemm_cublaslt_grouped_fp8: no grouped matmul loaded");
  TORCH_INTERNAL_ASSERT(
      p.num_groups > 0 && p.n % 16 == 0 && p.k % 16 == 0 && p.n > 0 && p.k > 0 && p.rows > 0,
      "run_grouped_gemm_cublaslt_grouped_fp8: bad call shape");
  TORCH_INTERNAL_ASSERT(p.a_format == Fp8Format::kE4M3 || p.b_format == Fp8Format::kE4M3,
                        "run_grouped_gemm_cublaslt_grouped_fp8: e5m2 × e5m2");
  TORCH_INTERNAL_ASSERT(
      aligned16(env.arrays) && reinterpret_cast<uintptr_t>(env.workspace) % 256 == 0,
      "run_grouped_gemm_cublaslt_grouped_fp8: arrays or workspace misaligned");
  run_grouped(p, env);
}

}  // namespace torchmoe::kernels
