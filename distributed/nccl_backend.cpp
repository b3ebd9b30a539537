// ProcessGroupNCCL from C++. nccl.h comes from the nvidia-nccl wheel the torch wheel depends on,
// the NCCL libtorch_cuda.so is built for and loads.

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "torchmoe/distributed/backends.h"

namespace torchmoe::distributed {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace torchmoe::distributed
