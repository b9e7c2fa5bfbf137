// The `cpu` backend: "device memory" is 64-byte aligned host memory and every operation runs
// synchronously on the calling thread (oneDNN and the attention kernels use an OpenMP team of
// `threads`). See backend.h for the contract of each operation.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cpu_attention_kernels.h"
#include "cpu_elementwise.h"
#include "cpu_low_rank_keys.h"
#include "cpu_matmul.h"
#include "cpu_page_select.h"
#include "cpu_sampling.h"
#include "cpu_scratch.h"
#include "cpu_vector_kernels.h"
#include "tandem/common/bf16.h"
#include "tandem/common/byte_size.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/cpu_attention/merge_state.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/random_values.h"

namespace tandem::gpu_worker {
namespace {

// Larger requests are refused without trying (a corrupt size must not reach the allocator).
constexpr size_t kMaxAllocationBytes = size_t{1} << 40;

// Allocation counters, shared with the deleters of live buffers so that a buffer may outlive the
// backend that made it.
struct MemoryCounters {
  std::atomic<size_t> in_use{0};
  std::atomic<size_t> peak{0};
};

// The cores this process may run on (its affinity mask), at least 1.
unsigned UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return static_cast<unsigned>(count);
  }
  return 1;
}

// "model name" of /proc/cpuinfo, or "unknown CPU".
std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    size_t begin = line.find_first_not_of(" \t", colon + 1);
    return begin == std::string::npos ? std::string("unknown CPU") : line.substr(begin);
  }
  return "unknown CPU";
}

