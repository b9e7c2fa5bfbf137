// tandem-kernel-bench: the cuda backend's window attention against the device's limits.
//
// Decode (few query rows): the kernels move the window's K and V once, so their speed is a
// bandwidth: bytes = K + V of the window + q + o + lse (+ maw read and written when the MAW
// update is on), over the kernel time, printed next to the device-to-device copy bandwidth
// measured in the same run (bytes read + written by a large cudaMemcpy, over its time).
// Prefill (many query rows, causal): a throughput, TFLOPS = 4·Hq·D·(visible (query, key) pairs)
// / time, which bench/sdpa_reference.py measures the same way for torch's SDPA
// (bench/run_kernel_bench.sh prints the two side by side). The backend's prefill kernel is the
// fast tensor-core one (bf16 q and p, window_attention_flash.cuh); prefill also times its other
// warp layouts, the exact tensor-core kernel (q and p split into bf16 hi + lo) and optionally
// the f32 tiled kernel, and compares the fast kernel's o and lse with the exact kernel's on the
// same inputs (max abs differences; every output element poisoned with NaN first).
//
// Timing: the kernels are launched through the backend's own launchers (window_attention.cuh)
// on a stream of this program, with a cudaEvent pair around every repetition; the median is
// reported. A long device-side copy is queued first so the host queues every repetition before
// the first one runs (no launch gaps in the timed region). Decode windows whose caches would sit
// in L2 rotate over several cache sets. The backend path (Backend::WindowAttention: checks,
// plan, workspace, launches) is also timed by the host clock over a batch of calls ended by
// Synchronize (mean per call).
//
// Page selection (issue 11): SelectPages over the page summaries of contexts of
// --page_contexts tokens (pages of --page_tokens), --page_select pages kept per (token, kv head):
// the scoring kernel streams the summaries once (bytes = summaries + q + scores written), so its
// rate is printed against the copy bandwidth; the top-k kernel and the whole backend call are
// timed too. Summary sets rotate like decode caches when they would sit in L2.
//
// Decode GEMV (issue 15 item 3, gemv_sweep): every variant of gemv.cuh's kGemvVariants and the
// backend's cuBLAS path (x converted to bf16 + cublasGemmEx) on the --gemv_shapes bf16 weights
// (rotated over copies past 4x the L2), m = --gemv_rows; bytes = weight + x + y, printed against
// the copy bandwidth; each output is checked on sampled columns against an f64 host reference
// (rel = |y - ref| / sum |x·w|; "ok" at <= 1e-5).
//
//   tandem-kernel-bench                      # the issue-4 set: Llama-3-8B geometry, bf16 cache
//   tandem-kernel-bench --decode_windows=4096 --prefill=false
//   tandem-kernel-bench --decode_windows= --prefill=false   # page selection only
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "convert.cuh"
#include "cuda_resources.h"
#include "fp8_gemm.h"
#include "gemv.cuh"
#include "gemv_fp8.cuh"
#include "nlohmann/json.hpp"
#include "page_select.cuh"
#include "parse_flags.h"
#include "tandem/common/bf16.h"
#include "tandem/common/f8e4m3.h"
#include "tandem/gpu_worker/backend.h"
#include "window_attention.cuh"
#include "window_attention_flash.cuh"

ABSL_FLAG(int64_t, q_heads, 32, "query heads");
ABSL_FLAG(int64_t, kv_heads, 8, "kv heads");
ABSL_FLAG(int64_t, head_dim, 128, "head dim");
ABSL_FLAG(std::string, dtype, "bf16", "cache dtype: bf16 or f32");
ABSL_FLAG(std::string, decode_windows, "4096,16384,65536", "decode window sizes (slots)");
ABSL_FLAG(std::string, decode_tokens, "1,2,8",
          "decode query tokens per call (x G query rows per kv head)");
ABSL_FLAG(std::string, decode_waves, "",
          "decode (no MAW): also time the plans aiming at these waves of resident blocks "
          "(e.g. 1,2,4,8; the backend's is window_attention.cuh's kDecodeWaves)");
ABSL_FLAG(bool, prefill, true, "run the prefill cases");
ABSL_FLAG(std::string, prefill_cases,
          "2048:0,2048:8192,2048:32768,4096:0,16384:0,16384:16384",
          "prefill cases chunk:prefix (a chunk of new tokens over a cached prefix; prefix 0 = "
          "plain causal self-attention)");
ABSL_FLAG(bool, compare_f32_kernel, false,
          "prefill: also time the f32 (SIMT) tiled kernel the tensor-core kernel replaced");
ABSL_FLAG(bool, page_selection, true, "run the page selection cases");
ABSL_FLAG(std::string, page_contexts, "131072,524288,1048576",
          "page selection: offloaded context lengths (tokens)");
ABSL_FLAG(int64_t, page_tokens, 16, "page selection: tokens per page");
ABSL_FLAG(int64_t, page_select, 128, "page selection: pages kept per (token, kv head)");
ABSL_FLAG(std::string, page_query_tokens, "1",
          "page selection: query tokens per call (decode 1; prefill chunks more)");
ABSL_FLAG(bool, gemv, true, "run the decode GEMV sweep (every gemv.cuh variant and cuBLAS)");
ABSL_FLAG(std::string, gemv_shapes, "6144x4096,4096x4096,28672x4096,4096x14336,128256x4096",
          "GEMV sweep: n x k weight shapes (Llama-3-8B decode: qkv, o_proj, gate_up, down, "
          "lm_head)");
ABSL_FLAG(std::string, gemv_rows, "1,2", "GEMV sweep: activation rows m");
ABSL_FLAG(bool, gemv_fp8, true,
          "run the FP8-weight sweep on --gemv_shapes: every gemv_fp8.cuh variant (m <= 4) and "
          "the FP8 tensor-core GEMM (x quantized per row + cuBLASLt)");
ABSL_FLAG(std::string, gemv_fp8_rows, "1,2,4,8,64",
          "FP8 sweep: activation rows m (the GEMV variants run up to kGemvFp8MaxRows)");
ABSL_FLAG(double, seconds, 0.3, "target timed seconds per case");
ABSL_FLAG(int64_t, max_reps, 200, "repetitions per case at most");

