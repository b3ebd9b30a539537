#include "torchmoe/ops/quantize.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/grouped_gemm_backends.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

constexpr const char* kSplitOp = "torchmoe::split_quantize";
constexpr const char* kGatherOp = "torchmoe::gather_split_quantize";
constexpr const char* kGluOp = "torchmoe::glu_split_quantize";
constexpr const char* kGluGradOp = "torchmoe::glu_backward_split_quantize";
constexpr const char* kUpdateOp = "torchmoe::update_delayed_scaling";
constexpr const char* kWeightsOp = "torchmoe::quantize_weights";

// A [G] float32 vector on `device`.
void check_group_vector(const char* op, const char* name, const at::Tensor& t, int64_t groups,
                        const at::Device& device) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a defined tensor");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == groups, op, ": ", name, " must have shape [", groups,
              "] (one per split), got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The options and the delayed-scaling tensors, for `groups` splits on `device`.
void check_options(const char* op, const SplitQuantizeOptions& o, int64_t groups,
                   const at::Device& device, const at::Tensor& scale, const at::Tensor& amax) {
  TORCH_CHECK(groups >= 1 && groups <= kernels::kSplitQuantizeMaxGroups, op,
              ": m_splits must have between 1 and ", kernels::kSplitQuantizeMaxGroups,
              " sizes, got ", groups);
  TORCH_CHECK(o.rowwise || o.columnwise, op,
              ": at least one of rowwise and columnwise must be requested");
  TORCH_CHECK(std::isfinite(o.amax_epsilon) && o.amax_epsilon >= 0.0, op,
              ": amax_epsilon must be finite and non-negative, got ", o.amax_epsilon);
  if (o.scaling == QuantizeScaling::kDelayed) {
    check_group_vector(op, "scale", scale, groups, device);
    if (amax.defined()) check_group_vector(op, "amax", amax, groups, device);
  } else {
    TORCH_CHECK(!scale.defined() && !amax.defined(), op,
                ": scale and amax are inputs of delayed scaling only");
  }
}

// Below this many waves of 128×128 tiles, glu_backward_split_quantize runs its two ops instead of
// the fused launch. A fused unit is a pair of a and b tiles, computed from three loads a piece,
// and holds its block longer than either op's units do, so a launch of few waves leaves more of
// its last one idle (H100, taking turns: moe-lm's 5.2 waves took 1.18x the two ops' time, qwen3's
// 15.5 waves 0.96x; docs/experiments.md).
constexpr double kGluGradientFusedMinWaves = 8.0;

// The fields of a launch's params, besides its source, that choose its kernel and shared memory:
// launch() sets them, and the size rule below asks the wave of the kernel they choose.
void set_kernel_choice(kernels::SplitQuantizeParams& p, at::ScalarType dtype,
                       const SplitQuantizeOptions& o, int groups) {
  p.input_type = kernel_type(dtype);
  p.format = o.format;
  p.scaling = o.scaling;
  p.num_groups = groups;
}

// Whether the tiles of the [rows, width] gradient fill min_waves waves of the fused GLU-gradient
// launch (`glu`, with its input and output gradient set, selects the kernel).
bool glu_gradient_fills_waves(at::ScalarType dtype, int64_t rows, int64_t width, size_t groups,
                              const SplitQuantizeOptions& o, const kernels::GluParams& glu,
                              double min_waves) {
  if (min_waves <= 0.0) return true;
  kernels::SplitQuantizeParams p;
  set_kernel_choice(p, dtype, o, static_cast<int>(groups));
  p.glu = glu;
  const int64_t tiles = kernels::block_count(rows) * kernels::block_count(width);
  return static_cast<double>(tiles) >=
         min_waves * static_cast<double>(kernels::split_quantize_wave_blocks(p));
}

void check_input_type(const char* op, at::ScalarType dtype, int64_t k) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": input must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(k % kernels::kQuantizeFeatureMultiple == 0, op, ": input's features must be a ",
              "multiple of ", kernels::kQuantizeFeatureMultiple, " (FP8 GEMM operands), got ", k);
}

