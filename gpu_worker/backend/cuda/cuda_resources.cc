#include "cuda_resources.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda_check.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker::cuda_backend {

absl::StatusOr<void*> MallocDevice(size_t bytes) {
  void* data = nullptr;
  const cudaError_t error = cudaMalloc(&data, bytes);
  if (error == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear the error so later calls do not report it
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("out of device memory: cudaMalloc of ", FormatBytes(bytes), " failed (",
                     FormatBytes(free_bytes), " of ", FormatBytes(total_bytes), " free)"));
  }
  TANDEM_CUDA_RETURN_IF_ERROR(error);
  return data;
}

absl::StatusOr<CudaStream> CudaStream::Create() {
  CudaStream stream;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream.stream_, cudaStreamNonBlocking));
  return stream;
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<CudaEvent> CudaEvent::Create() {
  CudaEvent event;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event.event_, cudaEventDisableTiming));
  return event;
}

absl::StatusOr<CudaEvent> CudaEvent::CreateTimed() {
  CudaEvent event;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event.event_, cudaEventDefault));
  return event;
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

absl::StatusOr<CublasHandle> CublasHandle::Create(cudaStream_t stream) {
  CublasHandle handle;
  TANDEM_CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle.handle_));
  TANDEM_CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle.handle_, stream));
  // Default math: f32 GEMMs use full f32 (TF32 only with CUBLAS_TF32_TENSOR_OP_MATH or a
  // *_FAST_TF32 compute type, neither of which the backend uses); bf16/f16 GEMMs still use the
  // tensor cores with f32 accumulation.
  TANDEM_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(handle.handle_, CUBLAS_DEFAULT_MATH));
  return handle;
}

CublasHandle::CublasHandle(CublasHandle&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)) {}

CublasHandle& CublasHandle::operator=(CublasHandle&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) cublasDestroy(handle_);
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

CublasHandle::~CublasHandle() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

absl::StatusOr<DeviceMemory> DeviceMemory::Allocate(size_t bytes) {
  DeviceMemory memory;
  TANDEM_ASSIGN_OR_RETURN(memory.data_, MallocDevice(bytes));
  memory.bytes_ = bytes;
  return memory;
}

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceMemory::~DeviceMemory() { Reset(); }

void DeviceMemory::Reset() {
  if (data_ != nullptr) cudaFree(data_);
  data_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<PinnedMemory> PinnedMemory::Allocate(size_t bytes) {
  PinnedMemory memory;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMallocHost(&memory.data_, bytes));
  memory.bytes_ = bytes;
  return memory;
}

PinnedMemory::PinnedMemory(PinnedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

PinnedMemory& PinnedMemory::operator=(PinnedMemory&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

PinnedMemory::~PinnedMemory() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

absl::StatusOr<void*> Workspace::Reserve(size_t bytes, cudaStream_t stream) {
  if (bytes <= memory_.bytes() && memory_.get() != nullptr) return memory_.get();
  constexpr size_t kGranule = size_t{1} << 20;
  const size_t grown = std::max(bytes, 2 * memory_.bytes());
  const size_t rounded = (grown + kGranule - 1) / kGranule * kGranule;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  memory_.Reset();
  absl::StatusOr<DeviceMemory> memory = DeviceMemory::Allocate(rounded);
  if (!memory.ok() && absl::IsResourceExhausted(memory.status()) && rounded > bytes) {
    memory = DeviceMemory::Allocate(bytes);  // the headroom did not fit; the request may
  }
  if (!memory.ok()) return memory.status();
  memory_ = *std::move(memory);
  return memory_.get();
}

}  // namespace tandem::gpu_worker::cuda_backend
