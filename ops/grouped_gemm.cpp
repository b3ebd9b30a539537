// The grouped GEMM ops: argument checks, output allocation, and the one decision per layer call
// (plan_grouped_gemms), then a switch on the plan's backend (grouped_gemm_backends.h).

#include "torchmoe/ops/grouped_gemm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "torchmoe/ops/grouped_gemm_backends.h"

namespace torchmoe::ops {
namespace {

using detail::check_groups;
using detail::check_host_splits;
using detail::CheckedGroups;

// ---- argument checks ---------------------------------------------------------------------------

// Device sizes can only be checked for what the host knows without a copy.
void check_device_splits(const char* op, const at::Tensor& m_splits, const at::Tensor& input) {
  TORCH_CHECK(m_splits.device() == input.device(), op, ": m_splits must be on ", input.device(),
              " like the input, or on the host, got ", m_splits.device());
}

// An FP8 plan chose its engine for FP8 operands (the sm90 kernel, e.g., without the 16-bit dtype
// check): its products are the grouped_linear_*_fp8 ops.
void check_16bit_plan(const char* op, const GemmPlan& plan) {
  TORCH_CHECK(!plan.fp8, op, ": plan must be a 16-bit plan (plan_grouped_gemms with fp8 = ",
              "false), got an FP8 plan, whose products are the grouped_linear_*_fp8 ops");
}

void check_rows_operand(const char* op, const char* name, const at::Tensor& t,
                        const GemmPlan& plan) {
  TORCH_CHECK(t.defined() && t.dim() == 2, op, ": ", name, " must be a 2-D [rows, features] tensor",
              t.defined() ? ", got " + std::to_string(t.dim()) + "-D" : std::string());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(t.size(0) == plan.rows, op, ": ", name, " must have the plan's ", plan.rows,
              " rows, got ", t.size(0));
  TORCH_CHECK(t.device() == plan.device && t.scalar_type() == plan.dtype, op, ": ", name,
              " must be a ", plan.dtype, " tensor on ", plan.device,
              " like the planned input, got ", t.scalar_type(), " on ", t.device());
}

// A row map's entries (gather_rows, scatter.rows; its shape checked by the caller): int32/int64,
// contiguous, on the input's device, as the kernels read them.
void check_row_index(const char* op, const char* name, const at::Tensor& map,
                     const c10::Device& device) {
  TORCH_CHECK(map.scalar_type() == at::kInt || map.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", map.scalar_type());
  TORCH_CHECK(map.device() == device, op, ": ", name, " must be on ", device,
              " like the input, got ", map.device());
  TORCH_CHECK(map.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The row map of a gathered input: [rows] int32/int64, contiguous, on the input's device.
void check_gather_rows(const char* op, const at::Tensor& gather_rows, const at::Tensor& input) {
  TORCH_CHECK(gather_rows.dim() == 1, op, ": gather_rows must be a 1-D tensor, got ",
              gather_rows.dim(), "-D");
  check_row_index(op, "gather_rows", gather_rows, input.device());
}

// An input read through gather_rows: any row count (at least one row when rows are gathered).
void check_gathered_input(const char* op, const at::Tensor& input, const at::Tensor& gather_rows,
                          const GemmPlan& plan) {
  TORCH_CHECK(input.defined() && input.dim() == 2, op,
              ": input must be a 2-D [rows, features] tensor",
              input.defined() ? ", got " + std::to_string(input.dim()) + "-D" : std::string());
  TORCH_CHECK(input.is_contiguous(), op, ": input must be contiguous");
  TORCH_CHECK(input.device() == plan.device && input.scalar_type() == plan.dtype, op,
              ": input must be a ", plan.dtype, " tensor on ", plan.device,
              " like the planned input, got ", input.scalar_type(), " on ", input.device());
  check_gather_rows(op, gather_rows, input);
  TORCH_CHECK(gather_rows.size(0) == plan.rows, op, ": gather_rows must have the plan's ",
              plan.rows, " rows, got ", gather_rows.size(0));
  TORCH_CHECK(input.size(0) > 0 || plan.rows == 0, op, ": gather_rows names ", plan.rows,
              " rows of an input that has none");
}

// The input's rows as the grouped operand: the input itself, or its gathered copy (the backends
// other than sm90 read no row map), where a -1 entry (a padding row) is a zero row as the sm90
// kernel reads it.
at::Tensor gathered(const at::Tensor& input, const at::Tensor& gather_rows) {
  if (!gather_rows.defined()) return input;
  return input.index_select(0, gather_rows.clamp_min(0))
      .masked_fill_((gather_rows < 0).unsqueeze(1), 0);
}

// A scattered output's map: [plan rows] int32/int64, contiguous, on the output's device; a
// non-negative row count.
void check_scatter(const char* op, const RowScatter& scatter, const GemmPlan& plan) {
  const at::Tensor& rows = scatter.rows;
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == plan.rows, op, ": scatter.rows must be a 1-D ",
              "tensor of the plan's ", plan.rows, " rows, got ", rows.sizes());
  check_row_index(op, "scatter.rows", rows, plan.device);
  TORCH_CHECK(scatter.target_rows >= 0, op, ": scatter.target_rows must be >= 0, got ",
              scatter.target_rows);
}

// The buffer forward or dgrad writes: the sm90 kernel adds scattered rows into zeros of the
// output's shape; the other backends write [rows, cols] first (zeros past the last group, which
// they leave unwritten, when the rows are added up after: summed_rows).
at::Tensor new_output(const GemmPlan& plan, const RowScatter& scatter, Backend backend,
                      int64_t cols, const at::TensorOptions& options) {
  if (!scatter.defined()) return at::empty({plan.rows, cols}, options);
  if (backend == Backend::kSm90) return at::zeros({scatter.target_rows, cols}, options);
  return at::zeros({plan.rows, cols}, options);
}

// The other backends' scattered output: `rows` added with index_add_, entries -1 or past the
// output into a spare row past its end. At most two adds per output row make the result
// independent of their order (on CUDA index_add_'s atomics), as the sm90 kernel's.
at::Tensor summed_rows(const at::Tensor& rows, const RowScatter& scatter) {
  if (!scatter.defined()) return rows;
  const int64_t target = scatter.target_rows;
  const at::Tensor index = scatter.rows.to(at::kLong);
  const at::Tensor spare = (index < 0).logical_or_(index >= target);
  at::Tensor padded = at::zeros({target + 1, rows.size(1)}, rows.options());
  padded.index_add_(0, index.masked_fill(spare, target), rows);
  return padded.narrow(0, 0, target);  // the leading rows: contiguous
}

CheckedGroups check_weights(const char* op, const GemmPlan& plan, const GroupedTensors& weights,
                            const at::Tensor& like) {
  return check_groups(op, "weights", weights, plan.shape.groups, like, {plan.shape.n, plan.shape.k},
                      like.scalar_type(), "the input's dtype");
}

// Biases or their gradients: none, or G × [n] of the operand's dtype.
CheckedGroups check_vectors(const char* op, const char* what, const GemmPlan& plan,
                            const GroupedTensors& vectors, const at::Tensor& like) {
  if (vectors.empty()) return {};
  return check_groups(op, what, vectors, plan.shape.groups, like, {plan.shape.n},
                      like.scalar_type(), "the input's dtype");
}

// ---- the decision table ------------------------------------------------------------------------

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

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kReference:
      return "reference";
    case Backend::kCublasLt:
      return "cublaslt";
    case Backend::kSm90:
      return "sm90";
    case Backend::kCublasLtGrouped:
      return "cublaslt_grouped";
  }
  return "?";
}

// Why a CUDA backend cannot run this bf16/fp16/fp32 call, or nullptr.
const char* refusal(Backend backend, const at::Tensor& input, const GemmShape& shape,
                    int64_t rows) {
  switch (backend) {
    case Backend::kSm90:
      return detail::sm90_refusal(input, shape, rows);
    case Backend::kCublasLtGrouped:
      return detail::cublaslt_grouped_refusal(input, shape, rows);
    case Backend::kCublasLt:
      return nullptr;
    case Backend::kReference:
      return "it runs CPU tensors only";
  }
  return "unknown backend";
}

// kAuto's candidates per product (indexed by GemmKind: fprop, dgrad, wgrad) for bf16/fp16,
// fastest first, from bench_grouped_linear on the H100 (docs/performance.md, "cuBLASLt grouped
// matmul and kAuto's choice"): the sm90 kernel and the cuBLASLt grouped matmul are level on GPU
// time (sm90 / grouped geomean fprop 1.01, dgrad 1.02, wgrad 0.99, each product ahead or behind by
// up to 10% with the shape and the skew of the splits, which planning does not see), and the
// grouped matmul costs ~30-60 us of host time per call against ~10, which a GroupedMLP of small
// experts does not hide (moe-lm step 1.58 ms vs 0.88). So sm90 leads; the grouped matmul takes what
// sm90 refuses (more than 1024 groups; devices newer than sm_90).
constexpr Backend kAutoOrder16[3][3] = {
    {Backend::kSm90, Backend::kCublasLtGrouped, Backend::kCublasLt},
    {Backend::kSm90, Backend::kCublasLtGrouped, Backend::kCublasLt},
    {Backend::kSm90, Backend::kCublasLtGrouped, Backend::kCublasLt},
};

struct ProductBackends {
  Backend fprop, dgrad, wgrad;
};

Backend auto_backend(kernels::GemmKind kind, const at::Tensor& input, const GemmShape& shape,
                     int64_t rows) {
  if (input.scalar_type() == at::kFloat) return Backend::kCublasLt;
  for (Backend candidate : kAutoOrder16[static_cast<int>(kind)]) {
    if (refusal(candidate, input, shape, rows) == nullptr) return candidate;
  }
  TORCH_INTERNAL_ASSERT(false, "kAuto: per-group cuBLASLt refused a call");
}

Backend forced_backend(GemmBackend c) {
  return c == GemmBackend::kCublasLt          ? Backend::kCublasLt
         : c == GemmBackend::kSm90            ? Backend::kSm90
         : c == GemmBackend::kCublasLtGrouped ? Backend::kCublasLtGrouped
                                              : Backend::kReference;
}

// kAuto's FP8 threshold: experts of at least this many weight elements run per group when host
// sizes are at hand (see select_fp8_backends).
constexpr int64_t kFp8LargeExpert = int64_t{1} << 24;

// FP8 products (ops/grouped_gemm_fp8.h) run on the sm90 kernel, the cuBLASLt grouped matmul (when
// loaded) or per-group cuBLASLt FP8 matmuls; all three products of a call on the same one.
// host_sizes: the call's split sizes are known on the host.
ProductBackends select_fp8_backends(const char* op, const at::Tensor& input, const GemmShape& shape,
                                    int64_t rows, GemmBackend choice, bool host_sizes) {
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
  const Backend backend = forced_backend(choice);
  if (backend == Backend::kCublasLt) return {backend, backend, backend};
  const char* why = backend == Backend::kSm90
                        ? detail::sm90_refusal(input, shape, rows, /*fp8=*/true)
                        : detail::cublaslt_grouped_refusal(input, shape, rows);
  TORCH_CHECK_NOT_IMPLEMENTED(why == nullptr, op, ": the ", backend_name(backend),
                              " grouped GEMM backend cannot run this FP8 call: ", why);
  return {backend, backend, backend};
}

ProductBackends select_backends(const char* op, const at::Tensor& input, const GemmShape& shape,
                                int64_t rows, GemmBackend choice) {
  const at::ScalarType dtype = input.scalar_type();
  if (input.is_cpu() && at::isFloatingType(dtype)) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        choice == GemmBackend::kAuto, op, ": the ", backend_name(forced_backend(choice)),
        " grouped GEMM backend runs on CUDA tensors only, got ", input.device());
    return {Backend::kReference, Backend::kReference, Backend::kReference};
  }
  // The environment overrides kAuto on CUDA only: the CPU has one backend.
  if (choice == GemmBackend::kAuto) choice = env_backend_choice();
  const Backend forced = forced_backend(choice);
  TORCH_CHECK_NOT_IMPLEMENTED(
      input.is_cuda() && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16), op,
      ": no grouped GEMM backend for ", input.device(), " tensors of dtype ", dtype,
      " (supported: CPU floating dtypes; CUDA float32, float16, bfloat16)");
  if (choice != GemmBackend::kAuto) {
    const char* why = refusal(forced, input, shape, rows);
    TORCH_CHECK_NOT_IMPLEMENTED(why == nullptr, op, ": the ", backend_name(forced),
                                " grouped GEMM backend cannot run this call: ", why, " (dtype ",
                                dtype, ", out_features ", shape.n, ", in_features ", shape.k, ", ",
                                shape.groups, " groups)");
    return {forced, forced, forced};
  }
  return {auto_backend(kernels::GemmKind::kFprop, input, shape, rows),
          auto_backend(kernels::GemmKind::kDgrad, input, shape, rows),
          auto_backend(kernels::GemmKind::kWgrad, input, shape, rows)};
}

