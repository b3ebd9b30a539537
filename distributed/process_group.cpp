#include "torchmoe/distributed/process_group.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

#include "torchmoe/distributed/backends.h"

namespace torchmoe::distributed {
namespace {

constexpr const char* kFunction = "init_process_group";

std::string env_string(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr && *value != '\0', kFunction, ": environment variable ", name,
              " must be set (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
              "MASTER_PORT), got none");
  return value;
}

int64_t env_int(const char* name, int64_t min, int64_t max) {
  const std::string text = env_string(name);
  size_t used = 0;
  int64_t value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == text.size() && value >= min && value <= max, kFunction, ": ", name,
              " must be an integer in [", min, ", ", max, "], got '", text, "'");
  return value;
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(c10::Device device,
                                                          std::chrono::milliseconds timeout) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), kFunction,
              ": device must be CPU (Gloo) or CUDA (NCCL and Gloo), got ", device);
  TORCH_CHECK(timeout.count() > 0, kFunction, ": timeout must be positive, got ", timeout.count(),
              " ms");
  const int64_t world = env_int("WORLD_SIZE", 1, std::numeric_limits<int>::max());
  const int64_t rank = env_int("RANK", 0, world - 1);
  const std::string master = env_string("MASTER_ADDR");
  // One process per GPU: this process's is checked before any rendezvous, so that a launch of more
  // processes than GPUs stops with this message rather than CUDA's in set_device.
  int64_t gpu = -1;
  if (device.is_cuda()) {
    gpu = device.has_index() ? device.index()
                             : env_int("LOCAL_RANK", 0, std::numeric_limits<int8_t>::max());
    const int64_t visible = c10::cuda::device_count();
    TORCH_CHECK(gpu < visible, kFunction, ": this process's GPU is cuda:", gpu,
                device.has_index() ? " (the device given)" : " (LOCAL_RANK)", ", but ", visible,
                " CUDA devices are visible: run at most ", visible,
                " processes per node on CUDA, or use the CPU (Gloo)");
  }
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(env_int("MASTER_PORT", 1, 65535));
  // Under torchrun the agent already serves a store on MASTER_PORT and says so; rank 0 then joins
  // it as a client, as Python's init_process_group does.
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  store_options.isServer = rank == 0 && !(agent_store && std::string(agent_store) == "True");
  store_options.numWorkers = static_cast<size_t>(world);
  store_options.waitWorkers = true;
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store =
      c10::make_intrusive<c10d::TCPStore>(master, store_options);

  const int r = static_cast<int>(rank), n = static_cast<int>(world);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, r, n);
  // Each backend rendezvouses under its own key prefix, as Python's init_process_group does.
  group->setBackend(
      c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
      make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("cpu", store), r, n, timeout));
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  if (device.is_cuda()) {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(gpu));
    group->setBackend(
        c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL,
        make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("cuda", store), r, n, timeout));
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  }
  return group;
}

}  // namespace torchmoe::distributed
