#include "torchmoe/ops/types.h"

#include <ATen/ATen.h>

#include <limits>
#include <utility>

namespace torchmoe {

SplitSizes::SplitSizes(const at::Tensor& sizes) {
  TORCH_CHECK(sizes.defined(), "m_splits must be a defined tensor");
  TORCH_CHECK(sizes.dim() == 1, "m_splits must be a 1-D tensor, got ", sizes.dim(), "-D");
  TORCH_CHECK(at::isIntegralType(sizes.scalar_type(), /*includeBool=*/false),
              "m_splits must have an integer dtype, got ", sizes.scalar_type());
  TORCH_CHECK(sizes.is_cpu() || sizes.is_cuda(),
              "m_splits must be on the CPU or a CUDA device, got ", sizes.device());
  if (sizes.is_cuda()) {
    // The kernels read int32 or int64.
    const bool native = sizes.scalar_type() == at::kInt || sizes.scalar_type() == at::kLong;
    device_ = native ? sizes.contiguous() : sizes.to(at::kLong);
    return;
  }
  const at::Tensor host = sizes.to(at::kLong).contiguous();
  const int64_t* data = host.const_data_ptr<int64_t>();
  host_.assign(data, data + host.numel());
  has_host_ = true;
}

SplitSizes::SplitSizes(std::vector<int64_t> host, const at::Tensor& device) : SplitSizes(device) {
  TORCH_CHECK(has_device() && static_cast<size_t>(device_.numel()) == host.size(),
              "SplitSizes: the device sizes must be a CUDA tensor with as many entries as the host "
              "sizes (",
              host.size(), "), got ", device.device(), " with ", device.numel());
  host_ = std::move(host);
  has_host_ = true;
}

SplitSizes SplitSizes::uniform(int64_t groups, int64_t rows, const at::Device& device) {
  // The bound keeps a vector of `groups` sizes allocatable (a GEMM takes fewer groups still).
  TORCH_CHECK(groups >= 0 && groups <= std::numeric_limits<int32_t>::max() && rows >= 0,
              "SplitSizes::uniform: groups must be in [0, 2^31) and rows non-negative, got ",
              groups, " and ", rows);
  std::vector<int64_t> host(groups, rows);
  if (!device.is_cuda()) return SplitSizes(std::move(host));
  return SplitSizes(std::move(host),
                    at::full({groups}, rows, at::TensorOptions(at::kLong).device(device)));
}

size_t SplitSizes::size() const {
  return has_host_ ? host_.size() : static_cast<size_t>(device_.numel());
}

c10::IntArrayRef SplitSizes::host() const {
  TORCH_INTERNAL_ASSERT(has_host_, "SplitSizes::host: only device sizes were given");
  return host_;
}

}  // namespace torchmoe
