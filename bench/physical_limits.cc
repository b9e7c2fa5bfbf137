#include "physical_limits.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/cpu_attention/thread_pool.h"

namespace tandem::bench {
namespace {

using gpu_worker::Backend;
using gpu_worker::DeviceBuffer;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

absl::Status CheckProbe(const ProbeOptions& o) {
  if (o.bytes == 0 || o.reps < 1) {
    return absl::InvalidArgumentError("probe: bytes and reps must be positive");
  }
  return absl::OkStatus();
}

// Median seconds of `reps` timed calls of `run` after one warm-up call.
absl::StatusOr<double> MedianSeconds(int reps, const std::function<absl::Status()>& run) {
  TANDEM_RETURN_IF_ERROR(run());
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const double t0 = Now();
    TANDEM_RETURN_IF_ERROR(run());
    times.push_back(Now() - t0);
  }
  return Median(times);
}

// Queues `bytes` from src_host to dst as UploadRates::kChunks uploads over the upload slots.
absl::Status QueueUploads(Backend& backend, void* dst, const void* src_host, size_t bytes) {
  const size_t chunks = UploadRates::kChunks;
  for (size_t c = 0; c < chunks; ++c) {
    const size_t begin = bytes * c / chunks, end = bytes * (c + 1) / chunks;
    if (end == begin) continue;
    gpu_worker::UploadParams p;
    p.dst = static_cast<char*>(dst) + begin;
    p.src_host = static_cast<const char*>(src_host) + begin;
    p.row_bytes = p.dst_pitch = p.src_pitch = end - begin;
    p.rows = 1;
    TANDEM_RETURN_IF_ERROR(backend.UploadAsync(p, static_cast<int>(c % Backend::kUploadSlots)));
  }
  return absl::OkStatus();
}

// Sum of n words: a streaming read with wide loads (built for AVX-512 / AVX2 / baseline and
// picked at load time, so the loop is not the bottleneck).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
uint64_t
SumWords(const uint64_t* p, size_t n) {
  uint64_t acc = 0;
#pragma omp simd reduction(+ : acc)
  for (size_t k = 0; k < n; ++k) acc += p[k];
  return acc;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// Page-aligned host memory; nullptr when it cannot be had.
std::unique_ptr<std::byte, FreeDeleter> AllocatePages(size_t bytes) {
  return std::unique_ptr<std::byte, FreeDeleter>(
      static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)));
}

// Slice i of `parts` page-aligned slices of [0, bytes): (offset, length).
std::pair<size_t, size_t> Slice(size_t bytes, size_t parts, size_t i) {
  const size_t pages = bytes / 4096;
  const size_t begin = pages * i / parts * 4096;
  const size_t end = i + 1 == parts ? bytes : pages * (i + 1) / parts * 4096;
  return {begin, end - begin};
}

}  // namespace

absl::StatusOr<double> MeasureDeviceCopyBandwidth(Backend& backend, const ProbeOptions& options) {
  TANDEM_RETURN_IF_ERROR(CheckProbe(options));
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer src, backend.Allocate(options.bytes));
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer dst, backend.Allocate(options.bytes));
  // Touch both (first-touch page faults on cpu must not land in the timed runs).
  gpu_worker::RandomFillParams fill;
  fill.dst = src.data();
  fill.dtype = gpu_worker::DType::kF32;
  fill.count = options.bytes / 4;
  TANDEM_RETURN_IF_ERROR(backend.RandomFill(fill));
  fill.dst = dst.data();
  TANDEM_RETURN_IF_ERROR(backend.RandomFill(fill));
  TANDEM_ASSIGN_OR_RETURN(
      const double seconds, MedianSeconds(options.reps, [&]() -> absl::Status {
        TANDEM_RETURN_IF_ERROR(backend.CopyOnDevice(dst.data(), src.data(), options.bytes));
        return backend.Synchronize();
      }));
  return 2.0 * static_cast<double>(options.bytes) / seconds;
}