namespace tandem::gpu_worker {
namespace {

using cuda_backend::WindowAttentionArgs;
using cuda_backend::WindowAttentionPlan;

#define BENCH_CUDA(call)                                                                   \
  do {                                                                                     \
    const cudaError_t bench_error = (call);                                                \
    if (bench_error != cudaSuccess) {                                                      \
      return absl::InternalError(absl::StrFormat("%s failed: %s (%s:%d)", #call,            \
                                                 cudaGetErrorString(bench_error), __FILE__, \
                                                 __LINE__));                               \
    }                                                                                      \
  } while (0)

#define BENCH_RETURN_IF_ERROR(expr)            \
  do {                                         \
    const absl::Status bench_status = (expr);  \
    if (!bench_status.ok()) return bench_status; \
  } while (0)

// RAII for the few raw CUDA handles this program owns.
struct StreamDeleter {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
using StreamPtr = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDeleter>;
struct EventDeleter {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
using EventPtr = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;

absl::StatusOr<std::vector<int64_t>> ParseList(const std::string& text) {
  std::vector<int64_t> values;
  for (absl::string_view piece : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(piece, &v) || v <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad list entry '", piece, "'"));
    }
    values.push_back(v);
  }
  return values;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times `reps` repetitions of `body(rep)` on `stream` with an event pair around each one;
// returns the median in seconds. `busy` (a long copy) is queued first so that the host has
// queued every repetition before the device reaches the first.
template <typename Body>
absl::StatusOr<double> TimeMedian(cudaStream_t stream, int64_t reps, const Body& body,
                                  const std::function<absl::Status()>& busy) {
  std::vector<EventPtr> starts, stops;
  for (int64_t i = 0; i < reps; ++i) {
    cudaEvent_t a = nullptr, b = nullptr;
    BENCH_CUDA(cudaEventCreate(&a));
    starts.emplace_back(a);
    BENCH_CUDA(cudaEventCreate(&b));
    stops.emplace_back(b);
  }
  BENCH_RETURN_IF_ERROR(busy());
  for (int64_t i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(starts[i].get(), stream));
    BENCH_RETURN_IF_ERROR(body(i));
    BENCH_CUDA(cudaEventRecord(stops[i].get(), stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> seconds(reps);
  for (int64_t i = 0; i < reps; ++i) {
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, starts[i].get(), stops[i].get()));
    seconds[i] = ms * 1e-3;
  }
  return Median(seconds);
}

// Which kernel a timing plans: the backend's choice by default.
struct PlanChoice {
  bool allow_tensor_cores = true;
  bool exact_prefill = false;  // the exact (hi + lo) tensor-core kernel for prefill
  int flash_variant = -1;      // >= 0: that warp layout of the fast kernel
  int decode_waves = 0;        // > 0: decode plans aim at that many waves (kDecodeWaves)
};

class Bench {
 public:
  static absl::StatusOr<std::unique_ptr<Bench>> Create() {
    auto bench = std::unique_ptr<Bench>(new Bench());
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCudaBackend(0);
    if (!backend.ok()) return backend.status();
    bench->backend_ = *std::move(backend);
    cudaStream_t stream = nullptr;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    bench->stream_.reset(stream);
    cudaDeviceProp props{};
    BENCH_CUDA(cudaGetDeviceProperties(&props, 0));
    bench->num_sms_ = props.multiProcessorCount;
    bench->l2_bytes_ = props.l2CacheSize;
    bench->device_ = props.name;
    // Two 1 GiB buffers: the copy-bandwidth measurement, and the busy copy queued before
    // every timed batch.
    constexpr size_t kCopyBytes = size_t{1} << 30;
    absl::StatusOr<DeviceBuffer> a = bench->backend_->Allocate(kCopyBytes);
    if (!a.ok()) return a.status();
    absl::StatusOr<DeviceBuffer> b = bench->backend_->Allocate(kCopyBytes);
    if (!b.ok()) return b.status();
    bench->copy_src_ = *std::move(a);
    bench->copy_dst_ = *std::move(b);
    BENCH_RETURN_IF_ERROR(bench->Fill(bench->copy_src_.data(), DType::kF32, kCopyBytes / 4, 1, 1));
    BENCH_RETURN_IF_ERROR(bench->backend_->Synchronize());
    return bench;
  }

  const std::string& device() const { return device_; }
  size_t l2_bytes() const { return l2_bytes_; }
  cudaStream_t stream() const { return stream_.get(); }
  Backend& backend() { return *backend_; }

  // Device-to-device copy bandwidth: (bytes read + bytes written) / time of a 1 GiB copy.
  absl::StatusOr<double> CopyBandwidth() {
    const size_t bytes = copy_src_.bytes();
    absl::StatusOr<double> seconds = TimeMedian(
        stream_.get(), 20,
        [&](int64_t) -> absl::Status {
          BENCH_CUDA(cudaMemcpyAsync(copy_dst_.data(), copy_src_.data(), bytes,
                                     cudaMemcpyDeviceToDevice, stream_.get()));
          return absl::OkStatus();
        },
        [] { return absl::OkStatus(); });
    if (!seconds.ok()) return seconds.status();
    return 2.0 * static_cast<double>(bytes) / *seconds;
  }

