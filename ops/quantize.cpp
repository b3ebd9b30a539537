#include "torchmoe/ops/quantize.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <string>

#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/ops/grouped_gemm_backends.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

constexpr const char* kSplitOp = "torchmoe::split_quantize";
constexpr const char* kUpdateOp = "torchmoe::update_delayed_scaling";

at::ScalarType fp8_dtype(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

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

void check_split_inputs(const at::Tensor& input, const SplitSizes& m_splits,
                        const SplitQuantizeOptions& o, const at::Tensor& scale,
                        const at::Tensor& amax) {
  TORCH_CHECK(input.defined() && input.dim() == 2, kSplitOp,
              ": input must be a 2-D [rows, features] tensor",
              input.defined() ? ", got " + std::to_string(input.dim()) + "-D" : std::string());
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, kSplitOp,
              ": input must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(input.is_contiguous(), kSplitOp, ": input must be contiguous");
  TORCH_CHECK(input.size(1) % kernels::kQuantizeFeatureMultiple == 0, kSplitOp,
              ": input's features must be a multiple of ", kernels::kQuantizeFeatureMultiple,
              " (FP8 GEMM operands), got ", input.size(1));
  const int64_t groups = static_cast<int64_t>(m_splits.size());
  TORCH_CHECK(groups >= 1 && groups <= kernels::kSplitQuantizeMaxGroups, kSplitOp,
              ": m_splits must have between 1 and ", kernels::kSplitQuantizeMaxGroups,
              " sizes, got ", groups);
  if (m_splits.has_host()) {
    int64_t sum = 0;
    for (int64_t g = 0; g < groups; ++g) {
      TORCH_CHECK(m_splits.host()[g] >= 0, kSplitOp, ": m_splits[", g,
                  "] must be non-negative, got ", m_splits.host()[g]);
      sum += m_splits.host()[g];
    }
    TORCH_CHECK(sum <= input.size(0), kSplitOp, ": m_splits must sum to at most the input's ",
                input.size(0), " rows, got ", m_splits.host(), " (sum ", sum, ")");
  } else {
    TORCH_CHECK(m_splits.device().device() == input.device(), kSplitOp, ": m_splits must be on ",
                input.device(), " like the input, or on the host, got ",
                m_splits.device().device());
  }
  TORCH_CHECK(o.rowwise || o.columnwise, kSplitOp,
              ": at least one of rowwise and columnwise must be requested");
  TORCH_CHECK(std::isfinite(o.amax_epsilon) && o.amax_epsilon >= 0.0, kSplitOp,
              ": amax_epsilon must be finite and non-negative, got ", o.amax_epsilon);
  const bool delayed = o.scaling == QuantizeScaling::kDelayed;
  if (delayed) {
    check_group_vector(kSplitOp, "scale", scale, groups, input.device());
    if (amax.defined()) check_group_vector(kSplitOp, "amax", amax, groups, input.device());
  } else {
    TORCH_CHECK(!scale.defined() && !amax.defined(), kSplitOp,
                ": scale and amax are inputs of delayed scaling only");
  }
  TORCH_CHECK_NOT_IMPLEMENTED(input.is_cuda(), kSplitOp, ": no backend for ", input.device(),
                              " tensors (CUDA only)");
}

}  // namespace

SplitQuantized split_quantize(const at::Tensor& input, const SplitSizes& m_splits,
                              const SplitQuantizeOptions& o, const at::Tensor& scale,
                              const at::Tensor& amax) {
  check_split_inputs(input, m_splits, o, scale, amax);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t rows = input.size(0), k = input.size(1);
  const int groups = static_cast<int>(m_splits.size());
  const at::Tensor x = detail::aligned_operand(input);
  const at::Tensor splits = detail::device_splits(m_splits, input);
  const at::TensorOptions fp8 = input.options().dtype(fp8_dtype(o.format));
  const at::TensorOptions f32 = input.options().dtype(at::kFloat);
  const bool block = kernels::is_block_scaling(o.scaling);

  SplitQuantized out;
  if (o.rowwise) out.data = at::empty({rows, k}, fp8);
  if (o.columnwise) out.columnwise_data = at::empty({rows * k}, fp8);
  if (!block) {
    out.scale_inv = at::empty({groups}, f32);
  } else {
    if (o.rowwise) {
      out.scale_inv = at::empty({kernels::rowwise_block_scales(o.scaling, rows, k, groups)}, f32);
    }
    if (o.columnwise) {
      out.columnwise_scale_inv =
          at::empty({kernels::columnwise_block_scales(o.scaling, rows, k, groups)}, f32);
    }
  }
  out.amax = amax.defined() ? amax : at::empty({groups}, f32);

  kernels::SplitQuantizeParams p;
  p.input_type = kernel_type(input.scalar_type());
  p.format = o.format;
  p.scaling = o.scaling;
  p.power_of_2_scales = o.power_of_2_scales;
  p.epsilon = static_cast<float>(o.amax_epsilon);
  p.num_groups = groups;
  p.rows = rows;
  p.k = k;
  p.m_splits = splits.const_data_ptr();
  p.splits_int32 = splits.scalar_type() == at::kInt;
  p.input = x.const_data_ptr();
  p.rowwise = o.rowwise ? out.data.data_ptr() : nullptr;
  p.columnwise = o.columnwise ? out.columnwise_data.data_ptr() : nullptr;
  p.scale_inv = out.scale_inv.defined() ? out.scale_inv.data_ptr<float>() : nullptr;
  p.columnwise_scale_inv =
      out.columnwise_scale_inv.defined() ? out.columnwise_scale_inv.data_ptr<float>() : nullptr;
  p.scale = scale.defined() ? scale.const_data_ptr<float>() : nullptr;
  p.amax = out.amax.data_ptr<float>();
  p.accumulate_amax = amax.defined();
  kernels::launch_split_quantize(p, at::cuda::getCurrentCUDAStream().stream());
  return out;
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
  check_group_vector(kUpdateOp, "amax", amax, groups, amax_history.device());
  check_group_vector(kUpdateOp, "scale", scale, groups, amax_history.device());
  check_group_vector(kUpdateOp, "scale_inv", scale_inv, groups, amax_history.device());
  TORCH_CHECK(std::isfinite(o.margin), kUpdateOp, ": margin must be finite, got ", o.margin);
  TORCH_CHECK_NOT_IMPLEMENTED(amax_history.is_cuda(), kUpdateOp, ": no backend for ",
                              amax_history.device(), " tensors (CUDA only)");
  const c10::cuda::CUDAGuard guard(amax_history.device());
  kernels::DelayedScalingUpdateParams p;
  p.num_groups = static_cast<int>(groups);
  p.history_length = amax_history.size(0);
  p.amax_history = amax_history.data_ptr<float>();
  p.amax = amax.const_data_ptr<float>();
  p.scale = scale.data_ptr<float>();
  p.scale_inv = scale_inv.data_ptr<float>();
  p.scaled_max = static_cast<float>(kernels::fp8_max(o.format) * std::pow(2.0, -o.margin));
  p.algo = o.algo;
  kernels::launch_update_delayed_scaling(p, at::cuda::getCurrentCUDAStream().stream());
}

}  // namespace torchmoe::ops