bool reads_device_splits(Backend backend) {
  return backend == Backend::kSm90 || backend == Backend::kCublasLtGrouped;
}

}  // namespace

// ---- GroupedTensors, SplitSizes
// ------------------------------------------------------------------

GroupedTensors GroupedTensors::stacked(const at::Tensor& all) {
  TORCH_CHECK(all.defined() && all.dim() >= 1, "GroupedTensors::stacked: needs a [G, ...] tensor");
  GroupedTensors tensors;
  tensors.stacked_ = all;
  return tensors;
}

size_t GroupedTensors::size() const {
  return is_stacked() ? static_cast<size_t>(stacked_.size(0)) : separate_.size();
}

at::Tensor GroupedTensors::operator[](size_t g) const {
  return is_stacked() ? stacked_.select(0, static_cast<int64_t>(g)) : separate_[g];
}

namespace detail {

int64_t split_sum_within(const char* op, c10::IntArrayRef m_splits, int64_t bound) {
  int64_t sum = 0;
  bool above = false;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    TORCH_CHECK(m_splits[g] >= 0, op, ": m_splits[", g, "] must be non-negative, got ",
                m_splits[g]);
    above = above || m_splits[g] > bound - sum;
    if (!above) sum += m_splits[g];
  }
  return above ? -1 : sum;
}

