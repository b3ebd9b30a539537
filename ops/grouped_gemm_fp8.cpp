// The FP8 grouped linear products: operand checks, where each group's operand and scales start in
// split_quantize's layouts, and one per-group cuBLASLt FP8 call per product.

#include "torchmoe/ops/grouped_gemm_fp8.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "torchmoe/kernels/grouped_gemm_cublaslt.h"
#include "torchmoe/kernels/grouped_gemm_cublaslt_grouped.h"
#include "torchmoe/kernels/grouped_gemm_sm90.h"
#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/grouped_gemm_backends.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

using detail::backend_name;
using kernels::is_block_scaling;

constexpr const char* kForwardOp = "torchmoe::ops::grouped_linear_forward_fp8";
constexpr const char* kDgradOp = "torchmoe::ops::grouped_linear_dgrad_fp8";
constexpr const char* kWgradOp = "torchmoe::ops::grouped_linear_wgrad_fp8";

// An FP8 plan, with the sizes its product's backend reads (plan_grouped_gemms gives them).
void check_plan(const char* op, const GemmPlan& plan, GemmBackend backend) {
  TORCH_CHECK(plan.fp8, op, ": needs an FP8 plan (plan_grouped_gemms with Fp8GemmOptions)");
  TORCH_CHECK(
      detail::reads_device_splits(backend) ? plan.m_splits.has_device() : plan.m_splits.has_host(),
      op, ": the plan runs this product on ", backend_name(backend), ", whose split sizes ",
      "it does not hold (plans come from plan_grouped_gemms)");
}

// An operand quantized as the plan's options for its tensor say: the plan chose the product's
// backend for those (a B operand of another scaling could reach a kernel that does not take it).
void check_quantized_as(const char* op, const char* name, const SplitQuantized& q,
                        const SplitQuantizeOptions& planned) {
  TORCH_CHECK(q.format == planned.format && q.scaling == planned.scaling, op, ": ", name,
              " must be quantized as the plan's FP8 options say (", format_name(planned.format),
              ", ", scaling_name(planned.scaling), "), got ", format_name(q.format), ", ",
              scaling_name(q.scaling));
}

// The sizes a check can see without a device-to-host copy: the host sizes, or none.
c10::IntArrayRef known_sizes(const GemmPlan& plan) {
  return plan.m_splits.has_host() ? plan.m_splits.host() : c10::IntArrayRef();
}

// One copy of a quantized [rows, k] operand of `groups` splits: present, of split_quantize's sizes
// and dtype, on the plan's device. sizes: the host sizes, or empty when only the device has them.
void check_operand(const char* op, const char* name, const SplitQuantized& q, bool rowwise,
                   int64_t rows, int64_t k, int64_t groups, c10::IntArrayRef sizes,
                   const c10::Device& device) {
  const at::Tensor& data = rowwise ? q.data : q.columnwise_data;
  const at::Tensor& scales =
      rowwise || !is_block_scaling(q.scaling) ? q.scale_inv : q.columnwise_scale_inv;
  const char* copy = rowwise ? "rowwise" : "columnwise";
  TORCH_CHECK(data.defined(), op, ": ", name, " must have its ", copy,
              " copy (split_quantize with ", copy, " = true)");
  // The columnwise buffer is exact for host sizes and a bound for device sizes.
  int64_t numel = rows * k;
  if (!rowwise) {
    numel = sizes.empty() ? kernels::columnwise_elements(rows, k, groups) : 0;
    for (int64_t m : sizes) numel += k * kernels::round_up_columnwise(m);
  }
  TORCH_CHECK((rowwise ? data.numel() == numel : data.numel() >= numel) && data.is_contiguous(), op,
              ": ", name, "'s ", copy, " data must be split_quantize's for [", rows, ", ", k,
              "] in ", groups, " splits (", numel, " contiguous elements), got ", data.sizes());
  // TMA and cuBLASLt take operands and block scales on 16-byte boundaries, as split_quantize
  // allocates them (a view of its buffers may start elsewhere).
  const auto data_offset = reinterpret_cast<uintptr_t>(data.const_data_ptr()) % 16;
  TORCH_CHECK(data_offset == 0, op, ": ", name, "'s ", copy,
              " data must start on a 16-byte boundary, got an address ", data_offset, " mod 16");
  TORCH_CHECK(data.scalar_type() == fp8_dtype(q.format), op, ": ", name, "'s data must be ",
              fp8_dtype(q.format), " (its format), got ", data.scalar_type());
  TORCH_CHECK(data.device() == device, op, ": ", name, " must be on ", device, ", got ",
              data.device());
  const int64_t scale_count =
      !is_block_scaling(q.scaling)
          ? groups
          : (rowwise ? kernels::rowwise_block_scales(q.scaling, rows, k, groups)
                     : kernels::columnwise_block_scales(q.scaling, rows, k, groups));
  TORCH_CHECK(scales.defined() && scales.numel() == scale_count &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.device() == device,
              op, ": ", name, "'s ", copy, " scale_inv must be ", scale_count,
              " contiguous float32 values on ", device);
  const auto scales_offset = reinterpret_cast<uintptr_t>(scales.const_data_ptr()) % 16;
  TORCH_CHECK(!is_block_scaling(q.scaling) || scales_offset == 0, op, ": ", name, "'s ", copy,
              " block scales must start on a 16-byte boundary, got an address ", scales_offset,
              " mod 16");
}