// What `input` holds: the rows to quantize, or a GLU pre-activation (whose layout and types
// detail::glu_kernel_params has checked, an even width included) from which its activation (half
// its width) or its gradient (its width) is quantized.
enum class InputKind { kRows, kGluActivation, kGluGradient };

// The kernel counts tiles and the 1x128 scales' rows in 32 bits (kernels/split_quantize.cu).
void check_kernel_size(const char* op, int64_t rows, int64_t k, int64_t groups) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max() - 3 * groups &&
                  kernels::split_quantize_tiles_bound(static_cast<int>(groups), rows, k) <
                      (int64_t{1} << 27),
              op, ": [", rows, ", ", k, "] in ", groups,
              " splits is too large: at most 2^31 - 1 - ",
              "3 * splits rows and 2^27 128x128 tiles");
}

// gathered_rows: the row count of a gathered input (the splits' bound), else -1.
void check_split_inputs(const char* op, const at::Tensor& input, const SplitSizes& m_splits,
                        const SplitQuantizeOptions& o, const at::Tensor& scale,
                        const at::Tensor& amax, InputKind kind, int64_t gathered_rows = -1) {
  TORCH_CHECK(input.defined() && input.dim() == 2, op, ": input must be a 2-D [rows, ",
              kind == InputKind::kRows ? "features" : "2 * features", "] tensor",
              input.defined() ? ", got " + std::to_string(input.dim()) + "-D" : std::string());
  TORCH_CHECK(input.is_contiguous(), op, ": input must be contiguous");
  check_input_type(op, input.scalar_type(),
                   kind == InputKind::kGluActivation ? input.size(1) / 2 : input.size(1));
  const int64_t groups = static_cast<int64_t>(m_splits.size());
  const int64_t rows = gathered_rows >= 0 ? gathered_rows : input.size(0);
  if (m_splits.has_host()) {
    const int64_t sum = detail::split_sum_within(op, m_splits.host(), rows);
    TORCH_CHECK(sum >= 0, op, ": m_splits must sum to at most the ",
                gathered_rows >= 0 ? "gathered " : "input's ", rows, " rows, got ", m_splits.host(),
                " (sum above it)");
  }
  // The kernel reads the device sizes whenever there are some, also beside host ones.
  if (m_splits.has_device()) {
    TORCH_CHECK(m_splits.device().device() == input.device(), op, ": m_splits must be on ",
                input.device(), " like the input, or on the host, got ",
                m_splits.device().device());
  }
  check_options(op, o, groups, input.device(), scale, amax);
  check_kernel_size(op, rows, input.size(1) / (kind == InputKind::kGluActivation ? 2 : 1), groups);
}

// The ops run on CUDA only; checked after every argument check, so that those are testable on the
// CPU.
void check_cuda(const char* op, const at::Tensor& t) {
  TORCH_CHECK_NOT_IMPLEMENTED(t.is_cuda(), op, ": no backend for ", t.device(),
                              " tensors (CUDA only)");
}

// Σ_g r16(m_g): the columnwise blocks' total width, exact with host sizes, else its bound.
int64_t columnwise_rows(const SplitSizes& m_splits, int64_t rows) {
  if (!m_splits.has_host()) {
    return kernels::columnwise_elements(rows, 1, static_cast<int64_t>(m_splits.size()));
  }
  int64_t total = 0;
  for (int64_t m : m_splits.host()) total += kernels::round_up_columnwise(m);
  return total;
}

