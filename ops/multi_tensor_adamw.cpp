#include "torchmoe/ops/multi_tensor_adamw.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <cmath>

#include "torchmoe/kernels/multi_tensor_adamw.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

constexpr const char* kOp = "torchmoe::ops::adamw_step";
constexpr double kE4m3Max = 448.0;  // the largest finite e4m3 value

enum class Backend {
  kReference,  // CPU: per-tensor ATen ops
  kCuda,       // kernels/multi_tensor_adamw.cu
};

// The dispatch table; every tensor must be on `device`.
Backend select_backend(const char* op, const c10::Device& device) {
  if (device.is_cpu()) return Backend::kReference;
  if (device.is_cuda()) return Backend::kCuda;
  TORCH_CHECK_NOT_IMPLEMENTED(false, op, ": no backend for tensors on ", device,
                              " (supported: CPU, CUDA)");
}

// what[i] is a floating tensor on `device` (float32 and contiguous when fp32_only), of `shape`
// unless that is null.
void check_tensor(const char* op, const char* what, size_t i, const at::Tensor& t,
                  const c10::Device& device, const at::IntArrayRef* shape, bool fp32_only) {
  TORCH_CHECK(t.defined(), op, ": ", what, "[", i, "] must be a defined tensor");
  TORCH_CHECK(t.device() == device, op, ": ", what, "[", i, "] must be on ", device, ", got ",
              t.device());
  TORCH_CHECK(shape == nullptr || t.sizes() == *shape, op, ": ", what, "[", i, "] must have shape ",
              *shape, " like params[", i, "], got ", t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", what, "[", i,
              "] must have a floating dtype, got ", t.scalar_type());
  TORCH_CHECK(!fp32_only || t.scalar_type() == at::kFloat, op, ": ", what, "[", i,
              "] must be float32 on CUDA, got ", t.scalar_type());
  TORCH_CHECK(!fp32_only || t.is_contiguous(), op, ": ", what, "[", i,
              "] must be contiguous on CUDA");
}

// Groups tensors into launches of at most kAdamWTensorsPerLaunch, skipping empty ones, and calls
// launch(batch) for each. make(i) gives tensor i's kernel view.
template <typename Make, typename Launch>
void for_each_batch(size_t count, Make&& make, Launch&& launch) {
  kernels::AdamWBatch batch;
  auto flush = [&] {
    if (batch.num_tensors > 0) launch(batch);
    batch = kernels::AdamWBatch();
  };
  for (size_t i = 0; i < count; ++i) {
    const kernels::AdamWTensor t = make(i);
    if (t.numel == 0) continue;
    // A launch's blocks are counted in int: 48 tensors of up to 2^35 elements each fit.
    const int64_t chunks = (t.numel + kernels::kAdamWChunk - 1) / kernels::kAdamWChunk;
    TORCH_CHECK(chunks <= (int64_t{1} << 21), kOp, ": tensors of more than 2^35 elements are not ",
                "supported, got ", t.numel);
    if (batch.num_tensors == kernels::kAdamWTensorsPerLaunch) flush();
    batch.tensors[batch.num_tensors] = t;
    batch.chunk_prefix[batch.num_tensors + 1] =
        batch.chunk_prefix[batch.num_tensors] + static_cast<int>(chunks);
    ++batch.num_tensors;
  }
  flush();
}

// A weight with an FP8 copy: `experts` matrices [rows, cols].
struct Fp8Shape {
  int64_t experts = 1, rows = 0, cols = 0;
};

Fp8Shape fp8_shape(const at::Tensor& param) {
  return {param.dim() == 3 ? param.size(0) : 1, param.size(-2), param.size(-1)};
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void check_fp8_copy(size_t i, const AdamWTensors& t, bool cuda) {
  const at::Tensor& param = t.params[i];
  const AdamWFp8Copy& c = t.fp8_copies[i];
  TORCH_CHECK(param.scalar_type() == at::kFloat && (param.dim() == 2 || param.dim() == 3), kOp,
              ": params[", i, "] has an FP8 copy, so it must be a float32 [rows, cols] or ",
              "[experts, rows, cols] tensor, got ", param.scalar_type(), " ", param.sizes());
  const Fp8Shape s = fp8_shape(param);
  TORCH_CHECK(s.rows % 16 == 0 && s.cols % 16 == 0, kOp, ": params[", i, "] has an FP8 copy, so ",
              "its rows and columns must be multiples of 16 (FP8 GEMM operands), got ",
              param.sizes());
  const auto check = [&](const at::Tensor& x, const char* name, at::ScalarType dtype,
                         std::vector<int64_t> shape) {
    TORCH_CHECK(x.defined(), kOp, ": fp8_copies[", i, "].", name, " must be defined (an entry ",
                "with a rowwise copy needs all five tensors)");
    TORCH_CHECK(x.scalar_type() == dtype && x.sizes() == at::IntArrayRef(shape) &&
                    x.device() == param.device() && x.is_contiguous(),
                kOp, ": fp8_copies[", i, "].", name, " must be a contiguous ", dtype, " ",
                at::IntArrayRef(shape), " tensor on ", param.device(), ", got ",
                x.is_contiguous() ? "a contiguous " : "a non-contiguous ", x.scalar_type(), " ",
                x.sizes(), " tensor on ", x.device());
  };
  check(c.rowwise, "rowwise", at::kFloat8_e4m3fn, {s.experts * s.rows, s.cols});
  check(c.columnwise, "columnwise", at::kFloat8_e4m3fn, {s.experts * s.rows * s.cols});
  check(c.scale, "scale", at::kFloat, {s.experts});
  check(c.scale_inv, "scale_inv", at::kFloat, {s.experts});
  check(c.amax, "amax", at::kFloat, {s.experts});
  if (!cuda) return;
  const Fp8CopyMisalignment m = fp8_copy_misalignment(t, i);
  TORCH_CHECK(m.name == nullptr, kOp, ": ", m.name, "[", i, "] must start on a ", m.bytes,
              "-byte boundary (params[", i, "] has an FP8 copy), got address ", m.address);
}

// The FP8 copy from the updated parameter, as the kernel writes it: fp32 products with the
// scale, cast saturating (a NaN stays NaN), amax maxed with each expert's max |p| ignoring NaN.
void reference_fp8_copy(const at::Tensor& param, const AdamWFp8Copy& c) {
  const Fp8Shape s = fp8_shape(param);
  const at::Tensor p = param.reshape({s.experts, s.rows, s.cols});
  const at::Tensor q =
      (p * c.scale.view({s.experts, 1, 1})).clamp(-kE4m3Max, kE4m3Max).to(at::kFloat8_e4m3fn);
  c.rowwise.copy_(q.view({s.experts * s.rows, s.cols}));
  c.columnwise.copy_(q.transpose(1, 2).reshape(-1));
  const at::Tensor magnitude = p.abs();
  c.amax.copy_(at::fmax(c.amax, at::where(magnitude.isnan(), 0.0, magnitude).amax({1, 2})));
  c.scale_inv.copy_(c.scale.reciprocal());
}

// An entry with any tensor defined is a copy (check_fp8_copy requires all five).
bool has_fp8_copy(const AdamWTensors& t, size_t i) {
  if (t.fp8_copies.empty()) return false;
  const AdamWFp8Copy& c = t.fp8_copies[i];
  return c.rowwise.defined() || c.columnwise.defined() || c.scale.defined() ||
         c.scale_inv.defined() || c.amax.defined();
}

void reference_step(const AdamWTensors& t, const AdamWHyperparameters& h,
                    const at::Tensor& grad_scale) {
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(h.step));
  const at::NoGradGuard no_grad;
  for (size_t i = 0; i < t.params.size(); ++i) {
    const at::Tensor& p = t.params[i];
    const at::Tensor grad = grad_scale.defined() ? t.grads[i] * grad_scale : t.grads[i];
    // torch::optim::AdamW's operations, in its order.
    if (h.weight_decay != 0) p.mul_(1 - h.lr * h.weight_decay);
    t.exp_avgs[i].mul_(h.beta1).add_(grad, 1 - h.beta1);
    t.exp_avg_sqs[i].mul_(h.beta2).addcmul_(grad, grad, 1 - h.beta2);
    const at::Tensor denom = (t.exp_avg_sqs[i].sqrt() / std::sqrt(bias_correction2)).add_(h.eps);
    p.addcdiv_(t.exp_avgs[i], denom, -h.lr / bias_correction1);
    if (t.models[i].defined()) t.models[i].copy_(p);
    if (has_fp8_copy(t, i) && p.numel() > 0) reference_fp8_copy(p, t.fp8_copies[i]);
  }
}

kernels::AdamWTensor kernel_tensor(const AdamWTensors& t, size_t i) {
  kernels::AdamWTensor k;
  k.param = t.params[i].mutable_data_ptr<float>();
  k.grad = t.grads[i].const_data_ptr<float>();
  k.exp_avg = t.exp_avgs[i].mutable_data_ptr<float>();
  k.exp_avg_sq = t.exp_avg_sqs[i].mutable_data_ptr<float>();
  k.model = t.models[i].defined() ? t.models[i].mutable_data_ptr() : nullptr;
  k.numel = t.params[i].numel();
  return k;
}

// for_each_batch for the weights with FP8 copies: launches of at most kAdamWFp8WeightsPerLaunch.
template <typename Launch>
void for_each_fp8_batch(const AdamWTensors& t, const std::vector<size_t>& members,
                        Launch&& launch) {
  constexpr int64_t kTile = kernels::kAdamWFp8Tile;
  kernels::AdamWFp8Batch batch;
  auto flush = [&] {
    if (batch.num_weights > 0) launch(batch);
    batch = kernels::AdamWFp8Batch();
  };
  for (const size_t i : members) {
    if (t.params[i].numel() == 0) continue;
    const Fp8Shape s = fp8_shape(t.params[i]);
    const AdamWFp8Copy& c = t.fp8_copies[i];
    // A launch's blocks are counted in int: 16 weights of up to 2^26 tiles each fit.
    const int64_t tiles =
        s.experts * ((s.rows + kTile - 1) / kTile) * ((s.cols + kTile - 1) / kTile);
    TORCH_CHECK(tiles <= (int64_t{1} << 26), kOp, ": weights with FP8 copies of more than 2^26 ",
                "64×64 tiles are not supported, got ", tiles, " (shape ", t.params[i].sizes(), ")");
    if (batch.num_weights == kernels::kAdamWFp8WeightsPerLaunch) flush();
    kernels::AdamWFp8Weight& w = batch.weights[batch.num_weights];
    w.t = kernel_tensor(t, i);
    w.rowwise = static_cast<uint8_t*>(c.rowwise.mutable_data_ptr());
    w.columnwise = static_cast<uint8_t*>(c.columnwise.mutable_data_ptr());
    w.scale = c.scale.const_data_ptr<float>();
    w.scale_inv = c.scale_inv.mutable_data_ptr<float>();
    w.amax = c.amax.mutable_data_ptr<float>();
    w.experts = s.experts;
    w.rows = s.rows;
    w.cols = s.cols;
    batch.tile_prefix[batch.num_weights + 1] =
        batch.tile_prefix[batch.num_weights] + static_cast<int>(tiles);
    ++batch.num_weights;
  }
  flush();
}

void cuda_step(const AdamWTensors& t, const AdamWHyperparameters& h, const at::Tensor& grad_scale) {
  const c10::cuda::CUDAGuard guard(t.params[0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  kernels::AdamWHyper hyper;
  hyper.lr = static_cast<float>(h.lr);
  hyper.beta1 = static_cast<float>(h.beta1);
  hyper.beta2 = static_cast<float>(h.beta2);
  hyper.eps = static_cast<float>(h.eps);
  hyper.weight_decay = static_cast<float>(h.weight_decay);
  hyper.bias_correction1 = static_cast<float>(1 - std::pow(h.beta1, static_cast<double>(h.step)));
  hyper.bias_correction2 = static_cast<float>(1 - std::pow(h.beta2, static_cast<double>(h.step)));
  hyper.grad_scale = grad_scale.defined() ? grad_scale.const_data_ptr<float>() : nullptr;
  // One pass per model dtype (a launch writes one); "none" rides with bfloat16.
  const std::array<at::ScalarType, 3> model_types = {at::kBFloat16, at::kHalf, at::kFloat};
  for (const at::ScalarType model_type : model_types) {
    std::vector<size_t> members, fp8_members;
    for (size_t i = 0; i < t.params.size(); ++i) {
      const at::ScalarType type = t.models[i].defined() ? t.models[i].scalar_type() : at::kBFloat16;
      if (type == model_type) (has_fp8_copy(t, i) ? fp8_members : members).push_back(i);
    }
    hyper.model_type = kernel_type(model_type);
    for_each_fp8_batch(t, fp8_members, [&](const kernels::AdamWFp8Batch& batch) {
      kernels::launch_adamw_fp8(batch, hyper, stream);
    });
    for_each_batch(
        members.size(), [&](size_t m) { return kernel_tensor(t, members[m]); },
        [&](const kernels::AdamWBatch& batch) { kernels::launch_adamw(batch, hyper, stream); });
  }
}

}  // namespace

Fp8CopyMisalignment fp8_copy_misalignment(const AdamWTensors& t, size_t i) {
  if (!has_fp8_copy(t, i)) return {};
  const AdamWFp8Copy& c = t.fp8_copies[i];
  const at::Tensor& model = t.models[i];
  const Fp8CopyMisalignment vectors[] = {
      {"params", 16, t.params[i].const_data_ptr()},
      {"grads", 16, t.grads[i].const_data_ptr()},
      {"exp_avgs", 16, t.exp_avgs[i].const_data_ptr()},
      {"exp_avg_sqs", 16, t.exp_avg_sqs[i].const_data_ptr()},
      {"fp8_copies.columnwise", 16, c.columnwise.const_data_ptr()},
      {"fp8_copies.rowwise", 4, c.rowwise.const_data_ptr()},
      {"models", model.defined() ? 4 * static_cast<size_t>(model.element_size()) : 1,
       model.defined() ? model.const_data_ptr() : nullptr}};
  for (const Fp8CopyMisalignment& v : vectors) {
    if (!aligned(v.address, v.bytes)) return v;
  }
  return {};
}

void check_adamw_step(const AdamWTensors& t, const AdamWHyperparameters& h,
                      const at::Tensor& grad_scale) {
  const size_t n = t.params.size();
  TORCH_CHECK(t.grads.size() == n && t.exp_avgs.size() == n && t.exp_avg_sqs.size() == n &&
                  t.models.size() == n,
              kOp, ": params, grads, exp_avgs, exp_avg_sqs and models must have one entry each, ",
              "got ", n, ", ", t.grads.size(), ", ", t.exp_avgs.size(), ", ", t.exp_avg_sqs.size(),
              ", ", t.models.size());
  TORCH_CHECK(t.fp8_copies.empty() || t.fp8_copies.size() == n, kOp,
              ": fp8_copies must be empty or have one entry per parameter (", n, "), got ",
              t.fp8_copies.size());
  TORCH_CHECK(h.lr >= 0 && h.eps >= 0 && h.weight_decay >= 0 && h.beta1 >= 0 && h.beta1 < 1 &&
                  h.beta2 >= 0 && h.beta2 < 1 && h.step >= 1,
              kOp, ": needs lr, eps, weight_decay >= 0, betas in [0, 1) and step >= 1, got lr ",
              h.lr, ", eps ", h.eps, ", weight_decay ", h.weight_decay, ", betas (", h.beta1, ", ",
              h.beta2, "), step ", h.step);
  if (n == 0) return;
  const at::Tensor& first = t.params[0];
  const Backend backend = select_backend(kOp, first.device());
  const bool cuda = backend == Backend::kCuda;
  const c10::Device device = first.device();
  for (size_t i = 0; i < n; ++i) {
    check_tensor(kOp, "params", i, t.params[i], device, nullptr, cuda);
    const at::IntArrayRef shape = t.params[i].sizes();
    check_tensor(kOp, "grads", i, t.grads[i], device, &shape, cuda);
    check_tensor(kOp, "exp_avgs", i, t.exp_avgs[i], device, &shape, cuda);
    check_tensor(kOp, "exp_avg_sqs", i, t.exp_avg_sqs[i], device, &shape, cuda);
    if (t.models[i].defined()) {
      const at::Tensor& model = t.models[i];
      check_tensor(kOp, "models", i, model, device, &shape, false);
      TORCH_CHECK(!cuda || model.is_contiguous(), kOp, ": models[", i,
                  "] must be contiguous on CUDA");
      // The kernels write these three (cuda_step's passes); another floating dtype would be
      // left out of every pass.
      TORCH_CHECK(!cuda || model.scalar_type() == at::kFloat || model.scalar_type() == at::kHalf ||
                      model.scalar_type() == at::kBFloat16,
                  kOp, ": models[", i, "] must be float32, float16 or bfloat16 on CUDA, got ",
                  model.scalar_type());
    }
    if (has_fp8_copy(t, i)) check_fp8_copy(i, t, cuda);
  }
  if (grad_scale.defined()) {
    TORCH_CHECK(grad_scale.dim() == 0 && grad_scale.scalar_type() == at::kFloat &&
                    grad_scale.device() == first.device(),
                kOp, ": grad_scale must be a 0-d float32 tensor on ", first.device(), ", got ",
                grad_scale.sizes(), " ", grad_scale.scalar_type(), " on ", grad_scale.device());
  }
}

void adamw_step(const AdamWTensors& t, const AdamWHyperparameters& h,
                const at::Tensor& grad_scale) {
  check_adamw_step(t, h, grad_scale);
  run_adamw_step(t, h, grad_scale);
}

void run_adamw_step(const AdamWTensors& t, const AdamWHyperparameters& h,
                    const at::Tensor& grad_scale) {
  if (t.params.empty()) return;
  switch (select_backend(kOp, t.params[0].device())) {
    case Backend::kReference:
      return reference_step(t, h, grad_scale);
    case Backend::kCuda:
      return cuda_step(t, h, grad_scale);
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled Backend");
}

GradNorm grad_norm(at::TensorList grads, double max_norm) {
  constexpr const char* op = "torchmoe::ops::grad_norm";
  TORCH_CHECK(!grads.empty(), op, ": needs at least one gradient");
  TORCH_CHECK(max_norm > 0, op, ": max_norm must be positive, got ", max_norm);
  const at::Tensor& first = grads[0];
  const Backend backend = select_backend(op, first.device());
  for (size_t i = 0; i < grads.size(); ++i) {
    check_tensor(op, "grads", i, grads[i], first.device(), nullptr, backend == Backend::kCuda);
  }
  GradNorm out;
  switch (backend) {
    case Backend::kReference: {
      // torch::nn::utils::clip_grad_norm_'s arithmetic: per-tensor norms, then their norm.
      std::vector<at::Tensor> norms;
      for (const at::Tensor& g : grads) norms.push_back(g.norm(2));
      const at::Tensor total = at::stack(norms).norm(2);
      out.norm = total.to(at::kFloat);
      out.coefficient = (max_norm / (total + 1e-6)).clamp_max(1.0).to(at::kFloat);
      return out;
    }
    case Backend::kCuda: {
      const c10::cuda::CUDAGuard guard(first.device());
      const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
      int64_t chunks = 0;
      for (const at::Tensor& g : grads) {
        chunks += (g.numel() + kernels::kAdamWChunk - 1) / kernels::kAdamWChunk;
      }
      const at::Tensor partials =
          new_empty({std::max<int64_t>(chunks, 1)}, first.options().dtype(at::kFloat));
      int64_t first_chunk = 0;
      for_each_batch(
          grads.size(),
          [&](size_t i) {
            kernels::AdamWTensor k;
            k.grad = grads[i].const_data_ptr<float>();
            k.numel = grads[i].numel();
            return k;
          },
          [&](const kernels::AdamWBatch& batch) {
            kernels::launch_sum_of_squares(batch, partials.mutable_data_ptr<float>(), first_chunk,
                                           stream);
            first_chunk += batch.chunk_prefix[batch.num_tensors];
          });
      const at::Tensor result = new_empty({2}, first.options().dtype(at::kFloat));
      kernels::launch_finish_norm(partials.const_data_ptr<float>(), first_chunk, max_norm,
                                  result.mutable_data_ptr<float>(),
                                  result.mutable_data_ptr<float>() + 1, stream);
      out.norm = result[0];
      out.coefficient = result[1];
      return out;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled Backend");
}

}  // namespace torchmoe::ops