// The two operands of one product: FP8 kernels exist for e4m3 × e4m3, e4m3 × e5m2 and per-tensor
// × per-tensor, 1x128 × 1x128 or 1x128 × 128×128 scales.
void check_pair(const char* op, const char* a_name, const SplitQuantized& a, const char* b_name,
                const SplitQuantized& b) {
  TORCH_CHECK_NOT_IMPLEMENTED(a.format == Fp8Format::kE4M3 || b.format == Fp8Format::kE4M3, op,
                              ": ", a_name, " and ", b_name,
                              " are both e5m2; FP8 GEMMs need at least one e4m3 operand");
  TORCH_CHECK_NOT_IMPLEMENTED(is_block_scaling(a.scaling) == is_block_scaling(b.scaling), op, ": ",
                              a_name, " and ", b_name,
                              " must both have per-tensor scales or both block scales");
  TORCH_CHECK_NOT_IMPLEMENTED(
      !(a.scaling == QuantizeScaling::kBlock128x128 && b.scaling == QuantizeScaling::kBlock128x128),
      op, ": ", a_name, " and ", b_name,
      " both have 128x128 block scales; cuBLASLt multiplies 1x128 by 1x128 or 128x128 blocks only");
}

// Where each group's operand and scales start in one copy of split_quantize's layout, for
// splits of `sizes` rows of width k (kernels/split_quantize.h).
struct OperandGroups {
  std::vector<const void*> data;
  std::vector<const float*> scale_inv;
  at::Tensor aligned_scales;  // per-tensor scalings: what scale_inv points into
};

OperandGroups operand_groups(const SplitQuantized& q, bool rowwise, c10::IntArrayRef sizes,
                             int64_t k) {
  using kernels::block_count;
  using kernels::round_up4;
  const auto* data =
      static_cast<const uint8_t*>((rowwise ? q.data : q.columnwise_data).const_data_ptr());
  OperandGroups out;
  const float* scales = nullptr;
  if (is_block_scaling(q.scaling)) {
    // Every split's block scales start on a 16-byte boundary (the layouts' r4 padding).
    scales = (rowwise ? q.scale_inv : q.columnwise_scale_inv).const_data_ptr<float>();
  } else {
    // cublasLtMatmul refuses scale pointers that are not 16-byte aligned (measured: status
    // NOT_SUPPORTED at 4-byte offsets, cuBLAS 13.1, H100): each split's scale_inv goes to its own
    // 16 bytes, one small copy per operand.
    out.aligned_scales = at::constant_pad_nd(q.scale_inv.view({-1, 1}), {0, 3});
    scales = out.aligned_scales.const_data_ptr<float>();
  }
  const int64_t kb = block_count(k);
  out.data.reserve(sizes.size());
  out.scale_inv.reserve(sizes.size());
  // Running sums over the splits before g: rows, r16(rows), r4(rows), row blocks, r4(row blocks).
  int64_t rows = 0, rows16 = 0, rows4 = 0, blocks = 0, blocks4 = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    out.data.push_back(data + k * (rowwise ? rows : rows16));
    int64_t offset = 4 * static_cast<int64_t>(g);  // per-tensor: one scale per 16 bytes
    if (q.scaling == QuantizeScaling::kBlock1x128) {
      offset = rowwise ? kb * rows4 : round_up4(k) * blocks;
    } else if (q.scaling == QuantizeScaling::kBlock128x128) {
      offset = rowwise ? round_up4(kb) * blocks : kb * blocks4;
    }
    out.scale_inv.push_back(scales + offset);
    const int64_t m = sizes[g];
    rows += m;
    rows16 += kernels::round_up_columnwise(m);
    rows4 += round_up4(m);
    blocks += block_count(m);
    blocks4 += round_up4(block_count(m));
  }
  return out;
}