absl::StatusOr<UploadRates> MeasureUploadBandwidth(Backend& backend, const ProbeOptions& options) {
  TANDEM_RETURN_IF_ERROR(CheckProbe(options));
  const size_t bytes = options.bytes;
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer host_src, backend.AllocateHost(bytes));
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer host_dst, backend.AllocateHost(bytes));
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer dev_dst, backend.Allocate(bytes));
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer dev_src, backend.Allocate(bytes));
  std::memset(host_src.data(), 1, bytes);
  std::memset(host_dst.data(), 0, bytes);
  TANDEM_RETURN_IF_ERROR(backend.CopyOnDevice(dev_src.data(), dev_dst.data(), bytes));
  TANDEM_RETURN_IF_ERROR(backend.Synchronize());
  const double b = static_cast<double>(bytes);
  UploadRates rates;

  TANDEM_ASSIGN_OR_RETURN(
      const double h2d_s, MedianSeconds(options.reps, [&]() -> absl::Status {
        TANDEM_RETURN_IF_ERROR(QueueUploads(backend, dev_dst.data(), host_src.data(), bytes));
        return backend.Synchronize();
      }));
  rates.h2d_bytes_per_s = b / h2d_s;
  TANDEM_ASSIGN_OR_RETURN(const double d2h_s, MedianSeconds(options.reps, [&] {
                            return backend.CopyToHost(host_dst.data(), dev_src.data(), bytes);
                          }));
  rates.d2h_bytes_per_s = b / d2h_s;

  // Concurrent: a D2H copy sized to last as long as the uploads alone.
  const size_t d2h_bytes = std::clamp<size_t>(static_cast<size_t>(b * h2d_s / d2h_s), 1, bytes);
  std::vector<double> up_times, down_times;
  for (int r = 0; r <= options.reps; ++r) {  // run 0 is the warm-up
    const double t0 = Now();
    TANDEM_RETURN_IF_ERROR(QueueUploads(backend, dev_dst.data(), host_src.data(), bytes));
    TANDEM_RETURN_IF_ERROR(backend.CopyToHost(host_dst.data(), dev_src.data(), d2h_bytes));
    const double t1 = Now();
    TANDEM_RETURN_IF_ERROR(backend.Synchronize());
    const double t2 = Now();
    if (r > 0) {
      down_times.push_back(t1 - t0);
      up_times.push_back(t2 - t0);
    }
  }
  rates.h2d_with_d2h_bytes_per_s = b / Median(up_times);
  rates.d2h_with_h2d_bytes_per_s = static_cast<double>(d2h_bytes) / Median(down_times);
  return rates;
}