  // Device work queued ahead of a timed batch of `reps` repetitions: 1 GiB copies (~0.7 ms each
  // at ~3 TB/s), enough to cover ~30 us of host time per repetition (a decode repetition
  // queues two kernels and two events), so no repetition waits for the host inside its events.
  absl::Status Busy(int64_t reps) {
    const int64_t copies = std::max<int64_t>(3, (reps * 30 + 699) / 700);
    for (int64_t i = 0; i < copies; ++i) {
      BENCH_CUDA(cudaMemcpyAsync(copy_dst_.data(), copy_src_.data(), copy_src_.bytes(),
                                 cudaMemcpyDeviceToDevice, stream_.get()));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<DeviceBuffer> Alloc(size_t bytes) { return backend_->Allocate(bytes); }

  absl::Status Fill(void* dst, DType dtype, size_t count, uint64_t seed, float scale) {
    return backend_->RandomFill(
        {.dst = dst, .dtype = dtype, .count = count, .seed = seed, .scale = scale});
  }

  absl::Status Upload(const DeviceBuffer& dst, const void* src, size_t bytes) {
    return backend_->CopyToDevice(dst.data(), src, bytes);
  }

  struct Timing {
    double kernel_seconds = 0.0;   // median over repetitions, cudaEvents
    double backend_seconds = 0.0;  // Backend::WindowAttention, host clock, mean over a batch
    int64_t reps = 0;
    int64_t splits = 0;
    bool decode_kernel = false;
  };

  absl::StatusOr<WindowAttentionPlan> Plan(const WindowAttentionArgs& a, const PlanChoice& c) {
    WindowAttentionPlan plan;
    BENCH_CUDA(cuda_backend::PlanWindowAttention(a, num_sms_, &plan, c.allow_tensor_cores,
                                                 c.exact_prefill, c.decode_waves));
    if (plan.flash && c.flash_variant >= 0) plan.flash_variant = c.flash_variant;
    return plan;
  }

  // Runs the plan of `choice` once on `a` with o and lse poisoned (NaN) first; returns o and lse.
  absl::Status RunOnce(const WindowAttentionArgs& a, const PlanChoice& choice,
                       std::vector<float>* o, std::vector<float>* lse) {
    absl::StatusOr<WindowAttentionPlan> plan = Plan(a, choice);
    if (!plan.ok()) return plan.status();
    DeviceBuffer workspace;
    if (plan->workspace_bytes > 0) {
      absl::StatusOr<DeviceBuffer> ws = backend_->Allocate(plan->workspace_bytes);
      if (!ws.ok()) return ws.status();
      workspace = *std::move(ws);
    }
    const size_t rows = static_cast<size_t>(a.num_tokens * a.num_q_heads);
    o->resize(rows * a.head_dim);
    lse->resize(rows);
    BENCH_CUDA(cudaMemsetAsync(a.o, 0xff, o->size() * 4, stream_.get()));  // NaN
    BENCH_CUDA(cudaMemsetAsync(a.lse, 0xff, lse->size() * 4, stream_.get()));
    BENCH_CUDA(cuda_backend::LaunchWindowAttention(a, *plan, workspace.data(), stream_.get()));
    BENCH_CUDA(cudaMemcpyAsync(o->data(), a.o, o->size() * 4, cudaMemcpyDeviceToHost,
                               stream_.get()));
    BENCH_CUDA(cudaMemcpyAsync(lse->data(), a.lse, lse->size() * 4, cudaMemcpyDeviceToHost,
                               stream_.get()));
    BENCH_CUDA(cudaStreamSynchronize(stream_.get()));
    return absl::OkStatus();
  }

  // Times attention over `sets` argument sets (rotated per repetition; they differ only in
  // their K/V caches and maw).
  // kernel_only: only the cudaEvent timing (no backend-path timing), of the plan of `choice`.
  absl::StatusOr<Timing> TimeAttention(const std::vector<WindowAttentionArgs>& sets,
                                       double target_seconds, int64_t max_reps,
                                       bool kernel_only = false, const PlanChoice& choice = {}) {
    absl::StatusOr<WindowAttentionPlan> planned = Plan(sets[0], choice);
    if (!planned.ok()) return planned.status();
    const WindowAttentionPlan plan = *planned;
    DeviceBuffer workspace;
    if (plan.workspace_bytes > 0) {
      absl::StatusOr<DeviceBuffer> ws = backend_->Allocate(plan.workspace_bytes);
      if (!ws.ok()) return ws.status();
      workspace = *std::move(ws);
    }
    auto run = [&](int64_t rep) -> absl::Status {
      const WindowAttentionArgs& a = sets[rep % sets.size()];
      BENCH_CUDA(cuda_backend::LaunchWindowAttention(a, plan, workspace.data(), stream_.get()));
      if (a.maw != nullptr) {
        BENCH_CUDA(cuda_backend::LaunchMawUpdate(a, plan, workspace.data(), stream_.get()));
      }
      return absl::OkStatus();
    };
    // Warm-up (module load, occupancy queries) and a first estimate for the repetition count.
    BENCH_RETURN_IF_ERROR(run(0));
    BENCH_CUDA(cudaStreamSynchronize(stream_.get()));
    absl::StatusOr<double> once =
        TimeMedian(stream_.get(), 3, run, [] { return absl::OkStatus(); });
    if (!once.ok()) return once.status();
    Timing timing;
    timing.reps = std::clamp<int64_t>(static_cast<int64_t>(target_seconds / *once), 5, max_reps);
    timing.reps = (timing.reps + sets.size() - 1) / sets.size() * sets.size();
    absl::StatusOr<double> median =
        TimeMedian(stream_.get(), timing.reps, run, [&] { return Busy(timing.reps); });
    if (!median.ok()) return median.status();
    timing.kernel_seconds = *median;
    timing.splits = plan.splits;
    timing.decode_kernel = plan.decode;
    if (kernel_only) return timing;

    // The backend path, as the engine calls it.
    BENCH_RETURN_IF_ERROR(backend_->Synchronize());
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t rep = 0; rep < timing.reps; ++rep) {
      const WindowAttentionArgs& a = sets[rep % sets.size()];
      BENCH_RETURN_IF_ERROR(backend_->WindowAttention({.q = a.q,
                                                       .q_row_stride = a.q_row_stride,
                                                       .q_pos = a.q_pos,
                                                       .k_cache = a.k_cache,
                                                       .v_cache = a.v_cache,
                                                       .cache_dtype = a.cache_dtype,
                                                       .slot_pos = a.slot_pos,
                                                       .num_slots = a.num_slots,
                                                       .capacity = a.capacity,
                                                       .num_tokens = a.num_tokens,
                                                       .num_q_heads = a.num_q_heads,
                                                       .num_kv_heads = a.num_kv_heads,
                                                       .head_dim = a.head_dim,
                                                       .scale = a.scale,
                                                       .o = a.o,
                                                       .lse = a.lse,
                                                       .maw = a.maw,
                                                       .alpha = a.alpha}));
    }
    BENCH_RETURN_IF_ERROR(backend_->Synchronize());
    timing.backend_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
        static_cast<double>(timing.reps);
    return timing;
  }

  struct SelectTiming {
    double total_seconds = 0.0;    // LaunchSelectPages (scores + top-k), median, cudaEvents
    double score_seconds = 0.0;    // the scoring kernel alone
    double top_seconds = 0.0;      // the top-k kernel alone
    double backend_seconds = 0.0;  // Backend::SelectPages, host clock, mean over a batch
    int64_t reps = 0;
  };

  // Times page selection over `sets` argument sets (rotated per repetition; they differ in their
  // summaries).
  absl::StatusOr<SelectTiming> TimeSelectPages(std::vector<cuda_backend::SelectPagesArgs> sets,
                                               double target_seconds, int64_t max_reps) {
    for (cuda_backend::SelectPagesArgs& a : sets) a.num_sms = num_sms_;
    using Launcher = cudaError_t (*)(const cuda_backend::SelectPagesArgs&, cudaStream_t);
    auto timed = [&](Launcher launch, int64_t reps) -> absl::StatusOr<double> {
      auto run = [&](int64_t rep) -> absl::Status {
        BENCH_CUDA(launch(sets[rep % sets.size()], stream_.get()));
        return absl::OkStatus();
      };
      return TimeMedian(stream_.get(), reps, run, [&] { return Busy(reps); });
    };
    BENCH_CUDA(cuda_backend::LaunchSelectPages(sets[0], stream_.get()));  // warm-up
    BENCH_CUDA(cudaStreamSynchronize(stream_.get()));
    absl::StatusOr<double> once = timed(cuda_backend::LaunchSelectPages, 3);
    if (!once.ok()) return once.status();
    SelectTiming timing;
    timing.reps = std::clamp<int64_t>(static_cast<int64_t>(target_seconds / *once), 5, max_reps);
    timing.reps = (timing.reps + sets.size() - 1) / sets.size() * sets.size();
    absl::StatusOr<double> total = timed(cuda_backend::LaunchSelectPages, timing.reps);
    if (!total.ok()) return total.status();
    absl::StatusOr<double> score = timed(cuda_backend::LaunchScorePages, timing.reps);
    if (!score.ok()) return score.status();
    absl::StatusOr<double> top = timed(cuda_backend::LaunchTopPages, timing.reps);
    if (!top.ok()) return top.status();
    timing.total_seconds = *total;
    timing.score_seconds = *score;
    timing.top_seconds = *top;

    BENCH_RETURN_IF_ERROR(backend_->Synchronize());
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t rep = 0; rep < timing.reps; ++rep) {
      const cuda_backend::SelectPagesArgs& a = sets[rep % sets.size()];
      BENCH_RETURN_IF_ERROR(backend_->SelectPages({.q = a.q,
                                                   .q_row_stride = a.q_row_stride,
                                                   .summaries = a.summaries,
                                                   .dtype = a.dtype,
                                                   .max_pages = a.max_pages,
                                                   .num_pages = a.num_pages,
                                                   .num_tokens = a.num_tokens,
                                                   .num_q_heads = a.num_q_heads,
                                                   .num_kv_heads = a.num_kv_heads,
                                                   .head_dim = a.head_dim,
                                                   .select = a.select,
                                                   .pages = a.pages,
                                                   .scratch = a.scratch}));
    }
    BENCH_RETURN_IF_ERROR(backend_->Synchronize());
    timing.backend_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
        static_cast<double>(timing.reps);
    return timing;
  }

 private:
  Bench() = default;

