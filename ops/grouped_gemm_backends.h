#pragma once
// The backends behind ops/grouped_gemm.h (internal, not installed). grouped_gemm_plan.cpp makes
// the plan, grouped_tensors.cpp holds the shared checks, grouped_gemm.cpp validates, allocates and
// switches on the plan; each function here runs one product on arguments that are already checked,
// for one backend:
//   grouped_gemm_reference.cpp  CPU, per-group ATen (the reference)
//   grouped_gemm_cublaslt.cpp   per-group cuBLASLt over a pool of streams (host splits)
//   grouped_gemm_sm90.cpp       torchmoe's one-launch sm90 kernel (device splits)
//   grouped_gemm_cublaslt_grouped.cpp
//                               one cuBLASLt grouped matmul per product (cuBLASLt >= 13.8 loaded;
//                               device splits)

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "torchmoe/kernels/grouped_gemm_cublaslt.h"
#include "torchmoe/kernels/grouped_gemm_cublaslt_grouped.h"
#include "torchmoe/kernels/grouped_gemm_sm90.h"
#include "torchmoe/kernels/types.h"
#include "torchmoe/ops/grouped_gemm.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops::detail {

// A per-group tensor list after its checking pass, with what that pass found about its layout.
struct CheckedGroups {
  GroupedTensors tensors;
  bool aligned = true;  // every group's data starts on a 16-byte boundary
  // Base and stride (elements) when the groups are equally spaced (a stacked tensor, or views of
  // one buffer); else empty. The sm90 kernel then addresses them without a pointer table.
  kernels::GroupAddress spaced;
  size_t group_bytes = 0;  // one group's tensor
  // Separate tensors' data, read in the checking pass: the launches' later passes (pointer tables
  // and their keys) read this array instead of G tensors again (with 128 experts, each pass over
  // the tensors cost ~1 us of a GPU host's time, mostly cache misses).
  std::vector<const void*> pointers;

  size_t size() const { return tensors.size(); }
  bool empty() const { return tensors.empty(); }
  // Group g's data (no tensor view is made: 128 of them per call would cost microseconds).
  const void* data(size_t g) const;
  void* mutable_data(size_t g) const;
};

// Checks the G tensors of `tensors` (each of `shape` and `dtype`, contiguous, on like's device;
// `dtype_rule` says where the dtype comes from in messages, e.g. "the input's dtype") and finds
// their layout in the same pass.
CheckedGroups check_groups(const char* op, const char* what, const GroupedTensors& tensors,
                           size_t groups, const at::Tensor& like, c10::IntArrayRef shape,
                           at::ScalarType dtype, const char* dtype_rule);

// "sm90", "cublaslt", ...: the names TORCHMOE_GROUPED_GEMM_BACKEND takes, for messages.
const char* backend_name(GemmBackend backend);

// The backends that read the device sizes (the others loop over host sizes).
inline bool reads_device_splits(GemmBackend backend) {
  return backend == GemmBackend::kSm90 || backend == GemmBackend::kCublasLtGrouped;
}

// A row map's entries (gather_rows, scatter.rows; its shape checked by the caller): int32/int64,
// contiguous, on `device`, as the kernels read them.
void check_row_index(const char* op, const char* name, const at::Tensor& map,
                     const c10::Device& device);
// The row map of a gathered input: [rows] int32/int64, contiguous, on the input's device.
void check_gather_rows(const char* op, const at::Tensor& gather_rows, const at::Tensor& input);

// Σ m_splits after checking that each is non-negative, or -1 once the running sum passes `bound`
// (sizes near 2^62 would wrap an int64 sum around to a small one).
int64_t split_sum_within(const char* op, c10::IntArrayRef m_splits, int64_t bound);

// Host sizes for backends that loop over groups on the host: non-negative, summing to `rows`
// (they cannot clamp as the device-split engines do).
void check_host_splits(const char* op, c10::IntArrayRef m_splits, int64_t rows);

// Calls fn(g, first_row, rows) for every group of host sizes, in order.
template <typename Fn>
void for_each_group(c10::IntArrayRef m_splits, Fn&& fn) {
  int64_t first_row = 0;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    fn(g, first_row, m_splits[g]);
    first_row += m_splits[g];
  }
}

// db_g = Σ_rows dy_g with host sizes, one at::sum per group (fp32 accumulation for 16-bit data,
// one rounding, zeros for an empty group): every backend's bias gradient when host sizes are at
// hand and no fused epilogue produced it.
void host_bias_grad(c10::IntArrayRef m_splits, const at::Tensor& grad_output,
                    const CheckedGroups& bias_grads);

void reference_forward(const GemmPlan& plan, const at::Tensor& input, const CheckedGroups& weights,
                       const CheckedGroups& biases, at::Tensor& output);
void reference_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                     const CheckedGroups& weights, at::Tensor& grad_input);
void reference_wgrad(const GemmPlan& plan, const at::Tensor& input, const at::Tensor& grad_output,
                     const CheckedGroups& weight_grads, bool accumulate);

// What a per-group cuBLASLt call runs with, on the current device (the caller sets it): the
// current stream, side streams for up to `nonempty` matmuls, and a workspace from the caching
// allocator (stream-ordered, recycled between calls), which `workspace` keeps alive.
struct CublasLtLaunch {
  kernels::CublasLtEnv env;
  at::Tensor workspace;
};
CublasLtLaunch cublaslt_launch(const at::Tensor& like, size_t nonempty);
// Runs params' groups, one cuBLASLt matmul each (plans cached), on the current stream of like's
// device and side streams for the non-empty ones.
kernels::GroupedGemmResult run_cublaslt(const at::Tensor& like, kernels::GroupedGemmParams params);

