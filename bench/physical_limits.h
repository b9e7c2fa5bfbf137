// Physical-limit probes: the rates of the machine a benchmark runs on, measured in the same run,
// so each measured figure can be printed beside the time the hardware could not beat:
//   limit = max(hbm_bytes / hbm_rate, cpu_scan_bytes / cpu_scan_rate, pcie_bytes / pcie_rate)
// (the three resources work concurrently in a hybrid decode step, so the slowest bounds it).
//
// Every probe times whole operations with the host's steady clock: one warm-up run first, then
// `reps` timed runs, and returns the median rate. Buffers are far larger than any cache (the
// defaults: >= 1 GiB on the device, >= 2 GiB of KV on the host), so rates are memory/link rates.
// Probes run on either backend (the cpu backend measures host memory); they allocate their
// buffers for the call and free them before returning.
//
// Errors: INVALID_ARGUMENT for zero sizes or reps; RESOURCE_EXHAUSTED when a buffer cannot be
// had; the backend's or the attention kernel's errors. Not thread-safe (they use the backend).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::bench {

struct ProbeOptions {
  size_t bytes = size_t{1} << 30;  // bytes moved per timed run (per direction)
  int reps = 5;                    // timed runs after one warm-up
};

// Device memory bandwidth: CopyOnDevice of `bytes` between two device buffers, then
// Synchronize, timed on the host; rate = 2·bytes (read + written) / median time.
absl::StatusOr<double> MeasureDeviceCopyBandwidth(gpu_worker::Backend& backend,
                                                  const ProbeOptions& options = {});

struct UploadRates {
  // Host-to-device bytes/s: `bytes` from AllocateHost memory (pinned on cuda) queued as
  // kChunks UploadAsync chunks over the upload slots (all in flight at once), then
  // Synchronize; bytes / median time.
  double h2d_bytes_per_s = 0;
  // Device-to-host bytes/s of one CopyToHost of `bytes` into AllocateHost memory.
  double d2h_bytes_per_s = 0;
  // Host-to-device bytes/s while a device-to-host copy runs: the uploads are queued, then a
  // CopyToHost sized to last as long as the uploads alone did (from the two rates above) runs on
  // the compute stream, then Synchronize; bytes / (time to Synchronize's return). The uploads end
  // at or before that return, so this is a lower bound on the concurrent rate. (The cpu backend
  // copies synchronously, so there it measures the two copies one after the other.)
  double h2d_with_d2h_bytes_per_s = 0;
  // Device-to-host bytes/s in the same run: D2H bytes / time to CopyToHost's return.
  double d2h_with_h2d_bytes_per_s = 0;
  static constexpr int kChunks = 16;
};
absl::StatusOr<UploadRates> MeasureUploadBandwidth(gpu_worker::Backend& backend,
                                                   const ProbeOptions& options = {});

struct CpuScanOptions {
  size_t kv_bytes = size_t{2} << 30;  // K + V bytes of bf16 entries over all heads
  uint32_t kv_heads = 8;
  uint32_t group = 4;  // query heads per kv head (one decode token)
  uint32_t head_dim = 128;
  int reps = 5;
};

struct CpuScanRates {
  // cpu_attention::SparseAttention over every entry of `kv_heads` contiguous bf16 [n, head_dim]
  // K and V (one query token, `group` query heads per kv head), on a ThreadPool of `threads`:
  // K + V bytes / median time.
  double scan_bytes_per_s = 0;
  // Plain read bandwidth on the same threads: a vectorised sum of the same K and V buffers,
  // split in equal page-aligned slices; bytes / median time.
  double read_bytes_per_s = 0;
  uint64_t entries_per_head = 0;
};
// threads = 0: the cores this process may use.
absl::StatusOr<CpuScanRates> MeasureCpuScanRate(unsigned threads,
                                                const CpuScanOptions& options = {});

// The rates a limit is computed from (bytes per second, all > 0).
struct PhysicalLimits {
  double hbm_bytes_per_s = 0;       // MeasureDeviceCopyBandwidth
  double cpu_scan_bytes_per_s = 0;  // CpuScanRates::scan_bytes_per_s
  double pcie_bytes_per_s = 0;      // UploadRates::h2d_bytes_per_s
};

// The traffic of one operation (e.g. one decode step) on each resource.
struct Traffic {
  double hbm_bytes = 0;       // device memory read + written
  double cpu_scan_bytes = 0;  // K + V bytes the CPU attention scans
  double pcie_bytes = 0;      // bytes over the host link
};

enum class LimitTerm { kHbm, kCpuScan, kPcie };
std::string_view LimitTermName(LimitTerm term);  // "hbm", "cpu_scan", "pcie"

struct Limit {
  double seconds = 0;                 // the largest of the three terms
  LimitTerm bound = LimitTerm::kHbm;  // which term it is (the first of equal ones)
  double hbm_seconds = 0, cpu_scan_seconds = 0, pcie_seconds = 0;
};

// INVALID_ARGUMENT for a negative or non-finite byte count, or a rate that is not positive and
// finite where its byte count is positive (a term with zero bytes is zero whatever its rate).
absl::StatusOr<Limit> ComputeLimit(const PhysicalLimits& rates, const Traffic& traffic);

}  // namespace tandem::bench