// Allocation and launch for checked arguments: `rows` rows of width k split by m_splits, read as
// `p`'s source fields say (input, split_inputs, gather_rows, glu; the rest is filled here); `like`
// gives the input's dtype and device.
SplitQuantized launch(const at::Tensor& like, int64_t rows, int64_t k, const SplitSizes& m_splits,
                      const SplitQuantizeOptions& o, const at::Tensor& scale,
                      const at::Tensor& amax, kernels::SplitQuantizeParams p) {
  const c10::cuda::CUDAGuard guard(like.device());
  const at::Tensor splits = detail::device_splits(m_splits, like);
  const int groups = static_cast<int>(splits.numel());
  const at::TensorOptions fp8 = like.options().dtype(fp8_dtype(o.format));
  const bool block = kernels::is_block_scaling(o.scaling);

  SplitQuantized out;
  // The copies: their own allocations, trimmed by a dispatcher-free alias rather than a narrow
  // (the rowwise copy's slack stays in its storage, where the FP8 GEMMs check for it).
  if (o.rowwise) {
    // kBlock1x128: three rows of slack past the end, which a GEMM of the last split rounded up to
    // a multiple of 4 rows reads (ops/grouped_gemm_fp8.cpp says why).
    const int64_t slack = o.scaling == QuantizeScaling::kBlock1x128 ? 3 : 0;
    out.data =
        alias_storage(new_empty({rows + slack, k}, fp8), fp8_dtype(o.format), {rows, k}, {k, 1}, 0);
  }
  if (o.columnwise) {
    // The kernel reads the device sizes where there are some: the buffer holds their bound, as
    // host sizes beside them cannot be checked against them without a sync, and the copy shows
    // the host sizes' exact width.
    const int64_t width = columnwise_rows(m_splits, rows);
    const int64_t allocated =
        m_splits.has_device() ? kernels::columnwise_elements(rows, 1, groups) : width;
    out.columnwise_data =
        alias_storage(new_empty({k * allocated}, fp8), fp8_dtype(o.format), {k * width}, {1}, 0);
  }
  // The scales, the amax and current scaling's workspace (small, and living with the copies): one
  // allocation (new_empty_packed). The launch zeroes the block scales (their layouts' padding
  // entries are never written; zeros there keep the buffers deterministic).
  const bool own_amax = !amax.defined();
  const bool current = o.scaling == QuantizeScaling::kCurrent;
  const int64_t row_scales = !block      ? groups
                             : o.rowwise ? kernels::rowwise_block_scales(o.scaling, rows, k, groups)
                                         : 0;
  const int64_t column_scales =
      block && o.columnwise ? kernels::columnwise_block_scales(o.scaling, rows, k, groups) : 0;
  std::vector<at::Tensor> small = new_empty_packed(
      {{{row_scales}, at::kFloat},
       {{column_scales}, at::kFloat},
       {{own_amax ? groups : 0}, at::kFloat},
       {{current ? kernels::split_quantize_workspace_ints(groups, rows, k) : 0}, at::kInt}},
      like.device());
  if (!block || o.rowwise) out.scale_inv = std::move(small[0]);
  if (block && o.columnwise) out.columnwise_scale_inv = std::move(small[1]);
  out.amax = own_amax ? std::move(small[2]) : amax;
  out.format = o.format;
  out.scaling = o.scaling;

  set_kernel_choice(p, like.scalar_type(), o, groups);
  p.power_of_2_scales = o.power_of_2_scales;
  p.epsilon = static_cast<float>(o.amax_epsilon);
  p.rows = rows;
  p.k = k;
  p.m_splits = splits.const_data_ptr();
  p.splits_int32 = splits.scalar_type() == at::kInt;
  p.rowwise = o.rowwise ? out.data.data_ptr() : nullptr;
  p.columnwise = o.columnwise ? out.columnwise_data.data_ptr() : nullptr;
  p.scale_inv = out.scale_inv.defined() ? out.scale_inv.data_ptr<float>() : nullptr;
  p.columnwise_scale_inv =
      out.columnwise_scale_inv.defined() ? out.columnwise_scale_inv.data_ptr<float>() : nullptr;
  p.scale = scale.defined() ? scale.const_data_ptr<float>() : nullptr;
  p.amax = out.amax.data_ptr<float>();
  p.accumulate_amax = amax.defined();
  if (current) p.workspace = small[3].data_ptr<int32_t>();
  kernels::launch_split_quantize(p, at::cuda::getCurrentCUDAStream().stream());
  return out;
}

}  // namespace

