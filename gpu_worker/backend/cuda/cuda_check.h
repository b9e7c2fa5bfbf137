// CUDA and cuBLAS error checks for host code: a failing call becomes an absl::Status (INTERNAL)
// naming the statement, file and line, returned from the enclosing function (ggml's
// CUDA_CHECK_GEN, but returning instead of aborting). Kernel launchers return cudaError_t
// (cudaGetLastError() after the launch), so `TANDEM_CUDA_RETURN_IF_ERROR(LaunchX(args, stream))`
// checks a launch the same way.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::gpu_worker::cuda_backend {

inline absl::Status CudaErrorStatus(cudaError_t error, const char* statement, const char* file,
                                    int line) {
  return absl::InternalError(absl::StrCat(statement, " failed at ", file, ":", line, ": ",
                                          cudaGetErrorName(error), " (", cudaGetErrorString(error),
                                          ")"));
}

inline absl::Status CublasErrorStatus(cublasStatus_t status, const char* statement,
                                      const char* file, int line) {
  return absl::InternalError(absl::StrCat(statement, " failed at ", file, ":", line, ": ",
                                          cublasGetStatusName(status), " (",
                                          cublasGetStatusString(status), ")"));
}

}  // namespace tandem::gpu_worker::cuda_backend

// Evaluates `stmt` (a cudaError_t); returns INTERNAL from the enclosing function on failure.
#define TANDEM_CUDA_RETURN_IF_ERROR(stmt)                                                   \
  do {                                                                                      \
    const cudaError_t tandem_cuda_error_ = (stmt);                                          \
    if (tandem_cuda_error_ != cudaSuccess) {                                                \
      return ::tandem::gpu_worker::cuda_backend::CudaErrorStatus(tandem_cuda_error_, #stmt, \
                                                                 __FILE__, __LINE__);       \
    }                                                                                       \
  } while (0)

// Evaluates `stmt` (a cublasStatus_t); returns INTERNAL from the enclosing function on failure.
#define TANDEM_CUBLAS_RETURN_IF_ERROR(stmt)                                                      \
  do {                                                                                           \
    const cublasStatus_t tandem_cublas_status_ = (stmt);                                         \
    if (tandem_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                        \
      return ::tandem::gpu_worker::cuda_backend::CublasErrorStatus(tandem_cublas_status_, #stmt, \
                                                                   __FILE__, __LINE__);          \
    }                                                                                            \
  } while (0)
