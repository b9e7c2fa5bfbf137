// RAII owners of the CUDA handles the cuda backend holds: a stream, a cuBLAS handle, device
// memory, pinned host memory, and a growable device workspace. All are move-only; destruction
// releases the handle and ignores errors (a destructor has nobody to report to). Not thread-safe.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/statusor.h"

namespace tandem::gpu_worker::cuda_backend {

// cudaMalloc with the backend's error mapping: RESOURCE_EXHAUSTED when the device is out of
// memory (the sticky error is cleared), INTERNAL for any other failure.
absl::StatusOr<void*> MallocDevice(size_t bytes);

// A non-blocking stream (does not synchronise with the legacy default stream).
class CudaStream {
 public:
  static absl::StatusOr<CudaStream> Create();
  CudaStream() = default;
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  ~CudaStream();

  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// An event: without timing (for ordering between streams), or timed (Backend::MarkDevice).
class CudaEvent {
 public:
  static absl::StatusOr<CudaEvent> Create();
  static absl::StatusOr<CudaEvent> CreateTimed();
  CudaEvent() = default;
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  ~CudaEvent();

  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// A cuBLAS handle bound to one stream, in the default math mode (no TF32 for f32 GEMMs).
class CublasHandle {
 public:
  static absl::StatusOr<CublasHandle> Create(cudaStream_t stream);
  CublasHandle() = default;
  CublasHandle(CublasHandle&& other) noexcept;
  CublasHandle& operator=(CublasHandle&& other) noexcept;
  ~CublasHandle();

  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// cudaMalloc'd device memory.
class DeviceMemory {
 public:
  static absl::StatusOr<DeviceMemory> Allocate(size_t bytes);
  DeviceMemory() = default;
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  ~DeviceMemory();

  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }
  void Reset();

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// cudaMallocHost'd (page-locked) host memory: the source or target of truly asynchronous copies.
class PinnedMemory {
 public:
  static absl::StatusOr<PinnedMemory> Allocate(size_t bytes);
  PinnedMemory() = default;
  PinnedMemory(PinnedMemory&& other) noexcept;
  PinnedMemory& operator=(PinnedMemory&& other) noexcept;
  ~PinnedMemory();

  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Scratch device memory for the operations (converted GEMM inputs, attention partial states,
// sampling buffers). Reserve returns a block of at least `bytes`, valid until the next Reserve;
// one operation uses it at a time, and stream order keeps consecutive operations apart.
class Workspace {
 public:
  // Grows (to at least twice the old size) when `bytes` does not fit. NOTE: growing waits for
  // `stream` first, since kernels queued earlier may still read the old block.
  absl::StatusOr<void*> Reserve(size_t bytes, cudaStream_t stream);
  size_t capacity() const { return memory_.bytes(); }

 private:
  DeviceMemory memory_;
};

}  // namespace tandem::gpu_worker::cuda_backend
