// The `cuda` Backend: one device, one non-blocking stream on which every operation and copy is
// queued in issue order, a cuBLAS handle bound to that stream, a growable workspace, and pinned
// staging memory for small host-to-device copies. Parameters are checked on the host (cheaply:
// null pointers, sizes, dtypes, alignment) before anything is queued.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "convert.cuh"
#include "cuda_check.h"
#include "cuda_resources.h"
#include "embed_norm.cuh"
#include "fp8_gemm.h"
#include "gemv.cuh"
#include "gemv_fp8.cuh"
#include "kv_write.cuh"
#include "key_projection.cuh"
#include "low_rank_score.cuh"
#include "merge_states.cuh"
#include "page_select.cuh"
#include "page_summary.cuh"
#include "param_checks.h"
#include "rope.cuh"
#include "sampling.cuh"
#include "swiglu.cuh"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/backend.h"
#include "window_attention.cuh"

namespace tandem::gpu_worker {
namespace {

using cuda_backend::CublasHandle;
using cuda_backend::CudaEvent;
using cuda_backend::CudaStream;
using cuda_backend::DeviceMemory;
using cuda_backend::PinnedMemory;
using cuda_backend::Workspace;
using cuda_backend::Aligned16;
using cuda_backend::CheckDim;
using cuda_backend::CheckSelectPages;
using cuda_backend::CheckWindowAttention;
using cuda_backend::CheckWriteKv;
using cuda_backend::DTypeStr;
using cuda_backend::Invalid;
using cuda_backend::SelectPagesArgsOf;
using cuda_backend::WindowAttentionArgsOf;
using cuda_backend::WriteKvArgsOf;

// Host-to-device copies up to this size go through pinned staging memory and return without
// waiting; larger ones copy from pageable memory and wait. A CopyToHostBatch of up to this many
// bytes lands in the same staging, behind the uploads still queued.
constexpr size_t kStagingBytes = size_t{4} << 20;
constexpr size_t kMaxStagedCopy = size_t{256} << 10;

// Entries per batched launch at most (the grid's y or z extent); longer batches run the rest
// one by one.
constexpr int64_t kMaxBatch = 65535;

// Counters of the decode kernel's fused split merge (window_attention.cuh's split_counters): one
// per (row tile or batch entry, kv head) of a launch; 256 KiB.
constexpr int64_t kSplitCounters = 65536;

// Bytes of device memory held by a backend's allocations; shared with the buffers' deleters so a
// buffer may outlive the backend.
struct AllocationStats {
  std::atomic<size_t> in_use{0};
  size_t peak = 0;
};

class CudaBackend final : public Backend {
 public:
  // The events of the upload slots: uploaded_[slot] on the upload stream, released_[slot] on the
  // compute stream.
  struct UploadEvents {
    CudaEvent uploaded[kUploadSlots];
    CudaEvent released[kUploadSlots];
  };

  CudaBackend(int device, cudaDeviceProp props, CudaStream stream, CudaStream upload_stream,
              UploadEvents upload_events, CublasHandle cublas, PinnedMemory staging,
              PinnedMemory result_host, DeviceMemory result_device, BackendOptions options)
      : device_(device),
        props_(props),
        stream_(std::move(stream)),
        upload_stream_(std::move(upload_stream)),
        upload_events_(std::move(upload_events)),
        cublas_(std::move(cublas)),
        staging_(std::move(staging)),
        result_host_(std::move(result_host)),
        result_device_(std::move(result_device)),
        exact_prefill_(options.prefill_attention == PrefillAttention::kExact) {}

  ~CudaBackend() override {
    // Queued work may still use the workspace and staging memory the members free.
    if (cudaSetDevice(device_) == cudaSuccess) {
      cudaStreamSynchronize(stream_.get());
      cudaStreamSynchronize(upload_stream_.get());
    }
  }

  std::string_view name() const override { return "cuda"; }
  std::string device_description() const override {
    return absl::StrCat(props_.name, " (device ", device_, ", sm_", props_.major, props_.minor,
                        ", ", props_.multiProcessorCount, " SMs, ", props_.totalGlobalMem >> 20,
                        " MiB)");
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src_host, size_t bytes) override;
  absl::Status CopyToHost(void* dst_host, const void* src, size_t bytes) override;
  absl::Status CopyToHost2D(void* dst_host, size_t dst_pitch, const void* src, size_t src_pitch,
                            size_t row_bytes, size_t rows) override;
  absl::Status CopyToHostBatch(const HostCopy2D* copies, size_t count) override;
  absl::Status CopyToDevice2D(void* dst, size_t dst_pitch, const void* src_host, size_t src_pitch,
                            size_t row_bytes, size_t rows) override;
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override;
  absl::Status Fill(float* dst, float value, size_t count) override;
  absl::Status Synchronize() override;
  absl::Status MarkDevice(int mark) override;
  absl::StatusOr<double> DeviceSeconds(int from, int to) override;
  absl::Status FenceDevice(int fence) override;
  absl::Status WaitFence(int fence) override;
  size_t bytes_in_use() const override { return stats_->in_use.load(); }
  size_t peak_bytes_in_use() const override { return stats_->peak; }
  absl::StatusOr<size_t> DeviceMemoryUsed() override;
  absl::StatusOr<size_t> DeviceMemoryTotal() override;
  absl::StatusOr<DeviceBuffer> AllocateHost(size_t bytes) override;
  absl::Status UploadAsync(const UploadParams& p, int slot) override;
  absl::Status WaitUpload(int slot) override;
  absl::Status ReleaseUpload(int slot) override;
  absl::Status RandomFill(const RandomFillParams& p) override;

  absl::Status Embed(const EmbedParams& p) override;
  absl::Status RmsNorm(const RmsNormParams& p) override;
  bool SupportsFp8Weights() const override { return true; }
  absl::Status MatMul(const MatMulParams& p) override;
  absl::Status Rope(const RopeParams& p) override;
  absl::Status SwiGlu(const SwiGluParams& p) override;
  absl::Status WriteKv(const WriteKvParams& p) override;
  absl::Status WindowAttention(const WindowAttentionParams& p) override;
  absl::Status WriteKvBatch(const WriteKvParams* params, size_t count) override;
  absl::Status WindowAttentionBatch(const WindowAttentionParams* params, size_t count) override;
  absl::Status MergeStates(const MergeParams& p) override;
  absl::StatusOr<int32_t> Sample(const SampleParams& p) override;
  absl::Status TokenLogProbs(const TokenLogProbParams& p) override;
  absl::Status SummarizePages(const SummarizePagesParams& p) override;
  absl::Status SelectPages(const SelectPagesParams& p) override;
  absl::Status SelectPagesBatch(const SelectPagesParams* params, size_t count) override;
  absl::Status KeyGram(const KeyGramParams& p) override;
  absl::Status ProjectKeys(const ProjectKeysParams& p) override;