absl::StatusOr<CpuScanRates> MeasureCpuScanRate(unsigned threads, const CpuScanOptions& o) {
  if (o.kv_heads == 0 || o.group == 0 || o.head_dim == 0 || o.reps < 1) {
    return absl::InvalidArgumentError("cpu scan probe: heads, group, head_dim, reps must be > 0");
  }
  const size_t row_bytes = size_t{o.head_dim} * 2;  // one bf16 entry of K (or V)
  const uint64_t n = o.kv_bytes / (2 * row_bytes * o.kv_heads);
  if (n == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cpu scan probe: kv_bytes ", o.kv_bytes, " hold no entry per head"));
  }
  const size_t half = n * row_bytes * o.kv_heads;  // K (or V) of all heads: [heads, n, D]
  auto k = AllocatePages(half);
  auto v = AllocatePages(half);
  if (k == nullptr || v == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu scan probe: cannot allocate 2 x ", half, " bytes"));
  }
  cpu_attention::ThreadPool pool(threads);
  const size_t parts = pool.num_threads();
  // Values in [-1, 1) from a cheap per-element hash, written by the threads that read them.
  pool.ParallelFor(parts, [&](size_t i) {
    for (std::byte* base : {k.get(), v.get()}) {
      const auto [off, len] = Slice(half, parts, i);
      bf16_t* p = reinterpret_cast<bf16_t*>(base + off);
      for (size_t e = 0; e < len / 2; ++e) {
        const uint32_t h = static_cast<uint32_t>((off / 2 + e) * 2654435761u) >> 8;
        p[e] = FloatToBf16(static_cast<float>(h) * (2.0f / 16777216.0f) - 1.0f);
      }
    }
  });

  const uint32_t rows = o.group;  // one token
  std::vector<float> q(size_t{o.kv_heads} * rows * o.head_dim), out(q.size()),
      lse(size_t{o.kv_heads} * rows);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 17) / 8.0f - 1.0f;
  cpu_attention::AttentionParams params;
  params.dtype = kv_store::KvDType::kBf16;
  params.head_dim = o.head_dim;
  params.group = o.group;
  params.num_tokens = 1;
  params.q_token_stride = params.o_token_stride = q.size();
  params.lse_token_stride = lse.size();
  std::vector<cpu_attention::HeadProblem> heads(o.kv_heads);
  for (uint32_t h = 0; h < o.kv_heads; ++h) {
    heads[h] = {k.get() + h * n * row_bytes,
                v.get() + h * n * row_bytes,
                n,
                q.data() + size_t{h} * rows * o.head_dim,
                out.data() + size_t{h} * rows * o.head_dim,
                lse.data() + size_t{h} * rows};
  }
  CpuScanRates rates;
  rates.entries_per_head = n;
  const double kv = 2.0 * static_cast<double>(half);
  TANDEM_ASSIGN_OR_RETURN(const double scan_s, MedianSeconds(o.reps, [&] {
                            return cpu_attention::SparseAttention(params, heads, pool);
                          }));
  rates.scan_bytes_per_s = kv / scan_s;
  for (float x : out) {
    if (!std::isfinite(x)) return absl::InternalError("cpu scan probe: non-finite output");
  }

  std::vector<uint64_t> sums(2 * parts);
  TANDEM_ASSIGN_OR_RETURN(
      const double read_s, MedianSeconds(o.reps, [&] {
        pool.ParallelFor(parts, [&](size_t i) {
          const auto [off, len] = Slice(half, parts, i);
          sums[2 * i] = SumWords(reinterpret_cast<const uint64_t*>(k.get() + off), len / 8);
          sums[2 * i + 1] = SumWords(reinterpret_cast<const uint64_t*>(v.get() + off), len / 8);
        });
        return absl::OkStatus();
      }));
  rates.read_bytes_per_s = kv / read_s;
  uint64_t total = 0;
  for (uint64_t x : sums) total += x;
  volatile uint64_t keep = total;  // the sums must not be optimised away
  (void)keep;
  return rates;
}

std::string_view LimitTermName(LimitTerm term) {
  switch (term) {
    case LimitTerm::kHbm:
      return "hbm";
    case LimitTerm::kCpuScan:
      return "cpu_scan";
    case LimitTerm::kPcie:
      return "pcie";
  }
  return "?";
}

absl::StatusOr<Limit> ComputeLimit(const PhysicalLimits& rates, const Traffic& traffic) {
  auto term = [](const char* name, double bytes, double rate) -> absl::StatusOr<double> {
    if (!std::isfinite(bytes) || bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("limit: ", name, " bytes ", bytes));
    }
    if (bytes == 0) return 0.0;
    if (!std::isfinite(rate) || !(rate > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("limit: ", name, " rate ", rate, " bytes/s for ", bytes, " bytes"));
    }
    return bytes / rate;
  };
  Limit limit;
  TANDEM_ASSIGN_OR_RETURN(limit.hbm_seconds, term("hbm", traffic.hbm_bytes, rates.hbm_bytes_per_s));
  TANDEM_ASSIGN_OR_RETURN(limit.cpu_scan_seconds,
                          term("cpu_scan", traffic.cpu_scan_bytes, rates.cpu_scan_bytes_per_s));
  TANDEM_ASSIGN_OR_RETURN(limit.pcie_seconds,
                          term("pcie", traffic.pcie_bytes, rates.pcie_bytes_per_s));
  limit.seconds = limit.hbm_seconds;
  limit.bound = LimitTerm::kHbm;
  if (limit.cpu_scan_seconds > limit.seconds) {
    limit.seconds = limit.cpu_scan_seconds;
    limit.bound = LimitTerm::kCpuScan;
  }
  if (limit.pcie_seconds > limit.seconds) {
    limit.seconds = limit.pcie_seconds;
    limit.bound = LimitTerm::kPcie;
  }
  return limit;
}

}  // namespace tandem::bench
