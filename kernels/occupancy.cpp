#include "torchmoe/kernels/occupancy.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "torchmoe/kernels/cuda_check.h"

namespace torchmoe::kernels {
namespace {

int current_device() {
  int device = 0;
  TORCHMOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// One lock for the three caches: each entry is filled once per process, and a lookup is short.
std::mutex& cache_mutex() {
  static std::mutex mutex;
  return mutex;
}

// The caller holds cache_mutex().
int sm_count_locked(int device) {
  static std::map<int, int> counts;
  auto it = counts.find(device);
  if (it == counts.end()) {
    int sms = 0;
    TORCHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    it = counts.emplace(device, sms).first;
  }
  return it->second;
}

}  // namespace

int sm_count() {
  const int device = current_device();
  const std::lock_guard<std::mutex> lock(cache_mutex());
  return sm_count_locked(device);
}

int64_t resident_blocks(const void* kernel, int threads, size_t shared_bytes) {
  const int device = current_device();
  static std::map<std::tuple<const void*, int, size_t, int>, int64_t> blocks;
  const std::lock_guard<std::mutex> lock(cache_mutex());
  const auto key = std::make_tuple(kernel, threads, shared_bytes, device);
  auto it = blocks.find(key);
  if (it == blocks.end()) {
    int per_sm = 0;
    TORCHMOE_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes));
    it = blocks.emplace(key, static_cast<int64_t>(sm_count_locked(device)) * std::max(per_sm, 1))
             .first;
  }
  return it->second;
}

void allow_dynamic_shared(const void* kernel, size_t shared_bytes) {
  const int device = current_device();
  static std::map<std::pair<const void*, int>, size_t> allowed;
  const std::lock_guard<std::mutex> lock(cache_mutex());
  size_t& limit = allowed[{kernel, device}];
  if (shared_bytes <= limit) return;
  TORCHMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared_bytes)));
  limit = shared_bytes;
}

}  // namespace torchmoe::kernels