 private:
  // Makes this backend's device current for the calling thread (cheap when it already is).
  absl::Status Activate() {
    TANDEM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return absl::OkStatus();
  }
  // Waits for the stream; all staged copies are then done, so the staging memory is free again.
  absl::Status SyncStream() {
    TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
    staging_used_ = 0;
    return absl::OkStatus();
  }
  cudaStream_t stream() const { return stream_.get(); }
  // WindowAttention after CheckWindowAttention(p) and Activate().
  absl::Status WindowAttentionChecked(const WindowAttentionParams& p);
  // SelectPages after CheckSelectPages(p) and Activate(): kLowRank scores by its own kernel,
  // the others in LaunchSelectPages; then the same keep and top-k.
  absl::Status SelectPagesChecked(const SelectPagesParams& p);
  // MatMul of FP8 weights (MatMulParams' numerics) and its two paths past the GEMV.
  absl::Status MatMulFp8(const MatMulParams& p);
  absl::Status MatMulFp8Gemm(const MatMulParams& p);
  absl::Status MatMulFp8Slabs(const MatMulParams& p);
  // Points args at the split-merge counters (allocated and zeroed on first use, on the stream);
  // used by WindowAttentionBatch.
  absl::Status WithSplitCounters(cuda_backend::WindowAttentionArgs& args);

  // Declaration order is destruction order reversed: the stream outlives what uses it.
  const int device_;
  const cudaDeviceProp props_;
  CudaStream stream_;
  CudaStream upload_stream_;
  UploadEvents upload_events_;
  CudaEvent marks_[kDeviceMarks];   // MarkDevice's, created at the first use of each
  bool marked_[kDeviceMarks] = {};  // recorded since creation
  CudaEvent fences_[kDeviceFences];   // FenceDevice's, untimed, created at the first use of each
  CublasHandle cublas_;
  Workspace workspace_;
  PinnedMemory staging_;
  size_t staging_used_ = 0;
  PinnedMemory result_host_;    // int32: Sample's result
  DeviceMemory result_device_;  // int32: Sample's result
  // BackendOptions::prefill_attention == kExact: prefill plans keep the f32-accurate kernel.
  const bool exact_prefill_;
  std::shared_ptr<AllocationStats> stats_ = std::make_shared<AllocationStats>();
  // Host tables of the batched operations, kept to avoid reallocating them every call.
  std::vector<cuda_backend::WriteKvArgs> write_kv_table_;
  std::vector<cuda_backend::DecodeBatchSegment> batch_segments_;
  std::vector<size_t> batch_singles_;
  std::vector<cuda_backend::SelectPagesEntry> select_entries_;
  DeviceMemory split_counters_;  // [kSplitCounters] unsigned, 0 between launches
  // The FP8 tensor-core GEMM, made at the first FP8 MatMul past the GEMV's rows; unavailable
  // on a device it refuses (before sm_90: MatMulFp8Slabs then).
  std::optional<cuda_backend::Fp8Gemm> fp8_gemm_;
  bool fp8_gemm_unavailable_ = false;
};

absl::StatusOr<DeviceBuffer> CudaBackend::Allocate(size_t bytes) {
  TANDEM_RETURN_IF_ERROR(Activate());
  // A 0-byte buffer still gets a real (tiny) block, as on the cpu backend.
  TANDEM_ASSIGN_OR_RETURN(void* data, cuda_backend::MallocDevice(std::max<size_t>(bytes, 1)));
  const size_t in_use = stats_->in_use.fetch_add(bytes) + bytes;
  stats_->peak = std::max(stats_->peak, in_use);
  return DeviceBuffer(data, bytes, [stats = stats_, device = device_, bytes](void* ptr) {
    // cudaFree waits for queued work that may still use the memory.
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                          cudaSetDevice(device) == cudaSuccess;
    cudaFree(ptr);
    if (switched) cudaSetDevice(previous);
    stats->in_use.fetch_sub(bytes);
  });
}

absl::Status CudaBackend::CopyToDevice(void* dst, const void* src_host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src_host == nullptr) return Invalid("CopyToDevice", "null pointer");
  TANDEM_RETURN_IF_ERROR(Activate());
  if (bytes <= kMaxStagedCopy) {
    size_t offset = (staging_used_ + 63) / 64 * 64;
    if (offset + bytes > staging_.bytes()) {
      TANDEM_RETURN_IF_ERROR(SyncStream());
      offset = 0;
    }
    char* staged = static_cast<char*>(staging_.get()) + offset;
    std::memcpy(staged, src_host, bytes);
    TANDEM_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, staged, bytes, cudaMemcpyHostToDevice, stream()));
    staging_used_ = offset + bytes;
    return absl::OkStatus();
  }
  TANDEM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, stream()));
  return SyncStream();  // src_host may be reused as soon as this returns
}

absl::Status CudaBackend::CopyToHost(void* dst_host, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst_host == nullptr || src == nullptr) return Invalid("CopyToHost", "null pointer");
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, stream()));
  return SyncStream();
}

absl::Status CudaBackend::CopyToHost2D(void* dst_host, size_t dst_pitch, const void* src,
                                       size_t src_pitch, size_t row_bytes, size_t rows) {
  if (row_bytes == 0 || rows == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      CheckStridedCopy("CopyToHost2D", dst_host, dst_pitch, src, src_pitch, row_bytes));
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dst_host, dst_pitch, src, src_pitch, row_bytes,
                                                rows, cudaMemcpyDeviceToHost, stream()));
  return SyncStream();
}