absl::Status CheckSlot(const char* op, int slot) {
  if (slot < 0 || slot >= Backend::kUploadSlots) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: slot %d", op, slot));
  }
  return absl::OkStatus();
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(unsigned threads, std::unique_ptr<cpu::CpuMatmul> matmul)
      : description_(absl::StrCat("cpu: ", threads, " threads, ", CpuModelName(), "; ",
                                  CpuIsaSummary(), "; bf16 weights: ",
                                  cpu::CpuMatmul::Bf16PathName())),
        counters_(std::make_shared<MemoryCounters>()),
        threads_(static_cast<int>(threads)),
        matmul_(std::move(matmul)),
        attention_(static_cast<int>(threads)),
        page_select_(static_cast<int>(threads)) {}

  std::string_view name() const override { return "cpu"; }
  std::string device_description() const override { return description_; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes > kMaxAllocationBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu backend: ", FormatBytes(bytes), " requested, more than the ",
                       FormatBytes(kMaxAllocationBytes), " limit"));
    }
    // aligned_alloc wants a multiple of the alignment; a 0-byte buffer still gets a real block.
    const size_t rounded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
    void* data = std::aligned_alloc(64, rounded);
    if (data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu backend: allocation of ", FormatBytes(bytes), " failed"));
    }
    const size_t now = counters_->in_use.fetch_add(bytes) + bytes;
    size_t peak = counters_->peak.load();
    while (now > peak && !counters_->peak.compare_exchange_weak(peak, now)) {
    }
    std::shared_ptr<MemoryCounters> counters = counters_;
    return DeviceBuffer(data, bytes, [counters, bytes](void* p) {
      std::free(p);
      counters->in_use.fetch_sub(bytes);
    });
  }

  absl::Status CopyToDevice(void* dst, const void* src_host, size_t bytes) override {
    return Copy("CopyToDevice", dst, src_host, bytes);
  }
  absl::Status CopyToHost(void* dst_host, const void* src, size_t bytes) override {
    return Copy("CopyToHost", dst_host, src, bytes);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return Copy("CopyOnDevice", dst, src, bytes);
  }

  absl::Status CopyToHost2D(void* dst_host, size_t dst_pitch, const void* src, size_t src_pitch,
                            size_t row_bytes, size_t rows) override {
    if (rows == 0 || row_bytes == 0) return absl::OkStatus();
    TANDEM_RETURN_IF_ERROR(
        CheckStridedCopy("CopyToHost2D", dst_host, dst_pitch, src, src_pitch, row_bytes));
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<std::byte*>(dst_host) + r * dst_pitch,
                  static_cast<const std::byte*>(src) + r * src_pitch, row_bytes);
    }
    return absl::OkStatus();
  }

  absl::Status CopyToDevice2D(void* dst, size_t dst_pitch, const void* src_host, size_t src_pitch,
                            size_t row_bytes, size_t rows) override {
    if (rows == 0 || row_bytes == 0) return absl::OkStatus();
    TANDEM_RETURN_IF_ERROR(
        CheckStridedCopy("CopyToDevice2D", dst, dst_pitch, src_host, src_pitch, row_bytes));
    for (size_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<std::byte*>(dst) + r * dst_pitch,
                  static_cast<const std::byte*>(src_host) + r * src_pitch, row_bytes);
    }
    return absl::OkStatus();
  }

  absl::Status Fill(float* dst, float value, size_t count) override {
    if (count == 0) return absl::OkStatus();
    if (dst == nullptr) return absl::InvalidArgumentError("Fill: null pointer");
    std::fill_n(dst, count, value);
    return absl::OkStatus();
  }

  absl::Status Synchronize() override { return absl::OkStatus(); }  // every op is synchronous
  absl::Status MarkDevice(int mark) override {
    if (mark < 0 || mark >= kDeviceMarks) {
      return absl::InvalidArgumentError(
          absl::StrCat("MarkDevice: mark ", mark, " not in [0, ", kDeviceMarks, ")"));
    }
    marks_[mark] = std::chrono::steady_clock::now();
    return absl::OkStatus();
  }
  absl::Status FenceDevice(int fence) override { return CheckFence("FenceDevice", fence); }
  absl::Status WaitFence(int fence) override { return CheckFence("WaitFence", fence); }
  absl::StatusOr<double> DeviceSeconds(int from, int to) override {
    for (int m : {from, to}) {
      if (m < 0 || m >= kDeviceMarks || !marks_[m].has_value()) {
        return absl::InvalidArgumentError(absl::StrCat("DeviceSeconds: mark ", m, " was not set"));
      }
    }
    return std::chrono::duration<double>(*marks_[to] - *marks_[from]).count();
  }

  absl::StatusOr<size_t> DeviceMemoryUsed() override { return bytes_in_use(); }
  absl::StatusOr<size_t> DeviceMemoryTotal() override {
    const long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page_bytes <= 0) {
      return absl::InternalError("sysconf(_SC_PHYS_PAGES) failed");
    }
    return static_cast<size_t>(pages) * static_cast<size_t>(page_bytes);
  }
  absl::StatusOr<DeviceBuffer> AllocateHost(size_t bytes) override { return Allocate(bytes); }

  absl::Status UploadAsync(const UploadParams& p, int slot) override {
    if (slot < 0 || slot >= kUploadSlots) {
      return absl::InvalidArgumentError(absl::StrFormat("UploadAsync: slot %d", slot));
    }
    if (p.rows == 0 || p.row_bytes == 0) return absl::OkStatus();
    TANDEM_RETURN_IF_ERROR(
        CheckStridedCopy("UploadAsync", p.dst, p.dst_pitch, p.src_host, p.src_pitch, p.row_bytes));
    for (size_t r = 0; r < p.rows; ++r) {
      std::memcpy(static_cast<std::byte*>(p.dst) + r * p.dst_pitch,
                  static_cast<const std::byte*>(p.src_host) + r * p.src_pitch, p.row_bytes);
    }
    return absl::OkStatus();
  }
  absl::Status WaitUpload(int slot) override { return CheckSlot("WaitUpload", slot); }
  absl::Status ReleaseUpload(int slot) override { return CheckSlot("ReleaseUpload", slot); }

  absl::Status RandomFill(const RandomFillParams& p) override {
    if (p.count == 0) return absl::OkStatus();
    if (p.dst == nullptr) return absl::InvalidArgumentError("RandomFill: null pointer");
    switch (p.dtype) {
      case DType::kF32: {
        float* d = static_cast<float*>(p.dst);
        for (size_t i = 0; i < p.count; ++i) d[i] = RandomSigned(p.seed, i, p.scale);
        return absl::OkStatus();
      }
      case DType::kBF16: {
        bf16_t* d = static_cast<bf16_t*>(p.dst);
        for (size_t i = 0; i < p.count; ++i) d[i] = FloatToBf16(RandomSigned(p.seed, i, p.scale));
        return absl::OkStatus();
      }
      case DType::kF16: {
        uint16_t* d = static_cast<uint16_t*>(p.dst);
        for (size_t i = 0; i < p.count; ++i) d[i] = cpu::FloatToF16(RandomSigned(p.seed, i, p.scale));
        return absl::OkStatus();
      }
      default:
        return absl::InvalidArgumentError("RandomFill: dtype must be f32, bf16 or f16");
    }
  }

  size_t bytes_in_use() const override { return counters_->in_use.load(); }
  size_t peak_bytes_in_use() const override { return counters_->peak.load(); }

  absl::Status Embed(const EmbedParams& p) override { return cpu::RunEmbed(p); }
  absl::Status RmsNorm(const RmsNormParams& p) override { return cpu::RunRmsNorm(p, scratch_); }
  absl::Status Rope(const RopeParams& p) override { return cpu::RunRope(p, scratch_); }
  absl::Status SwiGlu(const SwiGluParams& p) override { return cpu::RunSwiGlu(p); }
  absl::Status WriteKv(const WriteKvParams& p) override { return cpu::RunWriteKv(p); }

  absl::Status MatMul(const MatMulParams& p) override {
    TANDEM_RETURN_IF_ERROR(cpu::ValidateMatMul(p));
    return matmul_->Run(p);
  }

  absl::Status WindowAttention(const WindowAttentionParams& p) override {
    TANDEM_RETURN_IF_ERROR(cpu::ValidateWindowAttention(p));
    return attention_.Run(p);
  }

  absl::Status MergeStates(const MergeParams& p) override {
    if (p.o_dst == nullptr || p.lse_dst == nullptr || p.o_src == nullptr || p.lse_src == nullptr) {
      return absl::InvalidArgumentError("MergeStates: null pointer");
    }
    if (p.rows <= 0 || p.head_dim <= 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "MergeStates: rows (%d) and head_dim (%d) must be positive", p.rows, p.head_dim));
    }
    cpu_attention::MergeStates(p.o_dst, p.lse_dst, p.o_src, p.lse_src, p.o_dst, p.lse_dst,
                               static_cast<size_t>(p.rows), static_cast<size_t>(p.head_dim));
    return absl::OkStatus();
  }

  absl::StatusOr<int32_t> Sample(const SampleParams& p) override { return cpu::RunSample(p); }
  absl::Status TokenLogProbs(const TokenLogProbParams& p) override {
    return cpu::RunTokenLogProbs(p);
  }
  absl::Status SummarizePages(const SummarizePagesParams& p) override {
    return page_select_.Summarize(p);
  }
  absl::Status SelectPages(const SelectPagesParams& p) override { return page_select_.Select(p); }
  absl::Status KeyGram(const KeyGramParams& p) override {
    TANDEM_RETURN_IF_ERROR(cpu::ValidateKeyGram(p));
    cpu::RunKeyGram(p, threads_);
    return absl::OkStatus();
  }
  absl::Status ProjectKeys(const ProjectKeysParams& p) override {
    TANDEM_RETURN_IF_ERROR(cpu::ValidateProjectKeys(p));
    cpu::RunProjectKeys(p, threads_);
    return absl::OkStatus();
  }

 private:
  static absl::Status CheckFence(const char* op, int fence) {
    if (fence >= 0 && fence < kDeviceFences) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": fence ", fence, " not in [0, ", kDeviceFences, ")"));
  }
  // bytes == 0 is a no-op; otherwise both pointers must be set. Overlap is allowed (memmove).
  static absl::Status Copy(const char* op, void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": null pointer"));
    }
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }

  const std::string description_;
  std::shared_ptr<MemoryCounters> counters_;
  const int threads_;  // the OpenMP team size of the parallel ops
  std::unique_ptr<cpu::CpuMatmul> matmul_;
  cpu::WindowAttentionRunner attention_;
  cpu::PageSelectRunner page_select_;
  cpu::ScratchBuffer scratch_;  // small per-op tables (RmsNorm weights, RoPE cos/sin)
  std::optional<std::chrono::steady_clock::time_point> marks_[kDeviceMarks];  // MarkDevice's
};

}  // namespace

// options.prefill_attention is accepted and ignored: the one attention kernel is f32-accurate.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(unsigned threads,
                                                          const BackendOptions& /*options*/) {
  if (threads == 0) threads = UsableCores();
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<cpu::CpuMatmul> matmul,
                          cpu::CpuMatmul::Create(static_cast<int>(threads)));
  TANDEM_RETURN_IF_ERROR(matmul->SelfCheck());
  return std::unique_ptr<Backend>(new CpuBackend(threads, std::move(matmul)));
}

}  // namespace tandem::gpu_worker
