#pragma once
// Status checks for the kernel layer: every CUDA runtime and cuBLASLt call goes through one of
// these, and a failure becomes a c10::Error (library code never exits).

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <c10/util/Exception.h>

#define TORCHMOE_CUDA_CHECK(expr)                                                               \
  do {                                                                                          \
    const cudaError_t torchmoe_status_ = (expr);                                                \
    TORCH_CHECK(torchmoe_status_ == cudaSuccess, "CUDA error in ", #expr, ": ",                 \
                cudaGetErrorName(torchmoe_status_), " (", cudaGetErrorString(torchmoe_status_), \
                ")");                                                                           \
  } while (0)

#define TORCHMOE_CUBLASLT_CHECK(expr)                                                         \
  do {                                                                                        \
    const cublasStatus_t torchmoe_status_ = (expr);                                           \
    TORCH_CHECK(torchmoe_status_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt error in ", #expr, ": ", \
                cublasLtGetStatusString(torchmoe_status_));                                   \
  } while (0)