void check_host_splits(const char* op, c10::IntArrayRef m_splits, int64_t rows) {
  const int64_t sum = split_sum_within(op, m_splits, rows);
  TORCH_CHECK(sum == rows, op, ": m_splits must sum to the number of rows (", rows, "), got ",
              m_splits, sum < 0 ? " (sum above it)" : " (sum " + std::to_string(sum) + ")");
}

const void* CheckedGroups::data(size_t g) const {
  if (tensors.is_stacked()) {
    return static_cast<const char*>(tensors.stacked_tensor().const_data_ptr()) + g * group_bytes;
  }
  return tensors.separate()[g].const_data_ptr();
}

void* CheckedGroups::mutable_data(size_t g) const { return const_cast<void*>(data(g)); }

// Tensor g of a per-group list named `what`. The messages name it `what[g]` and are only
// formatted on failure: building names for 128 experts on every call cost microseconds.
void check_group_tensor(const char* op, const char* what, size_t g, const at::Tensor& t,
                        const at::Tensor& like, c10::IntArrayRef shape, at::ScalarType dtype,
                        const char* dtype_rule) {
  TORCH_CHECK(t.defined(), op, ": ", what, "[", g, "] must be a defined tensor");
  TORCH_CHECK(t.device() == like.device(), op, ": ", what, "[", g, "] must be on ", like.device(),
              " like the input, got ", t.device());
  TORCH_CHECK(t.sizes() == shape, op, ": ", what, "[", g, "] must have shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, "[", g, "] must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", what, "[", g, "] must have ", dtype_rule, " ",
              dtype, ", got ", t.scalar_type());
}