kernels::Fp8GroupedGemmParams product_params(const SplitQuantized& a, const SplitQuantized& b,
                                             int64_t n, at::ScalarType output_dtype) {
  kernels::Fp8GroupedGemmParams p;
  p.n = n;
  p.a_format = a.format;
  p.b_format = b.format;
  p.a_scaling = a.scaling;
  p.b_scaling = b.scaling;
  p.output_type = kernel_type(output_dtype);
  return p;
}

// Where fprop's and dgrad's output rows go. cublasLtMatmul has no algorithm for a 1x128-scaled
// operand on the rows side whose row count is not a multiple of 4 (measured, cuBLAS 13.1, H100:
// 36, 40, 44 rows run, 2, 37, 38, 129 do not; the scales' layout pads each split to a multiple of
// 4 rows). Such a product runs every split as r4(m_g) rows into a padded output, and the real rows
// are gathered from it: the extra rows read the next split's data (or the three rows of slack
// split_quantize leaves past the last one) and land in rows that are dropped.
struct OutputRows {
  bool padded = false;
  std::vector<int64_t> gemm_rows;  // rows each split's GEMM computes
  std::vector<int64_t> first;      // each split's first row in the GEMM's output
  int64_t total = 0;               // rows of the GEMM's output
};

OutputRows output_rows(const SplitQuantized& rows_operand, c10::IntArrayRef sizes) {
  OutputRows out;
  for (int64_t m : sizes) {
    out.padded |= rows_operand.scaling == QuantizeScaling::kBlock1x128 && m % 4 != 0;
  }
  if (out.padded) {
    const at::Tensor& d = rows_operand.data;
    const int64_t needed = (d.storage_offset() + (d.size(0) + 3) * d.size(1)) * d.element_size();
    TORCH_CHECK(static_cast<int64_t>(d.storage().nbytes()) >= needed,
                "torchmoe FP8 grouped GEMM: a 1x128-scaled operand whose splits are not multiples ",
                "of 4 rows must keep split_quantize's three rows of slack past its end (its ",
                "per-group products read them), got a buffer of ", d.storage().nbytes(),
                " bytes where ", needed, " are needed (clone() and to() drop the slack)");
  }
  for (int64_t m : sizes) {
    const int64_t rows = out.padded ? kernels::round_up4(m) : m;
    out.gemm_rows.push_back(rows);
    out.first.push_back(out.total);
    out.total += rows;
  }
  return out;
}

// The [rows, n] result from a padded GEMM output: one gather of the real rows.
at::Tensor unpad_rows(const at::Tensor& padded, const OutputRows& layout, c10::IntArrayRef sizes) {
  std::vector<int64_t> index;
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t r = 0; r < sizes[g]; ++r) index.push_back(layout.first[g] + r);
  }
  const at::Tensor device_index =
      at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(padded.device(), true);
  return padded.index_select(0, device_index);
}

// The fields of a device-split FP8 product (kernels::Sm90Fp8GemmParams,
// kernels::CublasLtGroupedFp8Params): kind, formats, shape, sizes, operands and their scales.
template <typename Params>
Params device_fp8_params(kernels::GemmKind kind, const GemmPlan& plan, const SplitQuantized& a,
                         bool a_rowwise, const SplitQuantized& b, bool b_rowwise,
                         at::ScalarType output_dtype) {
  auto p = detail::device_split_fields<Params>(kind, plan);
  p.a_format = a.format;
  p.b_format = b.format;
  p.output_type = kernel_type(output_dtype);
  p.a = (a_rowwise ? a.data : a.columnwise_data).const_data_ptr();
  p.b = (b_rowwise ? b.data : b.columnwise_data).const_data_ptr();
  p.a_scale_inv = a.scale_inv.const_data_ptr<float>();
  p.b_scale_inv = b.scale_inv.const_data_ptr<float>();
  return p;
}