  std::unique_ptr<Backend> backend_;
  StreamPtr stream_;
  int num_sms_ = 0;
  size_t l2_bytes_ = 0;
  std::string device_;
  DeviceBuffer copy_src_, copy_dst_;
};

struct Geometry {
  int64_t q_heads, kv_heads, head_dim;
  DType dtype;
};

// Device buffers of one attention problem: q, q_pos, slot_pos, o, lse shared; `sets` K/V caches
// (and maw) to rotate over.
struct Problem {
  DeviceBuffer q, q_pos, slot_pos, o, lse;
  std::vector<DeviceBuffer> k, v, maw;
  std::vector<WindowAttentionArgs> args;
};

absl::StatusOr<Problem> MakeProblem(Bench& bench, const Geometry& geo, int64_t tokens,
                                    int64_t slots, const std::vector<int32_t>& slot_pos,
                                    const std::vector<int32_t>& q_pos, int64_t sets, bool maw) {
  Problem p;
  const size_t cache_elems = static_cast<size_t>(geo.kv_heads * slots * geo.head_dim);
  const size_t q_elems = static_cast<size_t>(tokens * geo.q_heads * geo.head_dim);
  auto alloc = [&](DeviceBuffer* dst, size_t bytes) -> absl::Status {
    absl::StatusOr<DeviceBuffer> b = bench.Alloc(bytes);
    if (!b.ok()) return b.status();
    *dst = *std::move(b);
    return absl::OkStatus();
  };
  BENCH_RETURN_IF_ERROR(alloc(&p.q, q_elems * 4));
  BENCH_RETURN_IF_ERROR(alloc(&p.q_pos, tokens * 4));
  BENCH_RETURN_IF_ERROR(alloc(&p.slot_pos, slots * 4));
  BENCH_RETURN_IF_ERROR(alloc(&p.o, q_elems * 4));
  BENCH_RETURN_IF_ERROR(alloc(&p.lse, tokens * geo.q_heads * 4));
  BENCH_RETURN_IF_ERROR(bench.Fill(p.q.data(), DType::kF32, q_elems, 11, 1.0f));
  BENCH_RETURN_IF_ERROR(bench.Upload(p.q_pos, q_pos.data(), tokens * 4));
  BENCH_RETURN_IF_ERROR(bench.Upload(p.slot_pos, slot_pos.data(), slots * 4));
  const size_t elem = DTypeBytes(geo.dtype);
  for (int64_t i = 0; i < sets; ++i) {
    p.k.emplace_back();
    p.v.emplace_back();
    BENCH_RETURN_IF_ERROR(alloc(&p.k.back(), cache_elems * elem));
    BENCH_RETURN_IF_ERROR(alloc(&p.v.back(), cache_elems * elem));
    BENCH_RETURN_IF_ERROR(bench.Fill(p.k.back().data(), geo.dtype, cache_elems, 100 + 2 * i, 1));
    BENCH_RETURN_IF_ERROR(bench.Fill(p.v.back().data(), geo.dtype, cache_elems, 101 + 2 * i, 1));
    float* maw_ptr = nullptr;
    if (maw) {
      p.maw.emplace_back();
      BENCH_RETURN_IF_ERROR(alloc(&p.maw.back(), geo.kv_heads * slots * 4));
      // Positive values in [0, 0.02): the running-average branch of the update.
      BENCH_RETURN_IF_ERROR(bench.Fill(p.maw.back().data(), DType::kF32,
                                       geo.kv_heads * slots, 500 + i, 0.01f));
      maw_ptr = p.maw.back().as<float>();
    }
    p.args.push_back({.q = p.q.as<float>(),
                      .q_row_stride = geo.q_heads * geo.head_dim,
                      .q_pos = p.q_pos.as<int32_t>(),
                      .k_cache = p.k.back().data(),
                      .v_cache = p.v.back().data(),
                      .cache_dtype = geo.dtype,
                      .slot_pos = p.slot_pos.as<int32_t>(),
                      .num_slots = slots,
                      .capacity = slots,
                      .num_tokens = tokens,
                      .num_q_heads = geo.q_heads,
                      .num_kv_heads = geo.kv_heads,
                      .head_dim = geo.head_dim,
                      .scale = 1.0f / std::sqrt(static_cast<float>(geo.head_dim)),
                      .o = p.o.as<float>(),
                      .lse = p.lse.as<float>(),
                      .maw = maw_ptr,
                      .alpha = 0.1f});
  }
  return p;
}

// ---- decode GEMV sweep (issue 15 item 3) ------------------------------------------------------

// "NxK,..." -> (n, k) pairs.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ParseShapes(const std::string& text) {
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (absl::string_view piece : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::vector<absl::string_view> parts = absl::StrSplit(piece, 'x');
    int64_t n = 0, k = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &n) || !absl::SimpleAtoi(parts[1], &k) ||
        n <= 0 || k <= 0 || k % 8 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad GEMV shape '", piece, "' (want NxK, K a multiple of 8)"));
    }
    shapes.emplace_back(n, k);
  }
  return shapes;
}

// Worst relative error of y [m, n] against an f64 reference of the GEMV numerics (x rounded to
// bf16 times the weights `column` decodes), |y - ref| / Σ|x·w|, on sampled columns (every
// column_step-th and the last) and rows (every row_step-th). column(j, &w) fills w [k] with
// column j's weights as values.
absl::StatusOr<double> GemvError(
    Bench& bench, const DeviceBuffer& x, const DeviceBuffer& y, int64_t m, int64_t n, int64_t k,
    int64_t column_step, int64_t row_step,
    const std::function<absl::Status(int64_t, std::vector<double>*)>& column) {
  std::vector<float> xh(m * k), yh(m * n);
  std::vector<double> w(k);
  BENCH_RETURN_IF_ERROR(bench.backend().CopyToHost(xh.data(), x.data(), xh.size() * 4));
  BENCH_RETURN_IF_ERROR(bench.backend().CopyToHost(yh.data(), y.data(), yh.size() * 4));
  for (float& v : xh) v = Bf16ToFloat(FloatToBf16(v));
  double worst = 0.0;
  for (int64_t j = 0; j < n; j = (j + column_step < n || j == n - 1) ? j + column_step : n - 1) {
    BENCH_RETURN_IF_ERROR(column(j, &w));
    for (int64_t r = 0; r < m; r += row_step) {
      double sum = 0.0, magnitude = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const double p = double{xh[r * k + i]} * w[i];
        sum += p;
        magnitude += std::abs(p);
      }
      const double got = yh[r * n + j];
      worst = std::max(worst, std::isfinite(got) ? std::abs(got - sum) / (magnitude + 1e-30)
                                                 : std::numeric_limits<double>::infinity());
    }
  }
  return worst;
}

// GemvError of bf16 weights w [n, k]: every n/128-th column, every row.
absl::StatusOr<double> GemvError(Bench& bench, const DeviceBuffer& x, const DeviceBuffer& w,
                                 const DeviceBuffer& y, int64_t m, int64_t n, int64_t k) {
  std::vector<bf16_t> row(k);
  return GemvError(bench, x, y, m, n, k, std::max<int64_t>(1, n / 128), 1,
                   [&](int64_t j, std::vector<double>* values) -> absl::Status {
                     BENCH_RETURN_IF_ERROR(bench.backend().CopyToHost(
                         row.data(), static_cast<const char*>(w.data()) + j * k * 2, k * 2));
                     for (int64_t i = 0; i < k; ++i) (*values)[i] = Bf16ToFloat(row[i]);
                     return absl::OkStatus();
                   });
}