// Checks the G tensors of `tensors` against shape and dtype and finds their layout in the same
// pass: with 128 experts, separate passes over the list were a visible part of a call's host time.
CheckedGroups check_groups(const char* op, const char* what, const GroupedTensors& tensors,
                           size_t groups, const at::Tensor& like, c10::IntArrayRef shape,
                           at::ScalarType dtype, const char* dtype_rule) {
  TORCH_CHECK(tensors.size() == groups, op, ": ", what, " must hold one tensor per group (", groups,
              "), got ", tensors.size());
  CheckedGroups checked;
  checked.tensors = tensors;
  if (tensors.is_stacked()) {
    const at::Tensor& all = tensors.stacked_tensor();
    std::vector<int64_t> stacked_shape{static_cast<int64_t>(groups)};
    stacked_shape.insert(stacked_shape.end(), shape.begin(), shape.end());
    check_group_tensor(op, what, 0, all, like, stacked_shape, dtype, dtype_rule);
    checked.group_bytes = all.numel() / static_cast<int64_t>(groups) * all.element_size();
    checked.aligned = reinterpret_cast<uintptr_t>(all.const_data_ptr()) % 16 == 0 &&
                      checked.group_bytes % 16 == 0;
    if (checked.group_bytes > 0) {
      checked.spaced.base = all.const_data_ptr();
      checked.spaced.group_stride = static_cast<int64_t>(checked.group_bytes) / all.element_size();
    }
    return checked;
  }
  const at::TensorList list = tensors.separate();
  intptr_t base = 0, step = 0;
  bool spaced = true;
  for (size_t g = 0; g < list.size(); ++g) {
    check_group_tensor(op, what, g, list[g], like, shape, dtype, dtype_rule);
    const auto address = reinterpret_cast<intptr_t>(list[g].const_data_ptr());
    checked.aligned &= address % 16 == 0;
    if (g == 0) {
      base = address;
      checked.group_bytes = list[0].numel() * list[0].element_size();
      step = list.size() > 1 ? 0 : static_cast<intptr_t>(checked.group_bytes);
    } else if (g == 1) {
      step = address - base;
    }
    spaced &= address == base + static_cast<intptr_t>(g) * step;
  }
  if (spaced && step > 0 && step % 16 == 0) {
    checked.spaced.base = list[0].const_data_ptr();
    checked.spaced.group_stride = step / list[0].element_size();
  }
  return checked;
}

}  // namespace detail