SplitQuantized split_quantize(const at::Tensor& input, const SplitSizes& m_splits,
                              const SplitQuantizeOptions& o, const at::Tensor& scale,
                              const at::Tensor& amax) {
  check_split_inputs(kSplitOp, input, m_splits, o, scale, amax, InputKind::kRows);
  check_cuda(kSplitOp, input);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = detail::aligned_operand(input);
  kernels::SplitQuantizeParams source;
  source.input = x.const_data_ptr();
  return launch(input, input.size(0), input.size(1), m_splits, o, scale, amax, source);
}

SplitQuantized gather_split_quantize(const at::Tensor& input, const at::Tensor& rows,
                                     const SplitSizes& m_splits, const SplitQuantizeOptions& o,
                                     const at::Tensor& scale, const at::Tensor& amax) {
  TORCH_CHECK(rows.defined() && rows.dim() == 1 && rows.scalar_type() == at::kLong, kGatherOp,
              ": rows must be a 1-D int64 tensor, got ",
              rows.defined() ? rows.sizes() : at::IntArrayRef{}, " ",
              rows.defined() ? rows.scalar_type() : at::ScalarType::Undefined);
  check_split_inputs(kGatherOp, input, m_splits, o, scale, amax, InputKind::kRows, rows.size(0));
  TORCH_CHECK(rows.device() == input.device(), kGatherOp, ": rows must be on ", input.device(),
              " like the input, got ", rows.device());
  TORCH_CHECK(rows.is_contiguous(), kGatherOp, ": rows must be contiguous");
  check_cuda(kGatherOp, input);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = detail::aligned_operand(input);
  kernels::SplitQuantizeParams source;
  source.input = x.const_data_ptr();
  source.gather_rows = rows.const_data_ptr<int64_t>();
  source.gather_source_rows = input.size(0);
  return launch(input, rows.size(0), input.size(1), m_splits, o, scale, amax, source);
}

SplitQuantized glu_split_quantize(const at::Tensor& input, const at::Tensor& scales,
                                  const GluOptions& glu, const SplitSizes& m_splits,
                                  const SplitQuantizeOptions& o, const at::Tensor& scale,
                                  const at::Tensor& amax) {
  const at::Tensor s = scales.defined() ? scales.contiguous() : scales;
  kernels::GluParams params = detail::glu_kernel_params(input, s, glu);
  check_split_inputs(kGluOp, input, m_splits, o, scale, amax, InputKind::kGluActivation);
  check_cuda(kGluOp, input);
  const c10::cuda::CUDAGuard guard(input.device());
  // The kernel's GLU source reads a and b in whole 16-column pieces; finer interleaves (GPT-OSS's
  // 1) take the activation and the quantize as two launches.
  if (glu.interleave % kernels::kQuantizeFeatureMultiple != 0) {
    return split_quantize(glu_forward(input, s, glu), m_splits, o, scale, amax);
  }
  const at::Tensor x = detail::aligned_operand(input);
  params.input = x.const_data_ptr();
  kernels::SplitQuantizeParams source;
  source.glu = params;
  return launch(input, input.size(0), input.size(1) / 2, m_splits, o, scale, amax, source);
}

GluGradsQuantized glu_backward_split_quantize(const at::Tensor& grad_output,
                                              const at::Tensor& input, const at::Tensor& scales,
                                              const GluOptions& glu, bool grad_scales,
                                              const SplitSizes& m_splits,
                                              const SplitQuantizeOptions& o,
                                              const at::Tensor& scale, const at::Tensor& amax) {
  return detail::glu_backward_split_quantize(grad_output, input, scales, glu, grad_scales, m_splits,
                                             o, scale, amax, kGluGradientFusedMinWaves);
}