// The sm90 kernel's fields: device_fp8_params plus the scalings, and each operand's block scales
// from the copy it reads.
kernels::Sm90Fp8GemmParams sm90_fp8_params(kernels::GemmKind kind, const GemmPlan& plan,
                                           const SplitQuantized& a, bool a_rowwise,
                                           const SplitQuantized& b, bool b_rowwise,
                                           at::ScalarType output_dtype) {
  auto p = device_fp8_params<kernels::Sm90Fp8GemmParams>(kind, plan, a, a_rowwise, b, b_rowwise,
                                                         output_dtype);
  p.a_scaling = a.scaling;
  p.b_scaling = b.scaling;
  if (!a_rowwise && is_block_scaling(a.scaling)) {
    p.a_scale_inv = a.columnwise_scale_inv.const_data_ptr<float>();
  }
  if (!b_rowwise && is_block_scaling(b.scaling)) {
    p.b_scale_inv = b.columnwise_scale_inv.const_data_ptr<float>();
  }
  return p;
}

kernels::Fp8GemmResult run(const at::Tensor& like, const kernels::Fp8GroupedGemmParams& params) {
  size_t nonempty = 0;
  for (const auto& g : params.groups) nonempty += g.m > 0 && g.kk > 0;
  const detail::CublasLtLaunch launch = detail::cublaslt_launch(like, nonempty);
  return kernels::run_grouped_gemm_cublaslt_fp8(params, launch.env);
}

// fprop and dgrad as one cuBLASLt FP8 matmul per split, with host sizes: out[rows of g, width] =
// a_g [m_g, reduction] · b_g[width, reduction]ᵀ, a the rowwise copy of x or dy, b the weights'
// rowwise (fprop) or columnwise (dgrad) copy; biases (fprop) none or one per group. Runs 1x128
// row operands padded to 4 rows (OutputRows) and returns the real rows.
at::Tensor per_group_rows_product(const SplitQuantized& a, const SplitQuantized& weights,
                                  bool weights_rowwise, c10::IntArrayRef sizes, int64_t width,
                                  int64_t reduction, at::ScalarType output_dtype,
                                  bool split_accumulator, const detail::CheckedGroups& biases) {
  const std::vector<int64_t> weight_sizes(sizes.size(), weights_rowwise ? width : reduction);
  const OutputRows layout = output_rows(a, sizes);
  at::Tensor output = new_empty({layout.total, width}, a.data.options().dtype(output_dtype));
  const OperandGroups ag = operand_groups(a, true, sizes, reduction);
  const OperandGroups bg =
      operand_groups(weights, weights_rowwise, weight_sizes, weights_rowwise ? reduction : width);
  kernels::Fp8GroupedGemmParams p = product_params(a, weights, width, output_dtype);
  p.split_accumulator = split_accumulator;
  const size_t out_size = output.element_size();
  for (size_t g = 0; g < sizes.size(); ++g) {
    kernels::Fp8GemmGroup group;
    group.m = sizes[g] == 0 ? 0 : layout.gemm_rows[g];
    group.kk = reduction;
    group.a = ag.data[g];
    group.b = bg.data[g];
    group.a_scale_inv = ag.scale_inv[g];
    group.b_scale_inv = bg.scale_inv[g];
    group.output = static_cast<char*>(output.data_ptr()) + layout.first[g] * width * out_size;
    group.bias = biases.empty() ? nullptr : biases.data(g);
    p.groups.push_back(group);
  }
  const kernels::Fp8GemmResult result = run(output, p);
  if (layout.padded) output = unpad_rows(output, layout, sizes);
  if (!biases.empty() && !result.bias_applied) {
    detail::for_each_group(sizes, [&](size_t g, int64_t first, int64_t rows) {
      if (rows > 0) output.narrow(0, first, rows).add_(biases.tensors[g]);
    });
  }
  return output;
}

// wgrad as one cuBLASLt FP8 matmul per split, with host sizes: dW_g [n, k] = dy_gᵀ · x_g from the
// columnwise copies, the reduction over each split's rows rounded up to the columnwise blocks
// (split_quantize pads them with zeros).
void per_group_wgrad(c10::IntArrayRef sizes, const SplitQuantized& input,
                     const SplitQuantized& grad_output, const detail::CheckedGroups& out, int64_t n,
                     int64_t k, at::ScalarType out_dtype, bool accumulate, bool split_accumulator) {
  const OperandGroups a = operand_groups(grad_output, false, sizes, n);
  const OperandGroups b = operand_groups(input, false, sizes, k);
  kernels::Fp8GroupedGemmParams p = product_params(grad_output, input, k, out_dtype);
  p.accumulate = accumulate;
  p.split_accumulator = split_accumulator;
  detail::for_each_group(sizes, [&](size_t g, int64_t, int64_t rows) {
    kernels::Fp8GemmGroup group;
    group.m = n;
    group.kk = kernels::round_up_columnwise(rows);
    group.a = a.data[g];
    group.b = b.data[g];
    group.a_scale_inv = a.scale_inv[g];
    group.b_scale_inv = b.scale_inv[g];
    group.output = out.mutable_data(g);
    p.groups.push_back(group);
  });
  run(out.tensors[0], p);
}