absl::Status CudaBackend::CopyToHostBatch(const HostCopy2D* copies, size_t count) {
  // Staged bytes: each copy packed (row_bytes pitch) at a 64-byte aligned offset.
  auto staged_bytes = [](const HostCopy2D& c) { return (c.row_bytes * c.rows + 63) / 64 * 64; };
  size_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    const HostCopy2D& c = copies[i];
    if (c.empty()) continue;
    TANDEM_RETURN_IF_ERROR(CheckStridedCopy(absl::StrCat("CopyToHostBatch: copy ", i), c.dst_host,
                                            c.dst_pitch, c.src, c.src_pitch, c.row_bytes));
    total += staged_bytes(c);
  }
  if (total == 0) return absl::OkStatus();
  if (total > kMaxStagedCopy) return Backend::CopyToHostBatch(copies, count);
  TANDEM_RETURN_IF_ERROR(Activate());
  // After the staged uploads still queued (they leave the staging before the downloads land).
  size_t offset = (staging_used_ + 63) / 64 * 64;
  if (offset + total > staging_.bytes()) {
    TANDEM_RETURN_IF_ERROR(SyncStream());
    offset = 0;
  }
  char* const staged = static_cast<char*>(staging_.get()) + offset;
  size_t at = 0;
  for (size_t i = 0; i < count; ++i) {
    const HostCopy2D& c = copies[i];
    if (c.empty()) continue;
    TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(staged + at, c.row_bytes, c.src, c.src_pitch,
                                                  c.row_bytes, c.rows, cudaMemcpyDeviceToHost,
                                                  stream()));
    at += staged_bytes(c);
  }
  TANDEM_RETURN_IF_ERROR(SyncStream());   // the one wait (it also frees the staging)
  at = 0;
  for (size_t i = 0; i < count; ++i) {
    const HostCopy2D& c = copies[i];
    if (c.empty()) continue;
    const char* from = staged + at;
    char* to = static_cast<char*>(c.dst_host);
    if (c.dst_pitch == c.row_bytes) {
      std::memcpy(to, from, c.row_bytes * c.rows);
    } else {
      for (size_t r = 0; r < c.rows; ++r) {
        std::memcpy(to + r * c.dst_pitch, from + r * c.row_bytes, c.row_bytes);
      }
    }
    at += staged_bytes(c);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToDevice2D(void* dst, size_t dst_pitch, const void* src_host,
                                         size_t src_pitch, size_t row_bytes, size_t rows) {
  if (row_bytes == 0 || rows == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      CheckStridedCopy("CopyToDevice2D", dst, dst_pitch, src_host, src_pitch, row_bytes));
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dst, dst_pitch, src_host, src_pitch, row_bytes,
                                                rows, cudaMemcpyHostToDevice, stream()));
  return SyncStream();  // src_host may be reused as soon as this returns
}

absl::Status CudaBackend::CopyOnDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) return Invalid("CopyOnDevice", "null pointer");
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::Fill(float* dst, float value, size_t count) {
  if (count == 0) return absl::OkStatus();
  if (dst == nullptr) return Invalid("Fill", "null pointer");
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchFill(
      {.dst = dst, .value = value, .count = static_cast<int64_t>(count)}, stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::MarkDevice(int mark) {
  if (mark < 0 || mark >= kDeviceMarks) {
    return Invalid("MarkDevice", absl::StrCat("mark ", mark, " not in [0, ", kDeviceMarks, ")"));
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  if (marks_[mark].get() == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(marks_[mark], CudaEvent::CreateTimed());
  }
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventRecord(marks_[mark].get(), stream()));
  marked_[mark] = true;
  return absl::OkStatus();
}

absl::StatusOr<double> CudaBackend::DeviceSeconds(int from, int to) {
  for (int m : {from, to}) {
    if (m < 0 || m >= kDeviceMarks || !marked_[m]) {
      return Invalid("DeviceSeconds", absl::StrCat("mark ", m, " was not set"));
    }
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(marks_[from].get()));
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(marks_[to].get()));
  float ms = 0.0f;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, marks_[from].get(), marks_[to].get()));
  return 1e-3 * ms;
}

absl::Status CudaBackend::FenceDevice(int fence) {
  if (fence < 0 || fence >= kDeviceFences) {
    return Invalid("FenceDevice",
                   absl::StrCat("fence ", fence, " not in [0, ", kDeviceFences, ")"));
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  if (fences_[fence].get() == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(fences_[fence], CudaEvent::Create());
  }
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventRecord(fences_[fence].get(), stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::WaitFence(int fence) {
  if (fence < 0 || fence >= kDeviceFences) {
    return Invalid("WaitFence", absl::StrCat("fence ", fence, " not in [0, ", kDeviceFences, ")"));
  }
  if (fences_[fence].get() == nullptr) return absl::OkStatus();   // never set
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(fences_[fence].get()));
  return absl::OkStatus();
}

absl::Status CudaBackend::Synchronize() {
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(upload_stream_.get()));
  return SyncStream();
}

absl::StatusOr<size_t> CudaBackend::DeviceMemoryUsed() {
  TANDEM_RETURN_IF_ERROR(Activate());
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes - free_bytes;
}

absl::StatusOr<size_t> CudaBackend::DeviceMemoryTotal() {
  TANDEM_RETURN_IF_ERROR(Activate());
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes;
}

absl::StatusOr<DeviceBuffer> CudaBackend::AllocateHost(size_t bytes) {
  TANDEM_RETURN_IF_ERROR(Activate());
  void* data = nullptr;
  const cudaError_t error = cudaMallocHost(&data, std::max<size_t>(bytes, 1));
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(
        "cudaMallocHost of ", FormatBytes(bytes), " failed: ", cudaGetErrorName(error)));
  }
  // cudaFreeHost waits for queued copies that may still read the memory.
  return DeviceBuffer(data, bytes, [](void* ptr) { cudaFreeHost(ptr); });
}

absl::Status CudaBackend::UploadAsync(const UploadParams& p, int slot) {
  if (slot < 0 || slot >= kUploadSlots) return Invalid("UploadAsync", "slot out of range");
  if (p.rows == 0 || p.row_bytes == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(
      CheckStridedCopy("UploadAsync", p.dst, p.dst_pitch, p.src_host, p.src_pitch, p.row_bytes));
  TANDEM_RETURN_IF_ERROR(Activate());
  cudaStream_t upload = upload_stream_.get();
  TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(upload, upload_events_.released[slot].get()));
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(p.dst, p.dst_pitch, p.src_host, p.src_pitch,
                                                p.row_bytes, p.rows, cudaMemcpyHostToDevice,
                                                upload));
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventRecord(upload_events_.uploaded[slot].get(), upload));
  return absl::OkStatus();
}

absl::Status CudaBackend::WaitUpload(int slot) {
  if (slot < 0 || slot >= kUploadSlots) return Invalid("WaitUpload", "slot out of range");
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream(), upload_events_.uploaded[slot].get()));
  return absl::OkStatus();
}