namespace detail {

GluGradsQuantized glu_backward_split_quantize(const at::Tensor& grad_output,
                                              const at::Tensor& input, const at::Tensor& scales,
                                              const GluOptions& glu, bool grad_scales,
                                              const SplitSizes& m_splits,
                                              const SplitQuantizeOptions& o,
                                              const at::Tensor& scale, const at::Tensor& amax,
                                              double fused_min_waves) {
  const at::Tensor s = scales.defined() ? scales.contiguous() : scales;
  kernels::GluParams params = detail::glu_kernel_params(input, s, glu);
  check_split_inputs(kGluGradOp, input, m_splits, o, scale, amax, InputKind::kGluGradient);
  TORCH_CHECK(!grad_scales || scales.defined(), kGluGradOp, ": grad_scales needs scales");
  const int64_t rows = input.size(0), hidden = input.size(1) / 2;
  TORCH_CHECK(grad_output.defined() && grad_output.sizes() == at::IntArrayRef({rows, hidden}),
              kGluGradOp, ": grad_output must have shape [", rows, ", ", hidden, "], got ",
              grad_output.defined() ? grad_output.sizes() : at::IntArrayRef{});
  TORCH_CHECK(
      grad_output.scalar_type() == input.scalar_type() && grad_output.device() == input.device(),
      kGluGradOp, ": grad_output must have the input's dtype ", input.scalar_type(), " and device ",
      input.device(), ", got ", grad_output.scalar_type(), " on ", grad_output.device());
  TORCH_CHECK(grad_output.is_contiguous(), kGluGradOp, ": grad_output must be contiguous");
  check_cuda(kGluGradOp, input);
  const c10::cuda::CUDAGuard guard(input.device());
  // Set for the size rule, whose kernel choice reads which source pointers are set; the fused
  // launch below points them at the aligned operands.
  params.input = input.const_data_ptr();
  params.grad_output = grad_output.const_data_ptr();
  // Current scaling needs the gradient's amax before its cast; interleaves finer than the kernel's
  // 16-column pieces (glu_split_quantize) and launches of few waves: the GLU backward and the
  // quantize as two launches.
  if (o.scaling == QuantizeScaling::kCurrent ||
      glu.interleave % kernels::kQuantizeFeatureMultiple != 0 ||
      !glu_gradient_fills_waves(input.scalar_type(), rows, 2 * hidden, m_splits.size(), o, params,
                                fused_min_waves)) {
    GluGrads grads = glu_backward(grad_output, input, scales, glu, grad_scales);
    if (grad_scales) {
      // Rows past the splits get 0, as the fused launch of the other scalings leaves them (it
      // never visits them). Device sizes are clamped as the kernel clamps them, each to [0, rows]
      // before the sum, and stay on the device (no host sync); host sizes were checked above.
      const at::Tensor row = at::arange(rows, input.options().dtype(at::kLong));
      const at::Tensor past =
          m_splits.has_host()
              ? row.ge(c10::sum_integers(m_splits.host()))
              : row.ge(m_splits.device().to(at::kLong).clamp(0, rows).sum().clamp_max(rows));
      grads.grad_scales.masked_fill_(past.reshape(grads.grad_scales.sizes()), 0);
    }
    return {split_quantize(grads.grad_input, m_splits, o, scale, amax), grads.grad_scales};
  }
  const at::Tensor x = detail::aligned_operand(input);
  const at::Tensor dy = detail::aligned_operand(grad_output);
  params.input = x.const_data_ptr();
  params.grad_output = dy.const_data_ptr();
  // One partial sum per row and 128-column tile, summed here in a fixed order (deterministic,
  // unlike atomics).
  const int64_t width = 2 * hidden;
  const at::Tensor partial = grad_scales ? at::zeros({kernels::block_count(width), rows},
                                                     input.options().dtype(at::kFloat))
                                         : at::Tensor();
  GluGradsQuantized out;
  kernels::SplitQuantizeParams source;
  source.glu = params;
  source.glu_grad_scales_partial = grad_scales ? partial.data_ptr<float>() : nullptr;
  out.grad_input = launch(input, rows, width, m_splits, o, scale, amax, source);
  if (grad_scales) out.grad_scales = partial.sum(0).to(s.scalar_type()).reshape(s.sizes());
  return out;
}

}  // namespace detail