std::vector<GemmPlan> plan_grouped_gemms(const char* op, const at::Tensor& input,
                                         c10::ArrayRef<GemmShape> shapes,
                                         const SplitSizes& m_splits, GemmBackend choice,
                                         const at::Tensor& gather_rows, bool fp8) {
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
  if (gather_rows.defined()) check_gather_rows(op, gather_rows, input);
  const int64_t rows = gather_rows.defined() ? gather_rows.size(0) : input.size(0);
  const size_t groups = shapes[0].groups;
  TORCH_CHECK(m_splits.size() == groups, op, ": m_splits must have num_gemms=", groups,
              " entries, got ", m_splits.size());
  if (m_splits.has_device()) check_device_splits(op, m_splits.device(), input);
  std::vector<GemmPlan> plans(shapes.size());
  bool host_needed = false, device_needed = false;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const ProductBackends backends =
        fp8 ? select_fp8_backends(op, input, shapes[i], rows, choice, m_splits.has_host())
            : select_backends(op, input, shapes[i], rows, choice);
    plans[i].fp8 = fp8;
    plans[i].backend = backends.fprop;
    plans[i].dgrad_backend = backends.dgrad;
    plans[i].wgrad_backend = backends.wgrad;
    plans[i].shape = shapes[i];
    plans[i].rows = rows;
    plans[i].dtype = input.scalar_type();
    plans[i].device = input.device();
    for (Backend b : {backends.fprop, backends.dgrad, backends.wgrad}) {
      (reads_device_splits(b) ? device_needed : host_needed) = true;
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

at::Tensor grouped_linear_forward(const GemmPlan& plan, const at::Tensor& input,
                                  const GroupedTensors& weights, const GroupedTensors& biases,
                                  const at::Tensor& gather_rows, const RowScatter& scatter) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_forward";
  check_16bit_plan(op, plan);
  if (gather_rows.defined()) {
    check_gathered_input(op, input, gather_rows, plan);
  } else {
    check_rows_operand(op, "input", input, plan);
  }
  TORCH_CHECK(input.size(1) == plan.shape.k, op, ": input must have ", plan.shape.k,
              " features, got ", input.size(1));
  const CheckedGroups w = check_weights(op, plan, weights, input);
  const CheckedGroups b = check_vectors(op, "biases", plan, biases, input);
  if (scatter.defined()) check_scatter(op, scatter, plan);
  at::Tensor output = new_output(plan, scatter, plan.backend, plan.shape.n, input.options());
  switch (plan.backend) {
    case Backend::kSm90:
      detail::sm90_forward(plan, input, gather_rows, w, b, output, scatter);
      return output;
    case Backend::kReference:
      detail::reference_forward(plan, gathered(input, gather_rows), w, b, output);
      return summed_rows(output, scatter);
    case Backend::kCublasLt:
      detail::cublaslt_forward(plan, gathered(input, gather_rows), w, b, output);
      return summed_rows(output, scatter);
    case Backend::kCublasLtGrouped:
      detail::cublaslt_grouped_forward(plan, gathered(input, gather_rows), w, b, output);
      return summed_rows(output, scatter);
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled Backend");
}

at::Tensor grouped_linear_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                                const GroupedTensors& weights, const RowScatter& scatter) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_dgrad";
  check_16bit_plan(op, plan);
  check_rows_operand(op, "grad_output", grad_output, plan);
  TORCH_CHECK(grad_output.size(1) == plan.shape.n, op, ": grad_output must have ", plan.shape.n,
              " features, got ", grad_output.size(1));
  const CheckedGroups w = check_weights(op, plan, weights, grad_output);
  if (scatter.defined()) check_scatter(op, scatter, plan);
  at::Tensor grad_input =
      new_output(plan, scatter, plan.dgrad_backend, plan.shape.k, grad_output.options());
  switch (plan.dgrad_backend) {
    case Backend::kSm90:
      detail::sm90_dgrad(plan, grad_output, w, grad_input, scatter);
      return grad_input;
    case Backend::kReference:
      detail::reference_dgrad(plan, grad_output, w, grad_input);
      return summed_rows(grad_input, scatter);
    case Backend::kCublasLt:
      detail::cublaslt_dgrad(plan, grad_output, w, grad_input);
      return summed_rows(grad_input, scatter);
    case Backend::kCublasLtGrouped:
      detail::cublaslt_grouped_dgrad(plan, grad_output, w, grad_input);
      return summed_rows(grad_input, scatter);
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled Backend");
}

void grouped_bias_grad(const GemmPlan& plan, const at::Tensor& grad_output,
                       const GroupedTensors& bias_grads_out) {
  constexpr const char* op = "torchmoe::ops::grouped_bias_grad";
  check_rows_operand(op, "grad_output", grad_output, plan);
  TORCH_CHECK(grad_output.size(1) == plan.shape.n, op, ": grad_output must have ", plan.shape.n,
              " features, got ", grad_output.size(1));
  TORCH_CHECK(!bias_grads_out.empty(), op, ": bias_grads_out must hold one tensor per group");
  const CheckedGroups b = check_vectors(op, "bias_grads_out", plan, bias_grads_out, grad_output);
  if (reads_device_splits(plan.wgrad_backend)) {
    detail::device_bias_grad(plan, grad_output, b);
  } else {
    detail::host_bias_grad(plan.m_splits.host(), grad_output, b);
  }
}

void grouped_linear_wgrad(const GemmPlan& plan, const at::Tensor& input,
                          const at::Tensor& grad_output, const GroupedTensors& weight_grads_out,
                          bool accumulate, const GroupedTensors& bias_grads_out,
                          const at::Tensor& gather_rows) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_wgrad";
  check_16bit_plan(op, plan);
  if (gather_rows.defined()) {
    check_gathered_input(op, input, gather_rows, plan);
  } else {
    check_rows_operand(op, "input", input, plan);
  }
  check_rows_operand(op, "grad_output", grad_output, plan);
  TORCH_CHECK(input.size(1) == plan.shape.k && grad_output.size(1) == plan.shape.n, op,
              ": input and grad_output must have ", plan.shape.k, " and ", plan.shape.n,
              " features, got ", input.size(1), " and ", grad_output.size(1));
  TORCH_CHECK(!weight_grads_out.empty(), op, ": weight_grads_out must hold one tensor per group");
  const at::ScalarType grad_type = weight_grads_out[0].scalar_type();
  TORCH_CHECK(grad_type == input.scalar_type() || grad_type == at::kFloat, op,
              ": weight_grads_out must have the input's dtype ", input.scalar_type(),
              " or float32, got ", grad_type);
  // Adding into a 16-bit buffer would round twice (cuBLASLt's beta = 1 epilogue was measured
  // rounding the product before the add); accumulation is for fp32 main-grad buffers.
  TORCH_CHECK(!accumulate || grad_type == at::kFloat || grad_type == at::kDouble, op,
              ": accumulate requires float32 (or float64) weight_grads_out, got ", grad_type);
  const CheckedGroups dw =
      check_groups(op, "weight_grads_out", weight_grads_out, plan.shape.groups, input,
                   {plan.shape.n, plan.shape.k}, grad_type, "weight_grads_out[0]'s dtype");
  const CheckedGroups db = check_vectors(op, "bias_grads_out", plan, bias_grads_out, input);
  switch (plan.wgrad_backend) {
    case Backend::kSm90:
      detail::sm90_wgrad(plan, input, gather_rows, grad_output, dw, accumulate);
      if (!db.empty()) detail::device_bias_grad(plan, grad_output, db);
      return;
    case Backend::kReference:
      detail::reference_wgrad(plan, gathered(input, gather_rows), grad_output, dw, accumulate);
      if (!db.empty()) detail::host_bias_grad(plan.m_splits.host(), grad_output, db);
      return;
    case Backend::kCublasLt:
      detail::cublaslt_wgrad(plan, gathered(input, gather_rows), grad_output, dw, accumulate, db);
      return;
    case Backend::kCublasLtGrouped:
      detail::cublaslt_grouped_wgrad(plan, gathered(input, gather_rows), grad_output, dw,
                                     accumulate);
      if (!db.empty()) detail::device_bias_grad(plan, grad_output, db);
      return;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled Backend");
}

}  // namespace torchmoe::ops