absl::Status CudaBackend::ReleaseUpload(int slot) {
  if (slot < 0 || slot >= kUploadSlots) return Invalid("ReleaseUpload", "slot out of range");
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cudaEventRecord(upload_events_.released[slot].get(), stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::RandomFill(const RandomFillParams& p) {
  if (p.count == 0) return absl::OkStatus();
  if (p.dst == nullptr) return Invalid("RandomFill", "null pointer");
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16 && p.dtype != DType::kF16 &&
      p.dtype != DType::kF8E4M3) {
    return Invalid("RandomFill", "dtype must be f32, bf16, f16 or f8e4m3");
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchRandomFill(
      {.dst = p.dst, .dtype = p.dtype, .count = static_cast<int64_t>(p.count), .seed = p.seed,
       .scale = p.scale},
      stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::Embed(const EmbedParams& p) {
  if (p.ids == nullptr || p.table == nullptr || p.out == nullptr) {
    return Invalid("Embed", "null pointer");
  }
  TANDEM_RETURN_IF_ERROR(CheckDim("Embed", "num_tokens", p.num_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim("Embed", "hidden", p.hidden));
  TANDEM_RETURN_IF_ERROR(CheckDim("Embed", "vocab", p.vocab));
  if (p.table_dtype != DType::kF32 && p.table_dtype != DType::kBF16 &&
      p.table_dtype != DType::kF16) {
    return Invalid("Embed", "table dtype must be f32, bf16 or f16");
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchEmbed({.ids = p.ids,
                                                         .table = p.table,
                                                         .table_dtype = p.table_dtype,
                                                         .out = p.out,
                                                         .num_tokens = p.num_tokens,
                                                         .hidden = p.hidden,
                                                         .vocab = p.vocab},
                                                        stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::RmsNorm(const RmsNormParams& p) {
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) {
    return Invalid("RmsNorm", "null pointer");
  }
  TANDEM_RETURN_IF_ERROR(CheckDim("RmsNorm", "num_tokens", p.num_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim("RmsNorm", "hidden", p.hidden));
  if (p.weight_dtype != DType::kF32 && p.weight_dtype != DType::kBF16 &&
      p.weight_dtype != DType::kF16) {
    return Invalid("RmsNorm", "weight dtype must be f32, bf16 or f16");
  }
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) return Invalid("RmsNorm", "eps must be >= 0");
  TANDEM_RETURN_IF_ERROR(CheckDim("RmsNorm", "vectors_per_token", p.vectors_per_token));
  if (p.token_stride != 0 && p.token_stride < p.vectors_per_token * p.hidden) {
    return Invalid("RmsNorm", "token_stride must be 0 or at least vectors_per_token x hidden");
  }
  if (p.num_tokens * p.vectors_per_token > INT_MAX) {
    return Invalid("RmsNorm", "num_tokens x vectors_per_token exceeds the grid");
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchRmsNorm(
      {.x = p.x,
       .weight = p.weight,
       .weight_dtype = p.weight_dtype,
       .out = p.out,
       .num_tokens = p.num_tokens,
       .hidden = p.hidden,
       .eps = p.eps,
       .vectors_per_token = p.vectors_per_token,
       .token_stride = p.token_stride != 0 ? p.token_stride : p.vectors_per_token * p.hidden},
      stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::MatMul(const MatMulParams& p) {
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr) return Invalid("MatMul", "null pointer");
  if (static_cast<const void*>(p.x) == static_cast<const void*>(p.y)) {
    return Invalid("MatMul", "y must not alias x");
  }
  TANDEM_RETURN_IF_ERROR(CheckDim("MatMul", "m", p.m));
  TANDEM_RETURN_IF_ERROR(CheckDim("MatMul", "n", p.n));
  TANDEM_RETURN_IF_ERROR(CheckDim("MatMul", "k", p.k));
  cudaDataType_t type;
  switch (p.w_dtype) {
    case DType::kF32:
      type = CUDA_R_32F;
      break;
    case DType::kBF16:
      type = CUDA_R_16BF;
      break;
    case DType::kF16:
      type = CUDA_R_16F;
      break;
    case DType::kF8E4M3:
      type = CUDA_R_16BF;  // dequantized rows (MatMulParams)
      break;
    default:
      return Invalid("MatMul", absl::StrCat("weight dtype ", DTypeStr(p.w_dtype),
                                            " is not supported (f32, bf16, f16, f8e4m3)"));
  }
  if ((p.w_scale != nullptr) != (p.w_dtype == DType::kF8E4M3)) {
    return Invalid("MatMul", "w_scale is required for FP8 weights and only for them");
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  // Decode rows: one GEMV launch (gemv.cuh) instead of conversion + cuBLAS (+ split-K reduce,
  // + bias), same numerics.
  const cuda_backend::GemvArgs gemv{.x = p.x,
                                    .w = p.w,
                                    .w_dtype = p.w_dtype,
                                    .bias = p.bias,
                                    .y = p.y,
                                    .m = p.m,
                                    .n = p.n,
                                    .k = p.k,
                                    .accumulate = p.accumulate};
  if (p.w_dtype == DType::kF8E4M3) return MatMulFp8(p);
  if (cuda_backend::GemvPreferred(gemv)) {
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchGemv(gemv, stream()));
    return absl::OkStatus();
  }
  // x is rounded to the weight's dtype (backend.h's numerics), into the workspace.
  const void* x = p.x;
  if (p.w_dtype != DType::kF32) {
    const size_t count = static_cast<size_t>(p.m) * static_cast<size_t>(p.k);
    TANDEM_ASSIGN_OR_RETURN(void* converted, workspace_.Reserve(count * 2, stream()));
    TANDEM_CUDA_RETURN_IF_ERROR(
        cuda_backend::LaunchConvertFromF32({.src = p.x,
                                            .dst = converted,
                                            .dst_dtype = p.w_dtype,
                                            .count = static_cast<int64_t>(count)},
                                           stream()));
    x = converted;
  }
  // Row-major y[m, n] = x[m, k]·w[n, k]ᵀ is column-major yᵀ[n, m] = op(A)·B with A = w seen as
  // column-major k×n (lda = k) transposed, B = x seen as column-major k×m (ldb = k), ldc = n.
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  const int m = static_cast<int>(p.m);
  const int n = static_cast<int>(p.n);
  const int k = static_cast<int>(p.k);
  TANDEM_CUBLAS_RETURN_IF_ERROR(
      cublasGemmEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, p.w, type, k, x, type,
                   k, &beta, p.y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (p.bias != nullptr) {
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchAddBias(
        {.y = p.y, .bias = p.bias, .rows = p.m, .cols = p.n}, stream()));
  }
  return absl::OkStatus();
}

// FP8 weights (MatMulParams): decode rows on the FP8 GEMV (gemv_fp8.cuh), the others on the FP8
// tensor cores (fp8_gemm.h: x quantized per row into the workspace, kCudaFp8SlabBytes at a
// time), and where cuBLASLt has no such kernel (before sm_90, odd shapes) on bf16 slabs of w.
absl::Status CudaBackend::MatMulFp8(const MatMulParams& p) {
  const cuda_backend::GemvFp8Args gemv{.x = p.x,
                                       .w = p.w,
                                       .w_scale = p.w_scale,
                                       .bias = p.bias,
                                       .y = p.y,
                                       .m = p.m,
                                       .n = p.n,
                                       .k = p.k,
                                       .accumulate = p.accumulate};
  if (cuda_backend::GemvFp8Preferred(gemv)) {
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchGemvFp8(gemv, stream()));
    return absl::OkStatus();
  }
  const bool aligned =
      reinterpret_cast<uintptr_t>(p.w) % 16 == 0 && reinterpret_cast<uintptr_t>(p.y) % 16 == 0;
  if (aligned && cuda_backend::Fp8Gemm::Supports(p.m, p.n, p.k) && !fp8_gemm_unavailable_) {
    const absl::Status status = MatMulFp8Gemm(p);
    if (!absl::IsUnimplemented(status)) return status;
    // No kernel for this shape (nothing was launched): the slabs, this call.
  }
  return MatMulFp8Slabs(p);
}

// Rows of x in tiles that fit the FP8 scratch: each tile's codes and scales, then its GEMM. Every
// tile's kernel is chosen before the first runs, so UNIMPLEMENTED leaves y untouched.
absl::Status CudaBackend::MatMulFp8Gemm(const MatMulParams& p) {
  if (!fp8_gemm_.has_value()) {
    absl::StatusOr<cuda_backend::Fp8Gemm> gemm = cuda_backend::Fp8Gemm::Create(device_);
    if (absl::IsUnimplemented(gemm.status())) fp8_gemm_unavailable_ = true;  // this device
    if (!gemm.ok()) return gemm.status();
    fp8_gemm_.emplace(*std::move(gemm));
  }
  // [workspace | scales of the tile's rows | codes of the tile], each 256-byte aligned.
  constexpr size_t kAlign = 256;
  const size_t k = static_cast<size_t>(p.k);
  const size_t room = kCudaFp8SlabBytes - cuda_backend::kFp8GemmWorkspaceBytes;
  const int64_t tile_rows =
      std::clamp<int64_t>(static_cast<int64_t>((room - kAlign) / (k + 4)), 1, p.m);
  const size_t scale_bytes = (static_cast<size_t>(tile_rows) * 4 + kAlign - 1) / kAlign * kAlign;
  TANDEM_ASSIGN_OR_RETURN(void* space,
                          workspace_.Reserve(cuda_backend::kFp8GemmWorkspaceBytes + scale_bytes +
                                                 static_cast<size_t>(tile_rows) * k,
                                             stream()));
  auto* scales = reinterpret_cast<float*>(static_cast<char*>(space) +
                                          cuda_backend::kFp8GemmWorkspaceBytes);
  auto* codes = reinterpret_cast<uint8_t*>(scales) + scale_bytes;
  auto tile = [&](int64_t r0) -> cuda_backend::Fp8GemmArgs {
    return {.x_codes = codes,
            .x_scale = scales,
            .w_codes = p.w,
            .w_scale = p.w_scale,
            .y = p.y + r0 * p.n,
            .m = std::min(tile_rows, p.m - r0),
            .n = p.n,
            .k = p.k,
            .accumulate = p.accumulate};
  };
  for (int64_t r0 = 0; r0 < p.m; r0 += tile_rows) {
    TANDEM_RETURN_IF_ERROR(fp8_gemm_->Prepare(tile(r0)));
  }
  for (int64_t r0 = 0; r0 < p.m; r0 += tile_rows) {
    const cuda_backend::Fp8GemmArgs args = tile(r0);
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchQuantizeRowsF8(
        {.x = p.x + r0 * p.k, .codes = codes, .scale = scales, .rows = args.m, .cols = p.k},
        stream()));
    TANDEM_RETURN_IF_ERROR(fp8_gemm_->Run(args, space, stream()));
  }
  if (p.bias != nullptr) {
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchAddBias(
        {.y = p.y, .bias = p.bias, .rows = p.m, .cols = p.n}, stream()));
  }
  return absl::OkStatus();
}

// x as bf16, then slabs of kCudaFp8SlabBytes of w dequantized to bf16 (code · row scale) and
// multiplied by cuBLAS into their columns of y.
absl::Status CudaBackend::MatMulFp8Slabs(const MatMulParams& p) {
  const size_t mk = static_cast<size_t>(p.m) * static_cast<size_t>(p.k);
  const size_t x_bytes = (mk * 2 + 255) / 256 * 256;
  const int64_t slab_rows = std::clamp<int64_t>(
      static_cast<int64_t>(kCudaFp8SlabBytes / (static_cast<uint64_t>(p.k) * 2)), 1, p.n);
  TANDEM_ASSIGN_OR_RETURN(
      void* space,
      workspace_.Reserve(x_bytes + static_cast<size_t>(slab_rows) * p.k * 2, stream()));
  void* x = space;
  void* slab = static_cast<char*>(space) + x_bytes;
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchConvertFromF32(
      {.src = p.x, .dst = x, .dst_dtype = DType::kBF16, .count = static_cast<int64_t>(mk)},
      stream()));
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  const auto* codes = static_cast<const uint8_t*>(p.w);
  for (int64_t r0 = 0; r0 < p.n; r0 += slab_rows) {
    const int64_t rows = std::min(slab_rows, p.n - r0);
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchDequantizeF8Rows({.codes = codes + r0 * p.k,
                                                                      .scale = p.w_scale + r0,
                                                                      .dst = slab,
                                                                      .rows = rows,
                                                                      .cols = p.k},
                                                                     stream()));
    // yᵀ[r0 : r0 + rows, :] = slab · xᵀ (MatMul's column-major view; ldc = n).
    TANDEM_CUBLAS_RETURN_IF_ERROR(
        cublasGemmEx(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows),
                     static_cast<int>(p.m), static_cast<int>(p.k), &alpha, slab, CUDA_R_16BF,
                     static_cast<int>(p.k), x, CUDA_R_16BF, static_cast<int>(p.k), &beta, p.y + r0,
                     CUDA_R_32F, static_cast<int>(p.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  if (p.bias != nullptr) {
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchAddBias(
        {.y = p.y, .bias = p.bias, .rows = p.m, .cols = p.n}, stream()));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Rope(const RopeParams& p) {
  if (p.x == nullptr || p.positions == nullptr || p.inv_freq == nullptr) {
    return Invalid("Rope", "null pointer");
  }
  TANDEM_RETURN_IF_ERROR(CheckDim("Rope", "num_tokens", p.num_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim("Rope", "num_heads", p.num_heads));
  TANDEM_RETURN_IF_ERROR(CheckDim("Rope", "head_dim", p.head_dim));
  if (p.head_dim % 2 != 0) return Invalid("Rope", "head_dim must be even");
  if (p.row_stride < p.num_heads * p.head_dim) {
    return Invalid("Rope", absl::StrCat("row_stride ", p.row_stride, " < num_heads·head_dim ",
                                        p.num_heads * p.head_dim));
  }
  if (p.inv_freq_row_stride != 0 && p.inv_freq_row_stride < p.head_dim / 2) {
    return Invalid("Rope", absl::StrCat("inv_freq_row_stride ", p.inv_freq_row_stride,
                                        " is neither 0 nor >= head_dim / 2"));
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  const cuda_backend::RopeArgs args = {.x = p.x,
                                       .row_stride = p.row_stride,
                                       .positions = p.positions,
                                       .inv_freq = p.inv_freq,
                                       .inv_freq_row_stride = p.inv_freq_row_stride,
                                       .attention_scaling = p.attention_scaling,
                                       .num_tokens = p.num_tokens,
                                       .num_heads = p.num_heads,
                                       .head_dim = p.head_dim};
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchRope(args, stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::SwiGlu(const SwiGluParams& p) {
  if (p.gate_up == nullptr || p.out == nullptr) return Invalid("SwiGlu", "null pointer");
  TANDEM_RETURN_IF_ERROR(CheckDim("SwiGlu", "num_tokens", p.num_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim("SwiGlu", "ffn", p.ffn));
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchSwiGlu(
      {.gate_up = p.gate_up, .out = p.out, .num_tokens = p.num_tokens, .ffn = p.ffn}, stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::WriteKv(const WriteKvParams& p) {
  TANDEM_RETURN_IF_ERROR(CheckWriteKv(p));
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchWriteKv(WriteKvArgsOf(p), stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::WriteKvBatch(const WriteKvParams* params, size_t count) {
  if (count == 0) return absl::OkStatus();
  if (params == nullptr) return Invalid("WriteKvBatch", "null params");
  bool same_dtype = true;
  int64_t max_elements = 0;
  for (size_t i = 0; i < count; ++i) {
    TANDEM_RETURN_IF_ERROR(CheckWriteKv(params[i]));
    same_dtype &= params[i].cache_dtype == params[0].cache_dtype;
    max_elements = std::max(max_elements,
                            params[i].num_tokens * params[i].num_kv_heads * params[i].head_dim);
  }
  if (count == 1 || count > kMaxBatch || !same_dtype) return Backend::WriteKvBatch(params, count);
  TANDEM_RETURN_IF_ERROR(Activate());
  write_kv_table_.clear();
  for (size_t i = 0; i < count; ++i) write_kv_table_.push_back(WriteKvArgsOf(params[i]));
  const size_t bytes = count * sizeof(cuda_backend::WriteKvArgs);
  TANDEM_ASSIGN_OR_RETURN(void* table, workspace_.Reserve(bytes, stream()));
  // Staged: returns without waiting; stream order keeps the table until the kernel has run.
  TANDEM_RETURN_IF_ERROR(CopyToDevice(table, write_kv_table_.data(), bytes));
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchWriteKvBatch(
      static_cast<const cuda_backend::WriteKvArgs*>(table), static_cast<int64_t>(count),
      max_elements, params[0].cache_dtype, stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::WindowAttention(const WindowAttentionParams& p) {
  TANDEM_RETURN_IF_ERROR(CheckWindowAttention(p));
  TANDEM_RETURN_IF_ERROR(Activate());
  return WindowAttentionChecked(p);
}

absl::Status CudaBackend::WithSplitCounters(cuda_backend::WindowAttentionArgs& args) {
  if (split_counters_.get() == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(split_counters_,
                            DeviceMemory::Allocate(kSplitCounters * sizeof(unsigned)));
    TANDEM_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(split_counters_.get(), 0, split_counters_.bytes(), stream()));
  }
  args.split_counters = static_cast<unsigned*>(split_counters_.get());
  args.split_counter_count = kSplitCounters;
  return absl::OkStatus();
}

absl::Status CudaBackend::WindowAttentionChecked(const WindowAttentionParams& p) {
  if (p.num_slots == 0) {  // empty window: every row is the empty state; maw has no slot
    TANDEM_RETURN_IF_ERROR(Fill(p.o, 0.0f, p.num_tokens * p.num_q_heads * p.head_dim));
    return Fill(p.lse, -INFINITY, p.num_tokens * p.num_q_heads);
  }
  // No split counters: a single launch splits into one wave of blocks that all end together, so
  // the kernel's own merge would run as an exposed tail in one block per kv head (measured on an
  // H100 at a 32K window: 65.9 µs against 61.9 µs with the combine kernel, whose programmatic
  // dependent launch overlaps the attention kernel's end). Batched launches merge in the kernel.
  const cuda_backend::WindowAttentionArgs args = WindowAttentionArgsOf(p);
  cuda_backend::WindowAttentionPlan plan;
  TANDEM_CUDA_RETURN_IF_ERROR(
      cuda_backend::PlanWindowAttention(args, props_.multiProcessorCount, &plan,
                                        /*allow_tensor_cores=*/true, exact_prefill_));
  void* workspace = nullptr;
  if (plan.workspace_bytes > 0) {
    TANDEM_ASSIGN_OR_RETURN(workspace, workspace_.Reserve(plan.workspace_bytes, stream()));
  }
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchWindowAttention(args, plan, workspace, stream()));
  if (p.maw != nullptr) {
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchMawUpdate(args, plan, workspace, stream()));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::WindowAttentionBatch(const WindowAttentionParams* params,
                                               size_t count) {
  if (count == 0) return absl::OkStatus();
  if (params == nullptr) return Invalid("WindowAttentionBatch", "null params");
  for (size_t i = 0; i < count; ++i) TANDEM_RETURN_IF_ERROR(CheckWindowAttention(params[i]));
  TANDEM_RETURN_IF_ERROR(Activate());
  // The entries the batched decode kernel takes (one row tile, no MAW update, the first such
  // entry's kv heads and head-dim bucket) run in one launch; the others one by one. Entries
  // share no destination (backend.h), so the order between the two groups does not matter.
  batch_segments_.clear();
  batch_singles_.clear();
  for (size_t i = 0; i < count; ++i) {
    const cuda_backend::WindowAttentionArgs args = WindowAttentionArgsOf(params[i]);
    const bool joins =
        cuda_backend::WindowAttentionBatchable(args) &&
        static_cast<int64_t>(batch_segments_.size()) < kMaxBatch &&
        (batch_segments_.empty() ||
         (args.num_kv_heads == batch_segments_[0].args.num_kv_heads &&
          (args.head_dim <= 64) == (batch_segments_[0].args.head_dim <= 64)));
    if (joins) {
      batch_segments_.push_back({.args = args});
    } else {
      batch_singles_.push_back(i);
    }
  }
  if (batch_segments_.size() == 1) {  // one entry: the single launch's plan fills the GPU
    batch_singles_.clear();
    for (size_t i = 0; i < count; ++i) batch_singles_.push_back(i);
    batch_segments_.clear();
  }
  for (size_t i : batch_singles_) TANDEM_RETURN_IF_ERROR(WindowAttentionChecked(params[i]));
  if (batch_segments_.empty()) return absl::OkStatus();
  for (cuda_backend::DecodeBatchSegment& segment : batch_segments_) {
    TANDEM_RETURN_IF_ERROR(WithSplitCounters(segment.args));
  }
  cuda_backend::WindowAttentionBatchPlan plan;
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::PlanWindowAttentionBatch(
      batch_segments_.data(), static_cast<int64_t>(batch_segments_.size()),
      props_.multiProcessorCount, &plan));
  TANDEM_ASSIGN_OR_RETURN(void* workspace, workspace_.Reserve(plan.workspace_bytes, stream()));
  // Staged: returns without waiting; stream order keeps the table until the kernels have run.
  TANDEM_RETURN_IF_ERROR(CopyToDevice(
      workspace, batch_segments_.data(),
      batch_segments_.size() * sizeof(cuda_backend::DecodeBatchSegment)));
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchWindowAttentionBatch(plan, workspace, stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::MergeStates(const MergeParams& p) {
  if (p.o_dst == nullptr || p.lse_dst == nullptr || p.o_src == nullptr || p.lse_src == nullptr) {
    return Invalid("MergeStates", "null pointer");
  }
  if (p.rows <= 0 || p.head_dim <= 0 || p.rows > int64_t{INT_MAX} * 4) {
    return Invalid("MergeStates", absl::StrCat("rows ", p.rows, " and head_dim ", p.head_dim,
                                               " must be positive"));
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchMergeStates({.o_dst = p.o_dst,
                                                               .lse_dst = p.lse_dst,
                                                               .o_src = p.o_src,
                                                               .lse_src = p.lse_src,
                                                               .rows = p.rows,
                                                               .head_dim = p.head_dim},
                                                              stream()));
  return absl::OkStatus();
}

absl::StatusOr<int32_t> CudaBackend::Sample(const SampleParams& p) {
  if (p.logits == nullptr) return Invalid("Sample", "null pointer");
  TANDEM_RETURN_IF_ERROR(CheckDim("Sample", "vocab", p.vocab));
  if (std::isnan(p.temperature) || std::isnan(p.top_p)) {
    return Invalid("Sample", "temperature and top_p must not be NaN");
  }
  if (!(p.uniform >= 0.0f && p.uniform < 1.0f)) {
    return Invalid("Sample", absl::StrCat("uniform ", p.uniform, " not in [0, 1)"));
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  // The kernel's argmax path (temperature 0) where nothing else can be chosen: no sort.
  const bool argmax_only = p.ArgmaxOnly();
  const cuda_backend::SampleArgs args{.logits = p.logits,
                                      .vocab = p.vocab,
                                      .temperature = argmax_only ? 0.0f : p.temperature,
                                      .top_k = p.top_k,
                                      .top_p = p.top_p,
                                      .uniform = p.uniform,
                                      .result = static_cast<int32_t*>(result_device_.get())};
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  if (!argmax_only) {
    TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::SampleWorkspaceBytes(p.vocab, &workspace_bytes));
    TANDEM_ASSIGN_OR_RETURN(workspace, workspace_.Reserve(workspace_bytes, stream()));
  }
  TANDEM_CUDA_RETURN_IF_ERROR(
      cuda_backend::LaunchSample(args, workspace, workspace_bytes, stream()));
  TANDEM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(result_host_.get(), result_device_.get(),
                                              sizeof(int32_t), cudaMemcpyDeviceToHost, stream()));
  TANDEM_RETURN_IF_ERROR(SyncStream());
  const int32_t id = *static_cast<const int32_t*>(result_host_.get());
  if (id < 0 || id >= p.vocab) {
    return absl::InternalError(
        absl::StrCat("Sample: kernel returned id ", id, " outside [0, ", p.vocab, ")"));
  }
  return id;
}

absl::Status CudaBackend::TokenLogProbs(const TokenLogProbParams& p) {
  if (p.logits == nullptr || p.targets == nullptr || p.out == nullptr) {
    return Invalid("TokenLogProbs", "null pointer");
  }
  TANDEM_RETURN_IF_ERROR(CheckDim("TokenLogProbs", "num_tokens", p.num_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim("TokenLogProbs", "vocab", p.vocab));
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchTokenLogProbs({.logits = p.logits,
                                                                 .targets = p.targets,
                                                                 .out = p.out,
                                                                 .num_tokens = p.num_tokens,
                                                                 .vocab = p.vocab},
                                                                stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::SummarizePages(const SummarizePagesParams& p) {
  constexpr absl::string_view kOp = "SummarizePages";
  if (p.k_cache == nullptr || p.summaries == nullptr) return Invalid(kOp, "null pointer");
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "capacity", p.capacity));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_pages", p.num_pages));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "page_tokens", p.page_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "max_pages", p.max_pages));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_kv_heads", p.num_kv_heads));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "head_dim", p.head_dim));
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
    return Invalid(kOp, absl::StrCat("dtype ", DTypeStr(p.dtype), " is not supported (f32, bf16)"));
  }
  if (p.first_slot < 0 || p.num_pages > (p.capacity - p.first_slot) / p.page_tokens) {
    return Invalid(kOp, absl::StrCat("slots [", p.first_slot, ", ", p.first_slot, " + ",
                                     p.num_pages, "·", p.page_tokens, ") exceed capacity ",
                                     p.capacity));
  }
  if (p.first_page < 0 || p.num_pages > p.max_pages - p.first_page) {
    return Invalid(kOp, absl::StrCat("pages [", p.first_page, ", ", p.first_page, " + ",
                                     p.num_pages, ") exceed max_pages ", p.max_pages));
  }
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchSummarizePages({.k_cache = p.k_cache,
                                                                  .capacity = p.capacity,
                                                                  .first_slot = p.first_slot,
                                                                  .num_pages = p.num_pages,
                                                                  .page_tokens = p.page_tokens,
                                                                  .summaries = p.summaries,
                                                                  .max_pages = p.max_pages,
                                                                  .first_page = p.first_page,
                                                                  .dtype = p.dtype,
                                                                  .num_kv_heads = p.num_kv_heads,
                                                                  .head_dim = p.head_dim},
                                                                 stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::SelectPages(const SelectPagesParams& p) {
  TANDEM_RETURN_IF_ERROR(CheckSelectPages(p));
  TANDEM_RETURN_IF_ERROR(Activate());
  return SelectPagesChecked(p);
}

absl::Status CudaBackend::SelectPagesChecked(const SelectPagesParams& p) {
  const int sms = props_.multiProcessorCount;
  if (p.score != PageScore::kLowRank) {
    TANDEM_CUDA_RETURN_IF_ERROR(
        cuda_backend::LaunchSelectPages(SelectPagesArgsOf(p, sms), stream()));
    return absl::OkStatus();
  }
  if (p.num_pages > p.select) {  // else every page is selected: nothing to score
    TANDEM_CUDA_RETURN_IF_ERROR(
        cuda_backend::LaunchLowRankScores(cuda_backend::LowRankScoreArgsOf(p, sms), stream()));
  }
  TANDEM_CUDA_RETURN_IF_ERROR(
      cuda_backend::LaunchSelectFromScores(SelectPagesArgsOf(p, sms), stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::SelectPagesBatch(const SelectPagesParams* params, size_t count) {
  if (count == 0) return absl::OkStatus();
  if (params == nullptr) return Invalid("SelectPagesBatch", "null params");
  for (size_t i = 0; i < count; ++i) TANDEM_RETURN_IF_ERROR(CheckSelectPages(params[i]));
  TANDEM_RETURN_IF_ERROR(Activate());
  // The entries of the first batchable entry's shape (dtype, tokens, heads, head_dim) run in one
  // scoring and one top-k launch; the others one by one. Entries share no destination and no
  // scratch (backend.h), so the order between the two groups does not matter.
  const int sms = props_.multiProcessorCount;
  select_entries_.clear();
  batch_singles_.clear();
  const SelectPagesParams* first = nullptr;
  for (size_t i = 0; i < count; ++i) {
    const SelectPagesParams& p = params[i];
    // kLowRank entries run alone (their scoring kernel has no batched form).
    const bool joins =
        p.score != PageScore::kLowRank &&
        cuda_backend::SelectPagesBatchable(SelectPagesArgsOf(p, sms)) &&
        static_cast<int64_t>(select_entries_.size()) < kMaxBatch &&
        (first == nullptr ||
         (p.dtype == first->dtype && p.num_tokens == first->num_tokens &&
          p.num_q_heads == first->num_q_heads && p.num_kv_heads == first->num_kv_heads &&
          p.head_dim == first->head_dim && p.score == first->score));
    if (!joins) {
      batch_singles_.push_back(i);
      continue;
    }
    if (first == nullptr) first = &p;
    const cuda_backend::SelectPagesArgs a = SelectPagesArgsOf(p, sms);
    select_entries_.push_back({.q = a.q,
                               .q_row_stride = a.q_row_stride,
                               .summaries = a.summaries,
                               .max_pages = a.max_pages,
                               .num_pages = a.num_pages,
                               .select = a.select,
                               .pages = a.pages,
                               .keep = a.keep,
                               .keep_per_head = a.keep_per_head,
                               .scratch = a.scratch});
  }
  for (size_t i : batch_singles_) TANDEM_RETURN_IF_ERROR(SelectPagesChecked(params[i]));
  if (select_entries_.empty()) return absl::OkStatus();
  if (select_entries_.size() == 1) {  // one entry: the single launch's plan fills the GPU
    return SelectPages(*first);
  }
  cuda_backend::SelectPagesBatchPlan plan;
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::PlanSelectPagesBatch(
      SelectPagesArgsOf(*first, sms), select_entries_.data(),
      static_cast<int64_t>(select_entries_.size()), &plan));
  const size_t bytes = select_entries_.size() * sizeof(cuda_backend::SelectPagesEntry);
  TANDEM_ASSIGN_OR_RETURN(void* table, workspace_.Reserve(bytes, stream()));
  // Staged: returns without waiting; stream order keeps the table until the kernels have run.
  TANDEM_RETURN_IF_ERROR(CopyToDevice(table, select_entries_.data(), bytes));
  TANDEM_CUDA_RETURN_IF_ERROR(cuda_backend::LaunchSelectPagesBatch(
      plan, static_cast<const cuda_backend::SelectPagesEntry*>(table), stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::KeyGram(const KeyGramParams& p) {
  TANDEM_RETURN_IF_ERROR(cuda_backend::CheckKeyGram(p));
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(
      cuda_backend::LaunchKeyGram(cuda_backend::KeyGramArgsOf(p), stream()));
  return absl::OkStatus();
}

absl::Status CudaBackend::ProjectKeys(const ProjectKeysParams& p) {
  TANDEM_RETURN_IF_ERROR(cuda_backend::CheckProjectKeys(p));
  TANDEM_RETURN_IF_ERROR(Activate());
  TANDEM_CUDA_RETURN_IF_ERROR(
      cuda_backend::LaunchProjectKeys(cuda_backend::ProjectKeysArgsOf(p), stream()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device_ordinal,
                                                           const BackendOptions& options) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no usable CUDA device: cudaGetDeviceCount failed: ", cudaGetErrorName(error),
                     " (", cudaGetErrorString(error), ")"));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device: cudaGetDeviceCount returned 0");
  if (device_ordinal < 0 || device_ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ordinal ", device_ordinal,
                                                   " out of range: ", count, " device(s)"));
  }
  TANDEM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_ordinal));
  cudaDeviceProp props;
  TANDEM_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, device_ordinal));
  TANDEM_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  TANDEM_ASSIGN_OR_RETURN(CudaStream upload_stream, CudaStream::Create());
  CudaBackend::UploadEvents upload_events;
  for (int slot = 0; slot < Backend::kUploadSlots; ++slot) {
    TANDEM_ASSIGN_OR_RETURN(upload_events.uploaded[slot], CudaEvent::Create());
    TANDEM_ASSIGN_OR_RETURN(upload_events.released[slot], CudaEvent::Create());
  }
  TANDEM_ASSIGN_OR_RETURN(CublasHandle cublas, CublasHandle::Create(stream.get()));
  TANDEM_ASSIGN_OR_RETURN(PinnedMemory staging, PinnedMemory::Allocate(kStagingBytes));
  TANDEM_ASSIGN_OR_RETURN(PinnedMemory result_host, PinnedMemory::Allocate(sizeof(int32_t)));
  TANDEM_ASSIGN_OR_RETURN(DeviceMemory result_device, DeviceMemory::Allocate(sizeof(int32_t)));
  return std::make_unique<CudaBackend>(device_ordinal, props, std::move(stream),
                                       std::move(upload_stream), std::move(upload_events),
                                       std::move(cublas),
                                       std::move(staging), std::move(result_host),
                                       std::move(result_device), options);
}

}  // namespace tandem::gpu_worker