SplitQuantized quantize_weights(const GroupedTensors& weights, const SplitQuantizeOptions& o,
                                const at::Tensor& scale, const at::Tensor& amax) {
  TORCH_CHECK(!weights.empty(), kWeightsOp, ": needs at least one weight");
  const at::Tensor first = weights[0];
  TORCH_CHECK(first.defined() && first.dim() == 2, kWeightsOp,
              ": each weight must be a 2-D [out_features, in_features] tensor");
  const int64_t groups = static_cast<int64_t>(weights.size()), n = first.size(0), k = first.size(1);
  check_input_type(kWeightsOp, first.scalar_type(), k);
  TORCH_CHECK(n % kernels::kColumnwiseRowMultiple == 0, kWeightsOp,
              ": out_features must be a multiple of ", kernels::kColumnwiseRowMultiple,
              " (the columnwise copy is dgrad's operand), got ", n);
  const detail::CheckedGroups w =
      detail::check_groups(kWeightsOp, "weights", weights, weights.size(), first, {n, k},
                           first.scalar_type(), "weights[0]'s dtype");
  TORCH_CHECK(w.aligned, kWeightsOp, ": weights must start on 16-byte boundaries");
  check_options(kWeightsOp, o, groups, first.device(), scale, amax);
  check_kernel_size(kWeightsOp, groups * n, k, groups);
  check_cuda(kWeightsOp, first);
  const c10::cuda::CUDAGuard guard(first.device());
  // The device sizes filled on the device (no host-to-device copy of the host ones: this op runs
  // on every FP8 forward, and a copy from pageable memory cannot be captured in a CUDA graph).
  const SplitSizes sizes(std::vector<int64_t>(static_cast<size_t>(groups), n),
                         at::full({groups}, n, first.options().dtype(at::kLong)));
  kernels::SplitQuantizeParams source;
  source.split_inputs = detail::group_address(w);
  return launch(first, groups * n, k, sizes, o, scale, amax, source);
}

void update_delayed_scaling(const at::Tensor& amax_history, const at::Tensor& amax,
                            const at::Tensor& scale, const at::Tensor& scale_inv,
                            const DelayedScalingUpdateOptions& o) {
  TORCH_CHECK(amax_history.defined() && amax_history.dim() == 2, kUpdateOp,
              ": amax_history must be a 2-D [history_length, splits] tensor");
  TORCH_CHECK(amax_history.size(0) >= 1, kUpdateOp,
              ": amax_history must have at least one row, got ", amax_history.size(0));
  TORCH_CHECK(amax_history.scalar_type() == at::kFloat, kUpdateOp,
              ": amax_history must be float32, got ", amax_history.scalar_type());
  TORCH_CHECK(amax_history.is_contiguous(), kUpdateOp, ": amax_history must be contiguous");
  const int64_t groups = amax_history.size(1);
  TORCH_CHECK(groups <= std::numeric_limits<int>::max(), kUpdateOp,
              ": at most 2^31 - 1 splits (one block each), got ", groups);
  check_group_vector(kUpdateOp, "amax", amax, groups, amax_history.device());
  check_group_vector(kUpdateOp, "scale", scale, groups, amax_history.device());
  check_group_vector(kUpdateOp, "scale_inv", scale_inv, groups, amax_history.device());
  // The scales target fp8_max · 2^-margin in float: it must be a normal number (a zero target
  // would make every scale 0 and scale_inv infinite).
  const auto scaled_max = static_cast<float>(kernels::fp8_max(o.format) * std::pow(2.0, -o.margin));
  TORCH_CHECK(std::isfinite(o.margin) && std::isnormal(scaled_max), kUpdateOp,
              ": margin must be finite and leave fp8_max * 2^-margin a normal float, got ",
              o.margin);
  check_cuda(kUpdateOp, amax_history);
  const c10::cuda::CUDAGuard guard(amax_history.device());
  kernels::DelayedScalingUpdateParams p;
  p.num_groups = static_cast<int>(groups);
  p.history_length = amax_history.size(0);
  p.amax_history = amax_history.data_ptr<float>();
  p.amax = amax.const_data_ptr<float>();
  p.scale = scale.data_ptr<float>();
  p.scale_inv = scale_inv.data_ptr<float>();
  p.scaled_max = scaled_max;
  p.algo = o.algo;
  kernels::launch_update_delayed_scaling(p, at::cuda::getCurrentCUDAStream().stream());
}

}  // namespace torchmoe::ops