void check_output_dtype(const char* op, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": the output dtype must be float32, float16 or bfloat16, got ", dtype);
}

}  // namespace

at::Tensor grouped_linear_forward_fp8(const GemmPlan& plan, const SplitQuantized& input,
                                      const SplitQuantized& weights, const GroupedTensors& biases,
                                      at::ScalarType output_dtype) {
  check_plan(kForwardOp, plan, plan.backend);
  check_output_dtype(kForwardOp, output_dtype);
  const int64_t n = plan.shape.n, k = plan.shape.k, groups = plan.shape.groups;
  const std::vector<int64_t> weight_sizes(static_cast<size_t>(groups), n);
  check_operand(kForwardOp, "input", input, true, plan.rows, k, groups, known_sizes(plan),
                plan.device);
  check_operand(kForwardOp, "weights", weights, true, groups * n, k, groups, weight_sizes,
                plan.device);
  check_pair(kForwardOp, "input", input, "weights", weights);
  check_quantized_as(kForwardOp, "input", input, plan.fp8->input);
  check_quantized_as(kForwardOp, "weights", weights, plan.fp8->weight);
  // None, or one per group in the output dtype: checked once here for every backend.
  const detail::CheckedGroups checked_biases =
      biases.empty() ? detail::CheckedGroups{}
                     : detail::check_groups(kForwardOp, "biases", biases, groups, input.data, {n},
                                            output_dtype, "the output dtype");
  const bool split = plan.fp8->fprop_split_accumulator;
  const c10::cuda::CUDAGuard guard(plan.device);
  switch (plan.backend) {
    case GemmBackend::kSm90: {
      at::Tensor output = new_empty({plan.rows, n}, input.data.options().dtype(output_dtype));
      if (plan.rows == 0) return output;
      auto p = sm90_fp8_params(kernels::GemmKind::kFprop, plan, input, true, weights, true,
                               output_dtype);
      p.output = output.data_ptr();
      p.split_accumulator = split;
      if (!biases.empty()) p.bias = detail::group_address(checked_biases);
      detail::sm90_fp8(output, p);
      return output;
    }
    case GemmBackend::kCublasLtGrouped: {
      at::Tensor output = new_empty({plan.rows, n}, input.data.options().dtype(output_dtype));
      auto p = device_fp8_params<kernels::CublasLtGroupedFp8Params>(
          kernels::GemmKind::kFprop, plan, input, true, weights, true, output_dtype);
      p.output = output.data_ptr();
      p.split_accumulator = split;
      if (!biases.empty()) p.bias = detail::group_address(checked_biases);
      if (plan.rows > 0) detail::cublaslt_grouped_fp8(output, p);
      return output;
    }
    default:
      return per_group_rows_product(input, weights, true, plan.m_splits.host(), n, k, output_dtype,
                                    split, checked_biases);
  }
}