// Times every gemv.cuh variant and the cuBLAS path on each (shape, m); appends the summary lines
// (the fastest variant of each, against cuBLAS) to `table`.
absl::Status RunGemvSweep(Bench& bench, double copy_bw, int64_t max_reps,
                          std::vector<std::string>* table) {
  absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> shapes =
      ParseShapes(absl::GetFlag(FLAGS_gemv_shapes));
  if (!shapes.ok()) return shapes.status();
  absl::StatusOr<std::vector<int64_t>> rows = ParseList(absl::GetFlag(FLAGS_gemv_rows));
  if (!rows.ok()) return rows.status();
  for (int64_t m : *rows) {
    if (m > cuda_backend::kGemvMaxRows) {
      return absl::InvalidArgumentError(
          absl::StrCat("--gemv_rows ", m, " > kGemvMaxRows ", cuda_backend::kGemvMaxRows));
    }
  }
  // The backend's handle type: bound to the bench's stream, in the backend's math mode.
  absl::StatusOr<cuda_backend::CublasHandle> cublas =
      cuda_backend::CublasHandle::Create(bench.stream());
  if (!cublas.ok()) return cublas.status();
  cublasHandle_t raw = cublas->get();
  const int64_t reps = std::min<int64_t>(max_reps, 100);
  for (const auto& [n, k] : *shapes) {
    const size_t w_bytes = static_cast<size_t>(n * k) * 2;
    // Weight copies to rotate over: together past 4x the L2, so each repetition reads HBM.
    const int64_t sets =
        std::max<int64_t>(1, static_cast<int64_t>((4 * bench.l2_bytes() + w_bytes - 1) / w_bytes));
    std::vector<DeviceBuffer> weights;
    for (int64_t s = 0; s < sets; ++s) {
      absl::StatusOr<DeviceBuffer> w = bench.Alloc(w_bytes);
      if (!w.ok()) return w.status();
      BENCH_RETURN_IF_ERROR(bench.Fill(w->data(), DType::kBF16, n * k, 100 + s, 1.0f));
      weights.push_back(*std::move(w));
    }
    for (int64_t m : *rows) {
      absl::StatusOr<DeviceBuffer> x = bench.Alloc(m * k * 4);
      if (!x.ok()) return x.status();
      absl::StatusOr<DeviceBuffer> x16 = bench.Alloc(m * k * 2);
      if (!x16.ok()) return x16.status();
      absl::StatusOr<DeviceBuffer> y = bench.Alloc(m * n * 4);
      if (!y.ok()) return y.status();
      BENCH_RETURN_IF_ERROR(bench.Fill(x->data(), DType::kF32, m * k, 7, 1.0f));
      // The fills ran on the backend's stream; the timings run on the bench's.
      BENCH_RETURN_IF_ERROR(bench.backend().Synchronize());
      const double bytes = static_cast<double>(w_bytes + m * k * 4 + m * n * 4);
      auto args = [&](int64_t rep) {
        return cuda_backend::GemvArgs{.x = x->as<float>(),
                                      .w = weights[rep % sets].data(),
                                      .w_dtype = DType::kBF16,
                                      .y = y->as<float>(),
                                      .m = m,
                                      .n = n,
                                      .k = k};
      };
      // The backend's fallback: x to bf16, then y = x·wᵀ on cuBLAS (f32 compute).
      auto cublas_call = [&](int64_t rep) -> absl::Status {
        BENCH_CUDA(cuda_backend::LaunchConvertFromF32({.src = x->as<float>(),
                                                       .dst = x16->data(),
                                                       .dst_dtype = DType::kBF16,
                                                       .count = m * k},
                                                      bench.stream()));
        const float alpha = 1.0f, beta = 0.0f;
        if (cublasGemmEx(raw, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                         static_cast<int>(k), &alpha, weights[rep % sets].data(), CUDA_R_16BF,
                         static_cast<int>(k), x16->data(), CUDA_R_16BF, static_cast<int>(k),
                         &beta, y->data(), CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
          return absl::InternalError("cublasGemmEx failed");
        }
        return absl::OkStatus();
      };
      struct Result {
        std::string name;
        double seconds = 0.0, error = 0.0;
      };
      std::vector<Result> results;
      auto measure = [&](const std::string& name,
                         const std::function<absl::Status(int64_t)>& call) -> absl::Status {
        // Correctness first: y poisoned (NaN bytes), one call on weight set 0, checked.
        BENCH_CUDA(cudaMemsetAsync(y->data(), 0xff, m * n * 4, bench.stream()));
        BENCH_RETURN_IF_ERROR(call(0));
        BENCH_CUDA(cudaStreamSynchronize(bench.stream()));
        absl::StatusOr<double> error = GemvError(bench, *x, weights[0], *y, m, n, k);
        if (!error.ok()) return error.status();
        absl::StatusOr<double> seconds = TimeMedian(bench.stream(), reps, call,
                                                    [&] { return bench.Busy(reps); });
        if (!seconds.ok()) return seconds.status();
        results.push_back({name, *seconds, *error});
        const double gbps = bytes / *seconds / 1e9;
        std::printf("%s\n", nlohmann::json{{"bench", "gemv"},
                                           {"n", n},
                                           {"k", k},
                                           {"m", m},
                                           {"variant", name},
                                           {"us", *seconds * 1e6},
                                           {"gbps", gbps},
                                           {"pct_copy", 100.0 * gbps * 1e9 / copy_bw},
                                           {"max_rel_error", *error},
                                           {"ok", *error <= 1e-5}}
                                .dump()
                                .c_str());
        return absl::OkStatus();
      };
      BENCH_RETURN_IF_ERROR(measure("cublas", cublas_call));
      // What Backend::MatMul runs for this shape: the default variant, or cuBLAS.
      const cuda_backend::GemvVariant chosen = cuda_backend::GemvDefaultVariant(n);
      const std::string chosen_name =
          cuda_backend::GemvPreferred(args(0))
              ? absl::StrCat("w", chosen.warps_per_column, "u", chosen.unroll)
              : std::string("cublas");
      for (const cuda_backend::GemvVariant& v : cuda_backend::kGemvVariants) {
        BENCH_RETURN_IF_ERROR(measure(
            absl::StrCat("w", v.warps_per_column, "u", v.unroll), [&](int64_t rep) -> absl::Status {
              BENCH_CUDA(cuda_backend::LaunchGemv(args(rep), v, bench.stream()));
              return absl::OkStatus();
            }));
      }
      const Result& cublas_result = results[0];
      for (const Result& r : results) {
        const double gbps = bytes / r.seconds / 1e9;
        const bool is_default = r.name == chosen_name;
        table->push_back(absl::StrFormat(
            "gemv  %6d x %5d  m %d  %-6s %8.1f us  %5.0f GB/s  %5.1f%% of copy  %5.3fx cublas "
            " err %.1e %s%s",
            static_cast<int>(n), static_cast<int>(k), static_cast<int>(m), r.name.c_str(),
            r.seconds * 1e6, gbps, 100.0 * gbps * 1e9 / copy_bw,
            cublas_result.seconds / r.seconds, r.error, r.error <= 1e-5 ? "ok" : "BAD",
            is_default ? "  (default)" : ""));
      }
    }
  }
  return absl::OkStatus();
}

// GemvError of FP8 codes w [n, k] with one scale: against Σ bf16(x)·code·scale (the GEMV's exact
// operands): ~1e-6 for the GEMV; the GEMM's per-row e4m3 activations add up to 2^-4 of each |x|
// (typically ~1e-3 of the sum). Every n/64-th column, every m/8-th row.
absl::StatusOr<double> GemvFp8Error(Bench& bench, const DeviceBuffer& x, const DeviceBuffer& w,
                                    float w_scale, const DeviceBuffer& y, int64_t m, int64_t n,
                                    int64_t k) {
  std::vector<uint8_t> row(k);
  return GemvError(bench, x, y, m, n, k, std::max<int64_t>(1, n / 64),
                   std::max<int64_t>(1, m / 8),
                   [&](int64_t j, std::vector<double>* values) -> absl::Status {
                     BENCH_RETURN_IF_ERROR(bench.backend().CopyToHost(
                         row.data(), static_cast<const char*>(w.data()) + j * k, k));
                     for (int64_t i = 0; i < k; ++i) {
                       (*values)[i] = double{F8E4M3ToFloat(row[i])} * w_scale;
                     }
                     return absl::OkStatus();
                   });
}

// FP8 weights (issue 30): every gemv_fp8.cuh variant at m <= kGemvFp8MaxRows and the FP8
// tensor-core GEMM (LaunchQuantizeRowsF8 + Fp8Gemm, what Backend::MatMul runs past the GEMV) on
// each (shape, m), against bf16 weights on cuBLAS (the bf16 model's projection). Bytes: FP8
// weights + x + y.
absl::Status RunGemvFp8Sweep(Bench& bench, double copy_bw, int64_t max_reps,
                             std::vector<std::string>* table) {
  absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> shapes =
      ParseShapes(absl::GetFlag(FLAGS_gemv_shapes));
  if (!shapes.ok()) return shapes.status();
  absl::StatusOr<std::vector<int64_t>> rows = ParseList(absl::GetFlag(FLAGS_gemv_fp8_rows));
  if (!rows.ok()) return rows.status();
  absl::StatusOr<cuda_backend::CublasHandle> cublas =
      cuda_backend::CublasHandle::Create(bench.stream());
  if (!cublas.ok()) return cublas.status();
  int device = 0;
  BENCH_CUDA(cudaGetDevice(&device));
  absl::StatusOr<cuda_backend::Fp8Gemm> lt = cuda_backend::Fp8Gemm::Create(device);
  if (!lt.ok()) return lt.status();
  absl::StatusOr<DeviceBuffer> scratch = bench.Alloc(cuda_backend::kFp8GemmWorkspaceBytes);
  if (!scratch.ok()) return scratch.status();
  constexpr float kWScale = 1.0f / 64;
  const int64_t reps = std::min<int64_t>(max_reps, 100);
  for (const auto& [n, k] : *shapes) {
    if (k % 16 != 0) continue;
    const size_t w_bytes = static_cast<size_t>(n * k);
    const int64_t sets = std::max<int64_t>(
        1, static_cast<int64_t>((4 * bench.l2_bytes() + 2 * w_bytes - 1) / (2 * w_bytes)));
    std::vector<DeviceBuffer> weights, weights16;
    for (int64_t s = 0; s < sets; ++s) {
      absl::StatusOr<DeviceBuffer> w = bench.Alloc(w_bytes);
      if (!w.ok()) return w.status();
      BENCH_RETURN_IF_ERROR(bench.Fill(w->data(), DType::kF8E4M3, n * k, 100 + s, 64.0f));
      weights.push_back(*std::move(w));
      absl::StatusOr<DeviceBuffer> w16 = bench.Alloc(2 * w_bytes);
      if (!w16.ok()) return w16.status();
      BENCH_RETURN_IF_ERROR(bench.Fill(w16->data(), DType::kBF16, n * k, 100 + s, 1.0f));
      weights16.push_back(*std::move(w16));
    }
    absl::StatusOr<DeviceBuffer> scales = bench.Alloc(n * 4);
    if (!scales.ok()) return scales.status();
    BENCH_RETURN_IF_ERROR(bench.backend().Fill(scales->as<float>(), kWScale, n));
    for (int64_t m : *rows) {
      absl::StatusOr<DeviceBuffer> x = bench.Alloc(m * k * 4);
      if (!x.ok()) return x.status();
      absl::StatusOr<DeviceBuffer> x16 = bench.Alloc(m * k * 2);
      if (!x16.ok()) return x16.status();
      absl::StatusOr<DeviceBuffer> y = bench.Alloc(m * n * 4);
      if (!y.ok()) return y.status();
      BENCH_RETURN_IF_ERROR(bench.Fill(x->data(), DType::kF32, m * k, 7, 1.0f));
      BENCH_RETURN_IF_ERROR(bench.backend().Synchronize());
      const double bytes = static_cast<double>(w_bytes + m * k * 4 + m * n * 4);
      const double flops = 2.0 * static_cast<double>(m) * n * k;
      struct Result {
        std::string name;
        double seconds = 0.0, error = 0.0;
      };
      std::vector<Result> results;
      auto measure = [&](const std::string& name, bool check,
                         const std::function<absl::Status(int64_t)>& call) -> absl::Status {
        BENCH_CUDA(cudaMemsetAsync(y->data(), 0xff, m * n * 4, bench.stream()));
        BENCH_RETURN_IF_ERROR(call(0));
        BENCH_CUDA(cudaStreamSynchronize(bench.stream()));
        double error = 0.0;
        if (check) {
          absl::StatusOr<double> e = GemvFp8Error(bench, *x, weights[0], kWScale, *y, m, n, k);
          if (!e.ok()) return e.status();
          error = *e;
        }
        absl::StatusOr<double> seconds =
            TimeMedian(bench.stream(), reps, call, [&] { return bench.Busy(reps); });
        if (!seconds.ok()) return seconds.status();
        results.push_back({name, *seconds, error});
        const double gbps = bytes / *seconds / 1e9;
        std::printf("%s\n", nlohmann::json{{"bench", "gemv_fp8"},
                                           {"n", n},
                                           {"k", k},
                                           {"m", m},
                                           {"variant", name},
                                           {"us", *seconds * 1e6},
                                           {"gbps", gbps},
                                           {"tflops", flops / *seconds / 1e12},
                                           {"pct_copy", 100.0 * gbps * 1e9 / copy_bw},
                                           {"max_rel_error", error}}
                                .dump()
                                .c_str());
        return absl::OkStatus();
      };
      // bf16 weights on cuBLAS: x to bf16, then the GEMM (Backend::MatMul's bf16 path past m 1).
      BENCH_RETURN_IF_ERROR(measure("bf16-cublas", false, [&](int64_t rep) -> absl::Status {
        BENCH_CUDA(cuda_backend::LaunchConvertFromF32(
            {.src = x->as<float>(), .dst = x16->data(), .dst_dtype = DType::kBF16, .count = m * k},
            bench.stream()));
        const float alpha = 1.0f, beta = 0.0f;
        if (cublasGemmEx(cublas->get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                         static_cast<int>(m), static_cast<int>(k), &alpha,
                         weights16[rep % sets].data(), CUDA_R_16BF, static_cast<int>(k),
                         x16->data(), CUDA_R_16BF, static_cast<int>(k), &beta, y->data(),
                         CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
          return absl::InternalError("cublasGemmEx failed");
        }
        return absl::OkStatus();
      }));
      const bool gemm_shape = cuda_backend::Fp8Gemm::Supports(m, n, k);
      if (gemm_shape) {
        absl::StatusOr<DeviceBuffer> x_codes = bench.Alloc(m * k);
        if (!x_codes.ok()) return x_codes.status();
        absl::StatusOr<DeviceBuffer> x_scales = bench.Alloc(m * 4);
        if (!x_scales.ok()) return x_scales.status();
        BENCH_RETURN_IF_ERROR(measure("fp8-gemm", true, [&](int64_t rep) -> absl::Status {
          auto* codes = static_cast<uint8_t*>(x_codes->data());
          auto* row_scales = x_scales->as<float>();
          BENCH_CUDA(cuda_backend::LaunchQuantizeRowsF8(
              {.x = x->as<float>(), .codes = codes, .scale = row_scales, .rows = m, .cols = k},
              bench.stream()));
          return lt->Run({.x_codes = codes,
                          .x_scale = row_scales,
                          .w_codes = weights[rep % sets].data(),
                          .w_scale = scales->as<float>(),
                          .y = y->as<float>(),
                          .m = m,
                          .n = n,
                          .k = k},
                         scratch->data(), bench.stream());
        }));
      }
      const cuda_backend::GemvFp8Args probe{.x = x->as<float>(),
                                            .w = weights[0].data(),
                                            .w_scale = scales->as<float>(),
                                            .y = y->as<float>(),
                                            .m = m,
                                            .n = n,
                                            .k = k};
      const bool gemv_shape = cuda_backend::GemvFp8Supports(probe);
      const cuda_backend::GemvFp8Variant chosen = cuda_backend::GemvFp8DefaultVariant(m, n);
      auto variant_name = [](const cuda_backend::GemvFp8Variant& v) {
        return absl::StrCat("gemv-c", v.columns);
      };
      const std::string chosen_name = cuda_backend::GemvFp8Preferred(probe)
                                          ? variant_name(chosen)
                                          : (gemm_shape ? "fp8-gemm" : "");
      if (gemv_shape) {
        for (const cuda_backend::GemvFp8Variant& v : cuda_backend::kGemvFp8Variants) {
          BENCH_RETURN_IF_ERROR(measure(variant_name(v), true, [&](int64_t rep) -> absl::Status {
            cuda_backend::GemvFp8Args a = probe;
            a.w = weights[rep % sets].data();
            BENCH_CUDA(cuda_backend::LaunchGemvFp8(a, v, bench.stream()));
            return absl::OkStatus();
          }));
        }
      }
      const Result& bf16_result = results[0];
      for (const Result& r : results) {
        const double gbps = bytes / r.seconds / 1e9;
        table->push_back(absl::StrFormat(
            "fp8  %6d x %5d  m %3d  %-11s %9.1f us  %5.0f GB/s  %5.1f%% of copy  %6.1f TFLOP/s  "
            "%5.2fx bf16  err %.1e%s",
            static_cast<int>(n), static_cast<int>(k), static_cast<int>(m), r.name.c_str(),
            r.seconds * 1e6, gbps, 100.0 * gbps * 1e9 / copy_bw, flops / r.seconds / 1e12,
            bf16_result.seconds / r.seconds, r.error, r.name == chosen_name ? "  (default)" : ""));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Run() {
  absl::StatusOr<std::unique_ptr<Bench>> created = Bench::Create();
  if (!created.ok()) return created.status();
  Bench& bench = **created;
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  if (dtype_name != "bf16" && dtype_name != "f32") {
    return absl::InvalidArgumentError("--dtype must be bf16 or f32");
  }
  const Geometry geo{absl::GetFlag(FLAGS_q_heads), absl::GetFlag(FLAGS_kv_heads),
                     absl::GetFlag(FLAGS_head_dim),
                     dtype_name == "bf16" ? DType::kBF16 : DType::kF32};
  const double target = absl::GetFlag(FLAGS_seconds);
  const int64_t max_reps = absl::GetFlag(FLAGS_max_reps);

  absl::StatusOr<double> copy_bw = bench.CopyBandwidth();
  if (!copy_bw.ok()) return copy_bw.status();
  std::printf("%s\n", nlohmann::json{{"bench", "copy"},
                                     {"device", bench.device()},
                                     {"gbps", *copy_bw / 1e9}}
                          .dump()
                          .c_str());
  std::vector<std::string> table;

  if (absl::GetFlag(FLAGS_gemv)) {
    BENCH_RETURN_IF_ERROR(RunGemvSweep(bench, *copy_bw, max_reps, &table));
  }
  if (absl::GetFlag(FLAGS_gemv_fp8)) {
    BENCH_RETURN_IF_ERROR(RunGemvFp8Sweep(bench, *copy_bw, max_reps, &table));
  }

  // ---- decode: the paged window = 4 sink slots + a ring of recent positions, all visible.
  absl::StatusOr<std::vector<int64_t>> windows = ParseList(absl::GetFlag(FLAGS_decode_windows));
  if (!windows.ok()) return windows.status();
  absl::StatusOr<std::vector<int64_t>> decode_tokens =
      ParseList(absl::GetFlag(FLAGS_decode_tokens));
  if (!decode_tokens.ok()) return decode_tokens.status();
  absl::StatusOr<std::vector<int64_t>> decode_waves = ParseList(absl::GetFlag(FLAGS_decode_waves));
  if (!decode_waves.ok()) return decode_waves.status();
  for (int64_t window : *windows) {
    constexpr int64_t kSink = 4;
    if (window <= kSink) return absl::InvalidArgumentError("decode window must exceed 4");
    // Context of 1M tokens; the ring's write cursor sits at a third of the ring.
    constexpr int32_t kContext = 1 << 20;
    const int64_t ring = window - kSink;
    std::vector<int32_t> slot_pos(window);
    for (int64_t s = 0; s < window; ++s) {
      if (s < kSink) {
        slot_pos[s] = static_cast<int32_t>(s);
      } else {
        const int64_t age = (s - kSink + ring - ring / 3) % ring;  // 0 = oldest
        slot_pos[s] = static_cast<int32_t>(kContext - ring + age);
      }
    }
    const int64_t kv_bytes = 2 * geo.kv_heads * window * geo.head_dim * DTypeBytes(geo.dtype);
    const int64_t sets = std::max<int64_t>(
        1, (4 * static_cast<int64_t>(bench.l2_bytes()) + kv_bytes - 1) / kv_bytes);
    for (int64_t tokens : *decode_tokens) {
      std::vector<int32_t> q_pos(tokens);
      for (int64_t t = 0; t < tokens; ++t) q_pos[t] = static_cast<int32_t>(kContext + t);
      for (bool maw : {false, true}) {
        absl::StatusOr<Problem> problem =
            MakeProblem(bench, geo, tokens, window, slot_pos, q_pos, sets, maw);
        if (!problem.ok()) return problem.status();
        absl::StatusOr<Bench::Timing> timing = bench.TimeAttention(problem->args, target, max_reps);
        if (!timing.ok()) return timing.status();
        const double qol_bytes = 4.0 * tokens * geo.q_heads * (2 * geo.head_dim + 1);
        const double maw_bytes = maw ? 2.0 * 4 * geo.kv_heads * window : 0.0;
        const double bytes = static_cast<double>(kv_bytes) + qol_bytes + maw_bytes;
        const double gbps = bytes / timing->kernel_seconds / 1e9;
        const double backend_gbps = bytes / timing->backend_seconds / 1e9;
        std::printf("%s\n", nlohmann::json{{"bench", "decode"},
                                           {"window", window},
                                           {"tokens", tokens},
                                           {"maw", maw},
                                           {"bytes", bytes},
                                           {"us", timing->kernel_seconds * 1e6},
                                           {"gbps", gbps},
                                           {"pct_copy", 100.0 * gbps * 1e9 / *copy_bw},
                                           {"backend_us", timing->backend_seconds * 1e6},
                                           {"backend_gbps", backend_gbps},
                                           {"splits", timing->splits},
                                           {"cache_sets", sets},
                                           {"reps", timing->reps}}
                                .dump()
                                .c_str());
        table.push_back(absl::StrFormat(
            "decode  window %6d  tokens %2d  maw %-3s  %9.1f us  %7.0f GB/s  %5.1f%% of copy  "
            "(backend call %9.1f us, %7.0f GB/s)  splits %d",
            window, tokens, maw ? "on" : "off", timing->kernel_seconds * 1e6, gbps,
            100.0 * gbps * 1e9 / *copy_bw, timing->backend_seconds * 1e6, backend_gbps,
            timing->splits));
        // The split sweep (issue 15 item 3): decode plans only (decode_waves leaves others alone).
        if (maw || !timing->decode_kernel) continue;
        for (int64_t waves : *decode_waves) {
          absl::StatusOr<Bench::Timing> swept =
              bench.TimeAttention(problem->args, target, max_reps, /*kernel_only=*/true,
                                  PlanChoice{.decode_waves = static_cast<int>(waves)});
          if (!swept.ok()) return swept.status();
          const double swept_gbps = bytes / swept->kernel_seconds / 1e9;
          std::printf("%s\n", nlohmann::json{{"bench", "decode_waves"},
                                             {"window", window},
                                             {"tokens", tokens},
                                             {"waves", waves},
                                             {"default_waves", cuda_backend::kDecodeWaves},
                                             {"us", swept->kernel_seconds * 1e6},
                                             {"gbps", swept_gbps},
                                             {"pct_copy", 100.0 * swept_gbps * 1e9 / *copy_bw},
                                             {"splits", swept->splits}}
                                  .dump()
                                  .c_str());
          table.push_back(absl::StrFormat(
              "decode  window %6d  tokens %2d  waves %d%s  %9.1f us  %7.0f GB/s  %5.1f%% of copy  "
              "splits %d",
              window, tokens, static_cast<int>(waves),
              waves == cuda_backend::kDecodeWaves ? " (default)" : "", swept->kernel_seconds * 1e6,
              swept_gbps, 100.0 * swept_gbps * 1e9 / *copy_bw, swept->splits));
        }
      }
    }
  }

  // ---- prefill: a chunk of T new tokens at positions [P, P + T) over a window holding
  // positions [0, P + T) in slots of the same index (the chunk's own K/V already written).
  if (absl::GetFlag(FLAGS_prefill)) {
    for (absl::string_view spec :
         absl::StrSplit(absl::GetFlag(FLAGS_prefill_cases), ',', absl::SkipEmpty())) {
      const std::vector<std::string> parts = absl::StrSplit(spec, ':');
      int64_t chunk = 0, prefix = -1;
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &chunk) ||
          !absl::SimpleAtoi(parts[1], &prefix) || chunk <= 0 || prefix < 0) {
        return absl::InvalidArgumentError(absl::StrCat("bad prefill case '", spec, "'"));
      }
      const int64_t slots = prefix + chunk;
      std::vector<int32_t> slot_pos(slots), q_pos(chunk);
      std::iota(slot_pos.begin(), slot_pos.end(), 0);
      std::iota(q_pos.begin(), q_pos.end(), static_cast<int32_t>(prefix));
      // Σ_t visible(t) = Σ_t (P + t + 1)
      const double pairs =
          static_cast<double>(chunk) * prefix + 0.5 * static_cast<double>(chunk) * (chunk + 1);
      const double flops = 4.0 * pairs * geo.q_heads * geo.head_dim;
      absl::StatusOr<Problem> problem =
          MakeProblem(bench, geo, chunk, slots, slot_pos, q_pos, 1, false);
      if (!problem.ok()) return problem.status();
      absl::StatusOr<Bench::Timing> timing = bench.TimeAttention(problem->args, target, max_reps);
      if (!timing.ok()) return timing.status();
      const double tflops = flops / timing->kernel_seconds / 1e12;
      nlohmann::json row{{"bench", "prefill"},
                         {"chunk", chunk},
                         {"prefix", prefix},
                         {"flops", flops},
                         {"ms", timing->kernel_seconds * 1e3},
                         {"tflops", tflops},
                         {"backend_ms", timing->backend_seconds * 1e3},
                         {"splits", timing->splits},
                         {"flash_default", cuda_backend::kFlashDefaultVariant},
                         {"reps", timing->reps}};
      std::string extra;
      auto time_choice = [&](const std::string& name,
                             const PlanChoice& choice) -> absl::Status {
        absl::StatusOr<Bench::Timing> t =
            bench.TimeAttention(problem->args, target, max_reps, true, choice);
        if (!t.ok()) return t.status();
        row[name + "_ms"] = t->kernel_seconds * 1e3;
        row[name + "_tflops"] = flops / t->kernel_seconds / 1e12;
        absl::StrAppend(&extra,
                        absl::StrFormat("; %s %.1f", name, flops / t->kernel_seconds / 1e12));
        return absl::OkStatus();
      };
      for (int v = 0; v < cuda_backend::kFlashVariants; ++v) {
        BENCH_RETURN_IF_ERROR(time_choice(absl::StrCat("flash", v), {.flash_variant = v}));
      }
      BENCH_RETURN_IF_ERROR(time_choice("exact", {.exact_prefill = true}));
      if (absl::GetFlag(FLAGS_compare_f32_kernel)) {
        BENCH_RETURN_IF_ERROR(time_choice("f32_kernel", {.allow_tensor_cores = false}));
      }
      // The fast kernel's numerics at this shape: o and lse against the exact kernel's.
      std::vector<float> exact_o, exact_lse, fast_o, fast_lse;
      BENCH_RETURN_IF_ERROR(
          bench.RunOnce(problem->args[0], {.exact_prefill = true}, &exact_o, &exact_lse));
      for (int v = 0; v < cuda_backend::kFlashVariants; ++v) {
        BENCH_RETURN_IF_ERROR(
            bench.RunOnce(problem->args[0], {.flash_variant = v}, &fast_o, &fast_lse));
        double o_err = 0.0, lse_err = 0.0, o_sq = 0.0, ref_sq = 0.0;
        int64_t bad = 0;  // NaN or unwritten
        for (size_t i = 0; i < fast_o.size(); ++i) {
          if (!std::isfinite(fast_o[i])) {
            ++bad;
            continue;
          }
          const double d = std::abs(static_cast<double>(fast_o[i]) - exact_o[i]);
          o_err = std::max(o_err, d);
          o_sq += d * d;
          ref_sq += static_cast<double>(exact_o[i]) * exact_o[i];
        }
        for (size_t i = 0; i < fast_lse.size(); ++i) {
          if (!std::isfinite(fast_lse[i])) {
            ++bad;
            continue;
          }
          lse_err = std::max(lse_err, std::abs(static_cast<double>(fast_lse[i]) - exact_lse[i]));
        }
        const std::string name = absl::StrCat("flash", v);
        const double o_rel_l2 = std::sqrt(o_sq / std::max(ref_sq, 1e-30));
        row[name + "_o_max_abs"] = o_err;
        row[name + "_o_rel_l2"] = o_rel_l2;
        row[name + "_lse_max_abs"] = lse_err;
        row[name + "_bad"] = bad;
        absl::StrAppend(&extra, absl::StrFormat("; %s vs exact: o %.2e (rel l2 %.2e), lse %.2e, "
                                                "%d bad",
                                                name, o_err, o_rel_l2, lse_err, bad));
      }
      std::printf("%s\n", row.dump().c_str());
      table.push_back(absl::StrFormat(
          "prefill chunk %6d  prefix %6d  %9.3f ms  %6.1f TFLOPS  (backend call %9.3f ms%s)",
          chunk, prefix, timing->kernel_seconds * 1e3, tflops, timing->backend_seconds * 1e3,
          extra));
    }
  }

  // ---- page selection: one layer's SelectPages over the summaries of a long offloaded context.
  if (absl::GetFlag(FLAGS_page_selection)) {
    absl::StatusOr<std::vector<int64_t>> contexts = ParseList(absl::GetFlag(FLAGS_page_contexts));
    if (!contexts.ok()) return contexts.status();
    absl::StatusOr<std::vector<int64_t>> query_tokens =
        ParseList(absl::GetFlag(FLAGS_page_query_tokens));
    if (!query_tokens.ok()) return query_tokens.status();
    const int64_t page_tokens = absl::GetFlag(FLAGS_page_tokens);
    const int64_t select = absl::GetFlag(FLAGS_page_select);
    if (page_tokens <= 0 || select <= 0) {
      return absl::InvalidArgumentError("--page_tokens and --page_select must be positive");
    }
    for (int64_t context : *contexts) {
      const int64_t num_pages = (context + page_tokens - 1) / page_tokens;
      // The buffer holds kPageSummaryRows rows per page; the bound reads two (min, max).
      const size_t summary_elems =
          static_cast<size_t>(geo.kv_heads * num_pages * kPageSummaryRows * geo.head_dim);
      const double summary_bytes =
          static_cast<double>(geo.kv_heads * num_pages * 2 * geo.head_dim * DTypeBytes(geo.dtype));
      const int64_t sets = std::max<int64_t>(
          1, static_cast<int64_t>((4.0 * bench.l2_bytes() + summary_bytes - 1) / summary_bytes));
      for (int64_t tokens : *query_tokens) {
        auto alloc = [&](size_t bytes) { return bench.Alloc(bytes); };
        const size_t q_elems = static_cast<size_t>(tokens * geo.q_heads * geo.head_dim);
        absl::StatusOr<DeviceBuffer> q = alloc(q_elems * 4);
        absl::StatusOr<DeviceBuffer> pages = alloc(tokens * geo.kv_heads * select * 4);
        absl::StatusOr<DeviceBuffer> scratch =
            alloc(SelectPagesScratchBytes(tokens, geo.kv_heads, num_pages));
        if (!q.ok() || !pages.ok() || !scratch.ok()) {
          return !q.ok() ? q.status() : (!pages.ok() ? pages.status() : scratch.status());
        }
        BENCH_RETURN_IF_ERROR(bench.Fill(q->data(), DType::kF32, q_elems, 21, 1.0f));
        std::vector<DeviceBuffer> summaries;
        std::vector<cuda_backend::SelectPagesArgs> args;
        for (int64_t i = 0; i < sets; ++i) {
          absl::StatusOr<DeviceBuffer> s = alloc(summary_elems * DTypeBytes(geo.dtype));
          if (!s.ok()) return s.status();
          BENCH_RETURN_IF_ERROR(bench.Fill(s->data(), geo.dtype, summary_elems, 300 + i, 1.0f));
          summaries.push_back(*std::move(s));
          args.push_back({.q = q->as<float>(),
                          .q_row_stride = geo.q_heads * geo.head_dim,
                          .summaries = summaries.back().data(),
                          .page_stride = kPageSummaryRows * geo.head_dim,
                          .hi_offset = geo.head_dim,
                          .dtype = geo.dtype,
                          .max_pages = num_pages,
                          .num_pages = num_pages,
                          .num_tokens = tokens,
                          .num_q_heads = geo.q_heads,
                          .num_kv_heads = geo.kv_heads,
                          .head_dim = geo.head_dim,
                          .select = select,
                          .pages = pages->as<int32_t>(),
                          .scratch = scratch->data()});
        }
        absl::StatusOr<Bench::SelectTiming> timing = bench.TimeSelectPages(args, target, max_reps);
        if (!timing.ok()) return timing.status();
        // The scoring kernel's traffic: summaries and q read, scores written.
        const double score_bytes =
            summary_bytes + 4.0 * q_elems + 4.0 * tokens * geo.kv_heads * num_pages;
        const double score_gbps = score_bytes / timing->score_seconds / 1e9;
        const double summary_gbps = summary_bytes / timing->total_seconds / 1e9;
        std::printf("%s\n", nlohmann::json{{"bench", "page_select"},
                                           {"context", context},
                                           {"page_tokens", page_tokens},
                                           {"pages", num_pages},
                                           {"select", select},
                                           {"tokens", tokens},
                                           {"summary_bytes", summary_bytes},
                                           {"us", timing->total_seconds * 1e6},
                                           {"score_us", timing->score_seconds * 1e6},
                                           {"top_us", timing->top_seconds * 1e6},
                                           {"backend_us", timing->backend_seconds * 1e6},
                                           {"summary_gbps", summary_gbps},
                                           {"score_gbps", score_gbps},
                                           {"score_pct_copy", 100.0 * score_gbps * 1e9 / *copy_bw},
                                           {"summary_sets", sets},
                                           {"reps", timing->reps}}
                                .dump()
                                .c_str());
        table.push_back(absl::StrFormat(
            "select  context %8d  pages %6d  tokens %2d  select %4d  %8.1f us  (score %7.1f us, "
            "%5.0f GB/s, %5.1f%% of copy; top-k %6.1f us; backend call %8.1f us)",
            context, num_pages, tokens, select, timing->total_seconds * 1e6,
            timing->score_seconds * 1e6, score_gbps, 100.0 * score_gbps * 1e9 / *copy_bw,
            timing->top_seconds * 1e6, timing->backend_seconds * 1e6));
      }
    }
  }

  std::printf("\n%s, copy bandwidth %.0f GB/s (read + write), Hq %d Hkv %d D %d %s cache\n",
              bench.device().c_str(), *copy_bw / 1e9, static_cast<int>(geo.q_heads),
              static_cast<int>(geo.kv_heads), static_cast<int>(geo.head_dim), dtype_name.c_str());
  for (const std::string& line : table) std::printf("%s\n", line.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace tandem::gpu_worker

int main(int argc, char** argv) {
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  const absl::Status status = tandem::gpu_worker::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "tandem-kernel-bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