void cublaslt_forward(const GemmPlan& plan, const at::Tensor& input, const CheckedGroups& weights,
                      const CheckedGroups& biases, at::Tensor& output);
void cublaslt_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                    const CheckedGroups& weights, at::Tensor& grad_input);
// Also writes the bias gradients (fused into the GEMM epilogue where cuBLASLt can).
void cublaslt_wgrad(const GemmPlan& plan, const at::Tensor& input, const at::Tensor& grad_output,
                    const CheckedGroups& weight_grads, bool accumulate,
                    const CheckedGroups& bias_grads);

// Shared by the device-split backends (defined in grouped_gemm_sm90.cpp):
// `t` itself when it starts on a 16-byte boundary, else a contiguous copy that does.
at::Tensor aligned_operand(const at::Tensor& t);
// Where each group's tensor lives: base and stride when equally spaced, else a device table of
// pointers cached for the life of the process (the same tensors give the same table).
kernels::GroupAddress group_address(const CheckedGroups& groups);

// The fields that every device-split kernel's parameters (16-bit and FP8, sm90 and cuBLASLt
// grouped) take from a plan: kind, shape and the device sizes.
template <typename Params>
Params device_split_fields(kernels::GemmKind kind, const GemmPlan& plan) {
  const at::Tensor& splits = plan.m_splits.device();
  Params p;
  p.kind = kind;
  p.num_groups = static_cast<int>(plan.shape.groups);
  p.rows = plan.rows;
  p.n = plan.shape.n;
  p.k = plan.shape.k;
  p.m_splits = splits.const_data_ptr();
  p.splits_int32 = splits.scalar_type() == at::kInt;
  return p;
}

// device_split_fields and the 16-bit kernels' types (kernels::Sm90GemmParams,
// kernels::CublasLtGroupedParams): the plan's dtype in and out.
template <typename Params>
Params device_split_params(kernels::GemmKind kind, const GemmPlan& plan) {
  auto p = device_split_fields<Params>(kind, plan);
  p.input_type = kernel_type(plan.dtype);
  p.output_type = p.input_type;
  return p;
}

// Why the sm90 kernel cannot run a layer of this dtype and shape on the input's device, or
// nullptr when it can. rows: of the grouped operands (the input's, or its gathered rows'). fp8:
// the FP8 products, whose operands are quantized from any floating dtype.
const char* sm90_refusal(const at::Tensor& input, const GemmShape& shape, int64_t rows,
                         bool fp8 = false);
// The split sizes as the device-split backends read them, on the input's device: the device sizes
// (int32 or int64) as given, else one asynchronous upload of the host sizes.
at::Tensor device_splits(const SplitSizes& m_splits, const at::Tensor& input);
// gather_rows: undefined, or the checked row map of a gathered input; scatter: undefined, or the
// checked map of a scattered output, which then holds zeros (ops/grouped_gemm.h).
void sm90_forward(const GemmPlan& plan, const at::Tensor& input, const at::Tensor& gather_rows,
                  const CheckedGroups& weights, const CheckedGroups& biases, at::Tensor& output,
                  const RowScatter& scatter);
void sm90_dgrad(const GemmPlan& plan, const at::Tensor& grad_output, const CheckedGroups& weights,
                at::Tensor& grad_input, const RowScatter& scatter);
void sm90_wgrad(const GemmPlan& plan, const at::Tensor& input, const at::Tensor& gather_rows,
                const at::Tensor& grad_output, const CheckedGroups& weight_grads, bool accumulate);
// db_g with the device sizes (one kernel, no host sync): the bias gradient of both
// device-split backends.
void device_bias_grad(const GemmPlan& plan, const at::Tensor& grad_output,
                      const CheckedGroups& bias_grads);

// Why one cuBLASLt grouped matmul per product cannot run a layer of this dtype and shape on the
// input's device (the loaded cuBLASLt is older than 13.8, among others), or nullptr when it can.
// It reads no row map: a gathered input is copied first.
const char* cublaslt_grouped_refusal(const at::Tensor& input, const GemmShape& shape, int64_t rows);
void cublaslt_grouped_forward(const GemmPlan& plan, const at::Tensor& input,
                              const CheckedGroups& weights, const CheckedGroups& biases,
                              at::Tensor& output);
void cublaslt_grouped_dgrad(const GemmPlan& plan, const at::Tensor& grad_output,
                            const CheckedGroups& weights, at::Tensor& grad_input);
void cublaslt_grouped_wgrad(const GemmPlan& plan, const at::Tensor& input,
                            const at::Tensor& grad_output, const CheckedGroups& weight_grads,
                            bool accumulate);
// One FP8 product as one grouped matmul (ops/grouped_gemm_fp8.cpp fills the parameters), on the
// current stream of like's device.
void cublaslt_grouped_fp8(const at::Tensor& like, const kernels::CublasLtGroupedFp8Params& p);
// One FP8 product on the sm90 kernel (ops/grouped_gemm_fp8.cpp fills the parameters but the
// workspaces), on the current stream of like's device.
void sm90_fp8(const at::Tensor& like, kernels::Sm90Fp8GemmParams p);

}  // namespace torchmoe::ops::detail