at::Tensor grouped_linear_dgrad_fp8(const GemmPlan& plan, const SplitQuantized& grad_output,
                                    const SplitQuantized& weights, at::ScalarType output_dtype) {
  check_plan(kDgradOp, plan, plan.dgrad_backend);
  check_output_dtype(kDgradOp, output_dtype);
  const int64_t n = plan.shape.n, k = plan.shape.k, groups = plan.shape.groups;
  const std::vector<int64_t> weight_sizes(static_cast<size_t>(groups), n);
  check_operand(kDgradOp, "grad_output", grad_output, true, plan.rows, n, groups, known_sizes(plan),
                plan.device);
  check_operand(kDgradOp, "weights", weights, false, groups * n, k, groups, weight_sizes,
                plan.device);
  check_pair(kDgradOp, "grad_output", grad_output, "weights", weights);
  check_quantized_as(kDgradOp, "grad_output", grad_output, plan.fp8->grad_output);
  check_quantized_as(kDgradOp, "weights", weights, plan.fp8->weight);
  const bool split = plan.fp8->dgrad_split_accumulator;
  const c10::cuda::CUDAGuard guard(plan.device);
  if (!detail::reads_device_splits(plan.dgrad_backend)) {
    return per_group_rows_product(grad_output, weights, false, plan.m_splits.host(), k, n,
                                  output_dtype, split, {});
  }
  at::Tensor grad_input = new_empty({plan.rows, k}, grad_output.data.options().dtype(output_dtype));
  if (plan.rows == 0) return grad_input;
  if (plan.dgrad_backend == GemmBackend::kSm90) {
    // dgrad is the fprop product over the weights' columnwise copy, [G, k, n]: k output
    // columns, a reduction over n.
    auto p = sm90_fp8_params(kernels::GemmKind::kFprop, plan, grad_output, true, weights, false,
                             output_dtype);
    std::swap(p.n, p.k);
    p.output = grad_input.data_ptr();
    p.split_accumulator = split;
    detail::sm90_fp8(grad_input, p);
  } else {
    auto p = device_fp8_params<kernels::CublasLtGroupedFp8Params>(
        kernels::GemmKind::kDgrad, plan, grad_output, true, weights, false, output_dtype);
    p.output = grad_input.data_ptr();
    p.split_accumulator = split;
    detail::cublaslt_grouped_fp8(grad_input, p);
  }
  return grad_input;
}

void grouped_linear_wgrad_fp8(const GemmPlan& plan, const SplitQuantized& input,
                              const SplitQuantized& grad_output,
                              const GroupedTensors& weight_grads_out, bool accumulate) {
  check_plan(kWgradOp, plan, plan.wgrad_backend);
  const int64_t n = plan.shape.n, k = plan.shape.k, groups = plan.shape.groups;
  check_operand(kWgradOp, "grad_output", grad_output, false, plan.rows, n, groups,
                known_sizes(plan), plan.device);
  check_operand(kWgradOp, "input", input, false, plan.rows, k, groups, known_sizes(plan),
                plan.device);
  check_pair(kWgradOp, "grad_output", grad_output, "input", input);
  check_quantized_as(kWgradOp, "grad_output", grad_output, plan.fp8->grad_output);
  check_quantized_as(kWgradOp, "input", input, plan.fp8->input);
  TORCH_CHECK(weight_grads_out.size() == static_cast<size_t>(groups), kWgradOp,
              ": weight_grads_out must hold one tensor per group (", groups, "), got ",
              weight_grads_out.size());
  const at::ScalarType out_dtype = weight_grads_out[0].scalar_type();
  check_output_dtype(kWgradOp, out_dtype);
  TORCH_CHECK(!accumulate || out_dtype == at::kFloat, kWgradOp,
              ": accumulating needs float32 weight_grads_out (main-grad), got ", out_dtype);
  const detail::CheckedGroups checked = detail::check_groups(
      kWgradOp, "weight_grads_out", weight_grads_out, static_cast<size_t>(groups),
      input.columnwise_data, {n, k}, out_dtype, "weight_grads_out[0]'s dtype");
  const bool split = plan.fp8->wgrad_split_accumulator;
  const c10::cuda::CUDAGuard guard(plan.device);
  if (!detail::reads_device_splits(plan.wgrad_backend)) {
    per_group_wgrad(plan.m_splits.host(), input, grad_output, checked, n, k, out_dtype, accumulate,
                    split);
    return;
  }
  if (plan.rows == 0) {  // nothing to read: every group is empty
    if (!accumulate) {
      for (int64_t g = 0; g < groups; ++g) weight_grads_out[static_cast<size_t>(g)].zero_();
    }
    return;
  }
  TORCH_CHECK(checked.aligned, kWgradOp, ": weight_grads_out must start on 16-byte boundaries");
  if (plan.wgrad_backend == GemmBackend::kSm90) {
    auto p = sm90_fp8_params(kernels::GemmKind::kWgrad, plan, grad_output, false, input, false,
                             out_dtype);
    p.weight_grad = detail::group_address(checked);
    p.accumulate = accumulate;
    p.split_accumulator = split;
    detail::sm90_fp8(weight_grads_out[0], p);
  } else {
    auto p = device_fp8_params<kernels::CublasLtGroupedFp8Params>(
        kernels::GemmKind::kWgrad, plan, grad_output, false, input, false, out_dtype);
    p.weight_grad = detail::group_address(checked);
    p.accumulate = accumulate;
    p.split_accumulator = split;
    detail::cublaslt_grouped_fp8(weight_grads_out[0], p);
  }
}

}  // namespace torchmoe::ops
