// tandem-attend-bench: the CPU attention kernel against the memory system and raw oneDNN.
//
// Prints one JSON object per line, then a table:
//   (a) memory bandwidth of this run: multi-threaded memcpy of --mem_mib MiB (read + write bytes
//       per second) and a read-only streaming sum, best of --reps, all pool threads;
//   (b) raw oneDNN scan: per kv head one bf16 matmul q·Kᵀ [G, D] x [D, N] and one p·V
//       [G, N] x [N, D], no softmax, heads spread over the pool (the reference the issue cites:
//       32 heads x N = 32768 x D = 128, ~71 GB/s on the 16-core host);
//   (c) SparseAttention (dense: every entry selected) over the same configuration, for each N in
//       --n (per kv head).
//   (d) the node's Attend over kv_store sessions (beta = 0: every entry selected);
//   (e) with --select_tokens S: the node's Attend over a SELECTION_PAGES session with pages of
//       --page_tokens P entries, S / P random pages per (kv head, token) of the N held entries
//       (read in place through the block tables; the decode case is
//       --heads 8 --group 4 --select_tokens 2048). Its rate is the K + V bytes of the named
//       pages / median time (the scan rate the planner's budget-based cost uses).
// Rates are KV GB/s = K + V bytes of the scanned entries / median time. Data lives in plain
// aligned buffers (no kv_store), and several copies are rotated so the working set exceeds the
// last-level cache (--footprint_mib).
//
// Flags: --heads H (kv heads, 32) --group G (1) --head_dim D (128) --tokens T (1)
//        --n N1,N2,... (per-head entries; default 1024,4096,32768: 32 heads x 32768 = 1M)
//        --reps R (7) --threads P (0 = available cores) --mem_mib M (2048) --chunk C (2048)
//        --tasks_per_thread K (2, paged) --dense_tasks_per_thread K (8) --footprint_mib F (1024) --quick (small sizes, ~20 s on 2 cores)
//        --select_tokens S (0 = no paged run) --page_tokens P (16) --pool_spin_us U (100)
//        --prefetch_entries E1,E2 (256): PagedAttention-alone rows, random, contiguous and
//        page-major pages --huge_pages (KV sets and node blocks in transparent huge pages)
//        --node_kv_dtype bf16|int8|bf16,int8 (bf16): how the node rows (d), (e) store KV; a list
//        runs (d) and (e) once per dtype on the same data and machine and prints each one's time
//        per call against the first's (int8 vs bf16 per entry: the issue 15 comparison).
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dnnl.hpp>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <memory>
#include <string>
#include <vector>

#include "parse_flags.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "tandem/common/bf16.h"
#include "tandem/common/dnnl_call.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/paged_attention.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/cpu_attention/thread_pool.h"

// Unset optional flags keep the defaults of Flags below (or of --quick).
ABSL_FLAG(bool, quick, false, "small configuration for a 2-core machine");
ABSL_FLAG(std::optional<uint32_t>, heads, std::nullopt, "kv heads (default 32)");
ABSL_FLAG(std::optional<uint32_t>, group, std::nullopt, "query heads per kv head (default 1)");
ABSL_FLAG(std::optional<uint32_t>, head_dim, std::nullopt, "head dimension (default 128)");
ABSL_FLAG(std::optional<uint32_t>, tokens, std::nullopt, "query tokens per call (default 1)");
ABSL_FLAG(std::optional<std::vector<std::string>>, n, std::nullopt,
          "entries per head, comma-separated (default 1024,4096,32768)");
ABSL_FLAG(std::optional<uint32_t>, reps, std::nullopt, "timed repetitions (default 7)");
ABSL_FLAG(std::optional<uint32_t>, threads, std::nullopt, "threads; 0 = available cores");
ABSL_FLAG(std::optional<uint64_t>, mem_mib, std::nullopt, "memcpy buffer MiB (default 2048)");
ABSL_FLAG(std::optional<uint32_t>, chunk, std::nullopt, "keys per matmul chunk (default 2048)");
ABSL_FLAG(std::optional<uint32_t>, tasks_per_thread, std::nullopt,
          "ranges per thread of the paged scans (default 2, NodeOptions::tasks_per_thread)");
ABSL_FLAG(std::optional<uint32_t>, dense_tasks_per_thread, std::nullopt,
          "ranges per thread of the dense attends (default 8, "
          "NodeOptions::dense_tasks_per_thread)");
ABSL_FLAG(std::optional<uint64_t>, footprint_mib, std::nullopt,
          "minimum MiB rotated through so data is not cached (default 1024)");
ABSL_FLAG(uint32_t, select_tokens, 0,
          "entries per (kv head, token) of a paged Attend (random pages); 0 = no paged run");
ABSL_FLAG(uint32_t, page_tokens, 16, "entries per page of the paged Attend");
ABSL_FLAG(std::vector<std::string>, prefetch_entries, {"256"},
          "prefetch distances (entries) of the PagedAttention-alone rows");
ABSL_FLAG(bool, huge_pages, false,
          "back the KV sets and the node's blocks with transparent huge pages (madvise)");
ABSL_FLAG(uint32_t, pool_spin_us, 100,
          "the pools' threads spin this long after a call before sleeping (NodeOptions)");
ABSL_FLAG(std::string, node_kv_dtype, "bf16",
          "how the node rows (node_attend, node_paged_attend) store KV: bf16 or int8, or a "
          "comma-separated list (bf16,int8) timing each on the same data (the raw oneDNN and "
          "sparse_attention rows stay bf16)");

namespace tandem::cpu_attention {
namespace {

// --huge_pages: the KV sets (and the node's block pool) ask for transparent huge pages.
bool g_huge_pages = false;

struct Flags {
  uint32_t heads = 32;
  uint32_t group = 1;
  uint32_t head_dim = 128;
  uint32_t tokens = 1;
  std::vector<uint64_t> n = {1024, 4096, 32768};
  uint32_t reps = 7;
  uint32_t threads = 0;
  uint64_t mem_mib = 2048;
  uint32_t chunk = 2048;
  uint32_t tasks_per_thread = 2;
  uint32_t dense_tasks_per_thread = 8;
  uint64_t footprint_mib = 1024;
  uint32_t select_tokens = 0;
  uint32_t page_tokens = 16;
  uint32_t pool_spin_us = 100;
  std::vector<uint32_t> prefetch_entries = {256};
  std::vector<kv_store::KvDType> node_kv_dtypes = {kv_store::KvDType::kBf16};
};

// Reads the command-line flags into f (--quick first sets small defaults that explicit flags
// still override); false with a message for a bad value.
bool ReadFlags(Flags& f) {
  if (absl::GetFlag(FLAGS_quick)) {
    f.heads = 8;
    f.n = {1024, 16384};
    f.reps = 5;
    f.mem_mib = 512;
    f.footprint_mib = 512;
  }
  auto set = [](const auto& flag, auto& out) {
    if (auto v = absl::GetFlag(flag)) out = *v;
  };
  set(FLAGS_heads, f.heads);
  set(FLAGS_group, f.group);
  set(FLAGS_head_dim, f.head_dim);
  set(FLAGS_tokens, f.tokens);
  set(FLAGS_reps, f.reps);
  set(FLAGS_threads, f.threads);
  set(FLAGS_mem_mib, f.mem_mib);
  set(FLAGS_chunk, f.chunk);
  set(FLAGS_tasks_per_thread, f.tasks_per_thread);
  set(FLAGS_dense_tasks_per_thread, f.dense_tasks_per_thread);
  set(FLAGS_footprint_mib, f.footprint_mib);
  f.select_tokens = absl::GetFlag(FLAGS_select_tokens);
  f.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  f.pool_spin_us = absl::GetFlag(FLAGS_pool_spin_us);
  if (f.pool_spin_us > 100000) return false;
  g_huge_pages = absl::GetFlag(FLAGS_huge_pages);
  f.prefetch_entries.clear();
  for (const std::string& v : absl::GetFlag(FLAGS_prefetch_entries)) {
    uint32_t x = 0;
    if (!absl::SimpleAtoi(v, &x) || x > 4096) return false;
    f.prefetch_entries.push_back(x);
  }
  if (f.page_tokens < 1 || f.page_tokens > 4096) return false;
  f.node_kv_dtypes.clear();
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_node_kv_dtype), ',')) {
    absl::StatusOr<kv_store::KvDType> kv_dtype = ParseNodeKvDType(std::string(name));
    if (!kv_dtype.ok()) {
      std::fprintf(stderr, "--%s\n", std::string(kv_dtype.status().message()).c_str());
      return false;
    }
    f.node_kv_dtypes.push_back(*kv_dtype);
  }
  if (auto list = absl::GetFlag(FLAGS_n)) {
    f.n.clear();
    for (const std::string& item : *list) {
      uint64_t v = 0;
      if (!absl::SimpleAtoi(item, &v) || v == 0) {
        std::fprintf(stderr, "--n: bad entry count '%s'\n", item.c_str());
        return false;
      }
      f.n.push_back(v);
    }
  }
  return f.heads > 0 && f.group > 0 && f.tokens > 0 && f.reps > 0 && !f.n.empty();
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

struct Freer {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<std::byte, Freer>;

Buffer Allocate(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = g_huge_pages ? kHuge : 4096;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) {
    std::fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
    std::exit(1);
  }
  if (g_huge_pages) madvise(p, rounded, MADV_HUGEPAGE);   // before first touch
  return Buffer(static_cast<std::byte*>(p));
}

// Splits [0, bytes) into `parts` 4 KiB-aligned slices; calls fn(offset, length) for slice i.
template <typename Fn>
void Slice(size_t bytes, size_t parts, size_t i, Fn fn) {
  const size_t pages = bytes / 4096;
  const size_t begin = pages * i / parts * 4096;
  const size_t end = i + 1 == parts ? bytes : pages * (i + 1) / parts * 4096;
  fn(begin, end - begin);
}

void Emit(const nlohmann::json& j) { std::printf("%s\n", j.dump().c_str()); }

// ---- (a) memory bandwidth

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

struct MemResult {
  double copy_gbs = 0, read_gbs = 0;
};

MemResult MeasureMemory(ThreadPool& pool, size_t bytes, uint32_t reps) {
  Buffer src = Allocate(bytes), dst = Allocate(bytes);
  const size_t parts = pool.num_threads();
  // First touch by the threads that will use each slice.
  pool.ParallelFor(parts, [&](size_t i) {
    Slice(bytes, parts, i, [&](size_t off, size_t len) {
      std::memset(src.get() + off, 1, len);
      std::memset(dst.get() + off, 0, len);
    });
  });
  MemResult r;
  for (uint32_t rep = 0; rep < reps; ++rep) {
    const double t0 = Now();
    pool.ParallelFor(parts, [&](size_t i) {
      Slice(bytes, parts, i,
            [&](size_t off, size_t len) { std::memcpy(dst.get() + off, src.get() + off, len); });
    });
    r.copy_gbs = std::max(r.copy_gbs, 2.0 * bytes / (Now() - t0) / 1e9);
  }
  std::vector<uint64_t> sums(parts);
  for (uint32_t rep = 0; rep < reps; ++rep) {
    const double t0 = Now();
    pool.ParallelFor(parts, [&](size_t i) {
      Slice(bytes, parts, i, [&](size_t off, size_t len) {
        sums[i] = SumWords(reinterpret_cast<const uint64_t*>(src.get() + off), len / 8);
      });
    });
    r.read_gbs = std::max(r.read_gbs, 1.0 * bytes / (Now() - t0) / 1e9);
  }
  if (sums[0] == 42) std::printf(" ");  // keep the sums alive
  return r;
}

// ---- KV data: `copies` sets of [heads, n, D] bf16 K and V, rotated across reps.

struct KvSet {
  uint32_t heads, D;
  uint64_t n;
  size_t copies;
  Buffer k, v;
  const std::byte* K(size_t copy, uint32_t h) const {
    return k.get() + ((copy * heads + h) * n) * D * 2;
  }
  const std::byte* V(size_t copy, uint32_t h) const {
    return v.get() + ((copy * heads + h) * n) * D * 2;
  }
  size_t bytes_per_copy() const { return size_t{heads} * n * D * 2 * 2; }  // K + V
};

KvSet MakeKv(ThreadPool& pool, uint32_t heads, uint64_t n, uint32_t D, uint64_t footprint) {
  KvSet s{heads, D, n, 1, nullptr, nullptr};
  s.copies = std::max<size_t>(1, (footprint + s.bytes_per_copy() - 1) / s.bytes_per_copy());
  const size_t half = s.copies * s.bytes_per_copy() / 2;
  s.k = Allocate(half);
  s.v = Allocate(half);
  const size_t parts = pool.num_threads();
  // Values ~ uniform in [-2, 2) (xorshift; the kernel's speed does not depend on them).
  pool.ParallelFor(parts, [&](size_t i) {
    uint64_t x = 0x9E3779B97F4A7C15ull * (i + 1);
    for (Buffer* b : {&s.k, &s.v}) {
      Slice(half, parts, i, [&](size_t off, size_t len) {
        bf16_t* p = reinterpret_cast<bf16_t*>(b->get() + off);
        for (size_t e = 0; e < len / 2; ++e) {
          x ^= x << 13;
          x ^= x >> 7;
          x ^= x << 17;
          p[e] = FloatToBf16(static_cast<float>(x >> 40) * (4.0f / 16777216.0f) - 2.0f);
        }
      });
    }
  });
  return s;
}

// ---- (b) raw oneDNN scan

#define BENCH_DNNL(stmt)                                                                  \
  do {                                                                                    \
    try {                                                                                 \
      stmt;                                                                               \
    } catch (const dnnl::error& e) {                                                      \
      std::fprintf(stderr, "oneDNN failed at %s:%d: %s\n", __FILE__, __LINE__, e.what()); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// One thread's primitives for one (G, N, D): S = q·Kᵀ, O = p·V, bf16 in, f32 out.
struct RawScan {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  dnnl::matmul qk, pv;
  dnnl::memory q_m, k_m, s_m, p_m, v_m, o_m, scratch_m;
  std::vector<std::byte> q, p, scratch;
  std::vector<float> s, o;

  RawScan(int64_t G, int64_t N, int64_t D) {
    using dt = dnnl::memory::data_type;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::memory::desc q_md({G, D}, dt::bf16, {D, 1}), k_md({D, N}, dt::bf16, {1, D}),
        s_md({G, N}, dt::f32, {N, 1}), p_md({G, N}, dt::bf16, {N, 1}),
        v_md({N, D}, dt::bf16, {D, 1}), o_md({G, D}, dt::f32, {D, 1});
    dnnl::matmul::primitive_desc qk_pd(dnnl::matmul::desc(q_md, k_md, s_md), attr, eng);
    dnnl::matmul::primitive_desc pv_pd(dnnl::matmul::desc(p_md, v_md, o_md), attr, eng);
    qk = dnnl::matmul(qk_pd);
    pv = dnnl::matmul(pv_pd);
    q.assign(G * D * 2, std::byte{0x3f});
    p.assign(G * N * 2, std::byte{0});
    s.resize(G * N);
    o.resize(G * D);
    scratch.resize(
        std::max(qk_pd.scratchpad_desc().get_size(), pv_pd.scratchpad_desc().get_size()) + 64);
    q_m = dnnl::memory(q_md, eng, q.data());
    s_m = dnnl::memory(s_md, eng, s.data());
    p_m = dnnl::memory(p_md, eng, p.data());
    o_m = dnnl::memory(o_md, eng, o.data());
    k_m = dnnl::memory(k_md, eng, DNNL_MEMORY_NONE);
    v_m = dnnl::memory(v_md, eng, DNNL_MEMORY_NONE);
    scratch_m =
        dnnl::memory(qk_pd.scratchpad_desc().get_size() >= pv_pd.scratchpad_desc().get_size()
                         ? qk_pd.scratchpad_desc()
                         : pv_pd.scratchpad_desc(),
                     eng, scratch.data());
  }

  void Run(const std::byte* k, const std::byte* v) {
    k_m.set_data_handle(const_cast<std::byte*>(k));
    v_m.set_data_handle(const_cast<std::byte*>(v));
    qk.execute(strm, {{DNNL_ARG_SRC, q_m},
                      {DNNL_ARG_WEIGHTS, k_m},
                      {DNNL_ARG_DST, s_m},
                      {DNNL_ARG_SCRATCHPAD, scratch_m}});
    pv.execute(strm, {{DNNL_ARG_SRC, p_m},
                      {DNNL_ARG_WEIGHTS, v_m},
                      {DNNL_ARG_DST, o_m},
                      {DNNL_ARG_SCRATCHPAD, scratch_m}});
    strm.wait();
  }
};

RawScan& ThreadRawScan(int64_t G, int64_t N, int64_t D) {
  thread_local std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<RawScan>> cache;
  auto& slot = cache[{G, N, D}];
  if (!slot) BENCH_DNNL(slot = std::make_unique<RawScan>(G, N, D));
  return *slot;
}

// Median seconds per scan of all heads (one rep = one copy of the data).
double TimeRaw(ThreadPool& pool, const KvSet& kv, uint32_t rows, uint32_t reps) {
  auto scan = [&](size_t copy) {
    pool.ParallelFor(kv.heads, [&](size_t h) {
      RawScan& rs = ThreadRawScan(rows, static_cast<int64_t>(kv.n), kv.D);
      BENCH_DNNL(rs.Run(kv.K(copy, h), kv.V(copy, h)));
    });
  };
  for (size_t c = 0; c < std::min<size_t>(kv.copies, 2); ++c) scan(c);  // warm-up, JIT
  std::vector<double> times;
  for (uint32_t rep = 0; rep < reps; ++rep) {
    const double t0 = Now();
    scan((rep + 2) % kv.copies);
    times.push_back(Now() - t0);
  }
  return Median(times);
}

// ---- (c) SparseAttention over every entry

double TimeSparse(ThreadPool& pool, const KvSet& kv, const Flags& f, uint32_t reps) {
  const uint32_t D = kv.D, G = f.group, T = f.tokens, H = kv.heads;
  std::vector<float> q(size_t{T} * H * G * D), o(q.size()), lse(size_t{T} * H * G);
  for (size_t i = 0; i < q.size(); ++i)
    q[i] = static_cast<float>((i * 7919) % 1000) / 500.0f - 1.0f;
  AttentionParams p;
  p.dtype = kv_store::KvDType::kBf16;
  p.head_dim = D;
  p.group = G;
  p.num_tokens = T;
  p.q_token_stride = p.o_token_stride = size_t{H} * G * D;
  p.lse_token_stride = size_t{H} * G;
  p.chunk_keys = f.chunk;
  p.tasks_per_thread = f.dense_tasks_per_thread;
  std::vector<HeadProblem> heads(H);
  auto run = [&](size_t copy) {
    for (uint32_t h = 0; h < H; ++h) {
      heads[h] = HeadProblem{kv.K(copy, h),
                             kv.V(copy, h),
                             kv.n,
                             q.data() + size_t{h} * G * D,
                             o.data() + size_t{h} * G * D,
                             lse.data() + size_t{h} * G};
    }
    const absl::Status s = SparseAttention(p, heads, pool);
    if (!s.ok()) {
      std::fprintf(stderr, "SparseAttention: %s\n", std::string(s.message()).c_str());
      std::exit(1);
    }
  };
  for (size_t c = 0; c < std::min<size_t>(kv.copies, 2); ++c) run(c);
  std::vector<double> times;
  for (uint32_t rep = 0; rep < reps; ++rep) {
    const double t0 = Now();
    run((rep + 2) % kv.copies);
    times.push_back(Now() - t0);
  }
  return Median(times);
}

// ---- (c') PagedAttention alone over named pages of the same buffers (no node, no proto): the
// scan's own rate, for each prefetch distance and page layout.
enum class PageLayout {
  kRandom,       // random pages; a page's K rows in one array, its V rows in another (the node's)
  kContiguous,   // pages 0..P-1: one run per head, what the scan does without scatter
  kPageMajor,    // random pages; K then V of a page in one run ([page][K rows][V rows])
  kRandomWarm,   // random pages, timed on their second scan right after a first (an upper bound
                 // of what reading a call's pages ahead of it, e.g. during GPU work, would give)
  kContiguousWarm,  // pages 0..P-1 of a head, timed on their second scan right after a first
  kGathered,     // random pages copied by the pool into one arena (K then V of each page, the
                 // pages of a head back to back; its time is gather_us), then scanned there:
                 // what gathering a call's pages while the GPU finishes the layer would leave
};
const char* PageLayoutName(PageLayout l) {
  return l == PageLayout::kRandom       ? "random"
         : l == PageLayout::kContiguous ? "contiguous"
         : l == PageLayout::kPageMajor  ? "page_major"
         : l == PageLayout::kRandomWarm ? "random_warm"
         : l == PageLayout::kContiguousWarm ? "contiguous_warm"
                                            : "gathered";
}

// Where one call's time went, from its ranges' clocks (PagedTaskTimes; the JSON keys say "task"
// as they did when each range was one pool task); microseconds, the median of each over the
// timed calls. A stream computes its ranges back to back, so only the start of each stream's
// first range shows the pool's dispatch.
struct PagedCallShape {
  double wall_us = 0;        // the whole PagedAttention call
  double start_p50_us = 0;   // the median range's start
  double last_start_us = 0;  // the last range's start
  double task_us = 0;        // a range's mean duration
  double last_end_us = 0;    // the last range's end
  double busy_share = 0;     // Σ range time / (threads × wall)
  double gather_us = 0;      // kGathered: the copy of the call's pages into the arena
  // The call of median wall time, range by range (µs after the call began, in range order: the
  // first `threads` ranges are the streams' first claims): where its threads waited.
  std::vector<double> range_start_us, range_end_us;
};

double TimePagedKernel(ThreadPool& pool, const KvSet& kv, const Flags& f, uint32_t prefetch,
                       PageLayout layout, uint64_t* bytes, PagedCallShape* shape) {
  const bool contiguous =
      layout == PageLayout::kContiguous || layout == PageLayout::kContiguousWarm;
  const bool page_major = layout == PageLayout::kPageMajor;
  const bool warm = layout == PageLayout::kRandomWarm || layout == PageLayout::kContiguousWarm;
  const bool gathered = layout == PageLayout::kGathered;
  const uint32_t D = kv.D, G = f.group, H = kv.heads, P = f.page_tokens;
  // Page-major pages live in the K array of a head, two pages' worth of rows each (K then V).
  const uint64_t num_pages = page_major ? kv.n / P / 2 : kv.n / P;
  const uint64_t per_head =
      std::min<uint64_t>(num_pages, std::max<uint32_t>(1, f.select_tokens / P));
  std::vector<float> q(size_t{H} * G * D), o(q.size()), lse(size_t{H} * G);
  for (size_t i = 0; i < q.size(); ++i)
    q[i] = static_cast<float>((i * 7919) % 1000) / 500.0f - 1.0f;
  PagedParams p;
  p.dtype = kv_store::KvDType::kBf16;
  p.head_dim = D;
  p.group = G;
  p.tasks_per_thread = f.tasks_per_thread;
  p.prefetch_entries = prefetch;
  // 32 calls with their own pages (as the node rows), over the copies in turn.
  constexpr size_t kCalls = 32;
  std::vector<std::vector<KvRun>> runs(kCalls);
  std::vector<std::vector<PagedProblem>> problems(kCalls);
  std::vector<uint64_t> ids(num_pages);
  for (size_t c = 0; c < kCalls; ++c) {
    std::mt19937_64 rng(c + 1);
    const size_t copy = c % kv.copies;
    for (uint32_t h = 0; h < H; ++h) {
      std::iota(ids.begin(), ids.end(), 0);
      if (!contiguous) {
        for (uint64_t i = 0; i < per_head; ++i) std::swap(ids[i], ids[i + rng() % (num_pages - i)]);
        std::sort(ids.begin(), ids.begin() + per_head);
      }
      PagedProblem pr;
      pr.run_begin = runs[c].size();
      for (uint64_t i = 0; i < per_head; ++i) {
        const size_t page_bytes = size_t{P} * D * 2;
        if (page_major) {
          const std::byte* k = kv.K(copy, h) + ids[i] * 2 * page_bytes;
          runs[c].push_back(KvRun{k, k + page_bytes, P});
        } else {
          const size_t at = ids[i] * page_bytes;
          runs[c].push_back(KvRun{kv.K(copy, h) + at, kv.V(copy, h) + at, P});
        }
      }
      pr.run_end = runs[c].size();
      pr.q = q.data() + size_t{h} * G * D;
      pr.o = o.data() + size_t{h} * G * D;
      pr.lse = lse.data() + size_t{h} * G;
      problems[c].push_back(pr);
    }
  }
  // kGathered: each call's runs copied into the arena ([head][page][K rows, V rows]) before its
  // scan; the scan reads the arena's runs.
  const size_t page_bytes = size_t{P} * D * 2;
  Buffer arena = gathered ? Allocate(size_t{H} * per_head * 2 * page_bytes) : nullptr;
  std::vector<KvRun> arena_runs;
  for (uint64_t i = 0; gathered && i < uint64_t{H} * per_head; ++i) {
    std::byte* k = arena.get() + i * 2 * page_bytes;
    arena_runs.push_back(KvRun{k, k + page_bytes, P});
  }
  auto gather = [&](size_t c) {
    const size_t parts = size_t{pool.num_threads()} * 2;
    pool.ParallelFor(parts, [&](size_t part) {
      const size_t begin = runs[c].size() * part / parts, end = runs[c].size() * (part + 1) / parts;
      for (size_t r = begin; r < end; ++r) {
        std::byte* page = arena.get() + r * 2 * page_bytes;   // arena_runs[r]: K, then V
        std::memcpy(page, runs[c][r].k, page_bytes);
        std::memcpy(page + page_bytes, runs[c][r].v, page_bytes);
      }
    });
  };
  auto run = [&](size_t c) {
    const absl::Status s = PagedAttention(p, gathered ? arena_runs : runs[c], problems[c], pool);
    if (!s.ok()) {
      std::fprintf(stderr, "PagedAttention: %s\n", std::string(s.message()).c_str());
      std::exit(1);
    }
  };
  for (size_t c = 0; c < 2; ++c) run(c);
  std::vector<double> times, start_p50, last_start, task, last_end, busy, gather_times;
  std::vector<PagedTaskTimes> timelines;
  PagedTaskTimes task_times;
  for (uint32_t rep = 0; rep < std::max<uint32_t>(f.reps, 16); ++rep) {
    if (warm) run((rep + 2) % kCalls);
    if (gathered) {
      const double g0 = Now();
      gather((rep + 2) % kCalls);
      gather_times.push_back(Now() - g0);
    }
    p.task_times = &task_times;
    const double t0 = Now();
    run((rep + 2) % kCalls);
    const double wall = Now() - t0;
    p.task_times = nullptr;
    times.push_back(wall);
    std::vector<double> starts = task_times.start_s;
    double sum = 0;
    for (size_t i = 0; i < starts.size(); ++i) sum += task_times.end_s[i] - starts[i];
    start_p50.push_back(Median(starts) * 1e6);
    last_start.push_back(*std::max_element(starts.begin(), starts.end()) * 1e6);
    task.push_back(sum / static_cast<double>(starts.size()) * 1e6);
    last_end.push_back(
        *std::max_element(task_times.end_s.begin(), task_times.end_s.end()) * 1e6);
    busy.push_back(sum / (pool.num_threads() * wall));
    timelines.push_back(task_times);
  }
  *bytes = uint64_t{H} * per_head * P * D * 2 * 2;
  std::vector<size_t> order(times.size());
  std::iota(order.begin(), order.end(), 0);
  std::nth_element(order.begin(), order.begin() + order.size() / 2, order.end(),
                   [&](size_t a, size_t b) { return times[a] < times[b]; });
  const PagedTaskTimes& median_call = timelines[order[order.size() / 2]];
  auto to_us = [](const std::vector<double>& s) {
    std::vector<double> us;
    for (double x : s) us.push_back(std::round(x * 1e7) / 10);
    return us;
  };
  *shape = PagedCallShape{Median(times) * 1e6, Median(start_p50), Median(last_start),
                          Median(task),        Median(last_end),  Median(busy),
                          gathered ? Median(gather_times) * 1e6 : 0.0,
                          to_us(median_call.start_s), to_us(median_call.end_s)};
  return Median(times);
}

// ---- (d) the node's Attend: the same entries appended to sessions of a CpuAttentionNode
// (kv_store blocks, selected copies), queried with AttendRequest protos, timed per call.

// A node storing the KV set as one dtype, its sessions filled and its requests built.
struct NodeRig {
  std::unique_ptr<CpuAttentionNode> node;
  std::vector<v1::AttendRequest> requests;
  uint64_t bytes_scanned = 0;
  double last_compute_s = 0;   // the last call's time in the node's kernels (compute_micros)

  // Seconds of one Attend of request c (exits on an error).
  double Run(size_t c) {
    v1::AttendResponse resp;
    const double t0 = Now();
    const absl::Status s = node->Attend(requests[c % requests.size()], &resp);
    const double seconds = Now() - t0;
    if (!s.ok()) {
      std::fprintf(stderr, "Attend: %s\n", s.ToString().c_str());
      std::exit(1);
    }
    bytes_scanned = resp.bytes_scanned();
    last_compute_s = static_cast<double>(resp.compute_micros()) * 1e-6;
    return seconds;
  }
};

// paged: a SELECTION_PAGES session (block 64, f.page_tokens per page) attended over
// f.select_tokens / f.page_tokens random pages per (kv head, token) instead of every entry.
NodeRig MakeNodeRig(const KvSet& kv, const Flags& f, kv_store::KvDType kv_dtype, bool paged) {
  const uint32_t D = kv.D, G = f.group, H = kv.heads;
  NodeOptions options;
  // Blocks plus the selected copy (beta = 0 selects everything) of every session, with slack.
  options.pool_bytes = 3 * kv.copies * kv.bytes_per_copy() + (256ull << 20);
  options.threads = f.threads;
  options.chunk_keys = f.chunk;
  options.tasks_per_thread = f.tasks_per_thread;
  options.dense_tasks_per_thread = f.dense_tasks_per_thread;
  options.pool_spin_us = f.pool_spin_us;
  options.huge_pages = g_huge_pages;
  options.block_tokens = 256;
  options.kv_dtype = kv_dtype;
  auto node = CpuAttentionNode::Create(options);
  if (!node.ok()) {
    std::fprintf(stderr, "node: %s\n", node.status().ToString().c_str());
    std::exit(1);
  }
  auto check = [](const absl::Status& s, const char* what) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
      std::exit(1);
    }
  };
  const size_t sessions = kv.copies;
  for (size_t c = 0; c < sessions; ++c) {
    v1::OpenSessionRequest open;
    open.set_session_id("bench-" + std::to_string(c));
    open.mutable_geometry()->set_num_layers(1);
    open.mutable_geometry()->set_num_q_heads(H * G);
    open.mutable_geometry()->set_num_kv_heads(H);
    open.mutable_geometry()->set_head_dim(D);
    open.set_kv_dtype(v1::DTYPE_BF16);
    open.set_beta(0);
    if (paged) {
      open.set_selection(v1::SELECTION_PAGES);
      open.set_page_tokens(f.page_tokens);
      open.set_block_size(64);
    }
    v1::OpenSessionResponse opened;
    check((*node)->OpenSession(open, &opened), "OpenSession");
    constexpr uint64_t kChunk = 4096;
    for (uint64_t first = 0; first < kv.n; first += kChunk) {
      const uint64_t count = std::min(kChunk, kv.n - first);
      v1::AppendKvRequest msg;
      msg.set_session_id(open.session_id());
      msg.set_window_entries(1);
      for (v1::Tensor* t : {msg.mutable_k(), msg.mutable_v()}) {
        t->set_dtype(v1::DTYPE_BF16);
        t->add_shape(H);
        t->add_shape(static_cast<int64_t>(count));
        t->add_shape(D);
        std::string* data = t->mutable_data();
        data->resize(size_t{H} * count * D * 2);
        for (uint32_t h = 0; h < H; ++h) {
          const std::byte* src = (t == msg.mutable_k() ? kv.K(c, h) : kv.V(c, h)) + first * D * 2;
          std::memcpy(data->data() + size_t{h} * count * D * 2, src, count * D * 2);
        }
      }
      msg.mutable_maw()->set_dtype(v1::DTYPE_F32);
      msg.mutable_maw()->add_shape(H);
      msg.mutable_maw()->add_shape(static_cast<int64_t>(count));
      msg.mutable_maw()->mutable_data()->assign(size_t{H} * count * 4, '\0');
      v1::AppendKvResponse totals;
      check((*node)->AppendKv(msg, &totals), "AppendKv");
    }
  }
  std::vector<float> q(size_t{f.tokens} * H * G * D);
  for (size_t i = 0; i < q.size(); ++i)
    q[i] = static_cast<float>((i * 7919) % 1000) / 500.0f - 1.0f;
  // Paged: at least 32 requests with their own random pages (32 x 8 MiB at the budget),
  // spread over the sessions, so the pages read are not still in the last-level cache from an
  // earlier rep even when few sessions cover the footprint.
  const size_t num_requests = paged ? std::max<size_t>(sessions, 32) : sessions;
  std::vector<v1::AttendRequest> requests(num_requests);
  for (size_t c = 0; c < num_requests; ++c) {
    v1::AttendQuery* query = requests[c].add_queries();
    query->set_session_id("bench-" + std::to_string(c % sessions));
    const int64_t shape[] = {f.tokens, H * G, D};
    EncodeF32(q, shape, query->mutable_q());
    if (!paged) continue;
    // Random distinct pages per (token, kv head), ascending.
    const uint64_t num_pages = (kv.n + f.page_tokens - 1) / f.page_tokens;
    const uint64_t per_head = std::min<uint64_t>(
        num_pages, std::max<uint32_t>(1, f.select_tokens / f.page_tokens));
    query->set_pages_per_head(static_cast<uint32_t>(per_head));
    std::mt19937_64 rng(c + 1);
    std::vector<int32_t> ids(num_pages);
    for (uint32_t row = 0; row < f.tokens * H; ++row) {
      std::iota(ids.begin(), ids.end(), 0);
      for (uint64_t i = 0; i < per_head; ++i) {
        std::swap(ids[i], ids[i + rng() % (num_pages - i)]);
      }
      std::sort(ids.begin(), ids.begin() + per_head);
      query->mutable_pages()->Add(ids.begin(), ids.begin() + per_head);
    }
  }
  return NodeRig{std::move(*node), std::move(requests), 0};
}

// Median seconds per Attend of a node per dtype, the bytes each call scans and the median
// seconds per call outside the node's kernels (checks, planning, the answer's layout: the call's
// time less its compute_micros). The reps are interleaved (rep r of every dtype before rep r + 1
// of any), so a drift of the machine (other load, clocks) hits every dtype alike.
std::vector<double> TimeNodeAttends(const KvSet& kv, const Flags& f,
                                    const std::vector<kv_store::KvDType>& dtypes, uint32_t reps,
                                    bool paged, std::vector<uint64_t>* bytes_scanned,
                                    std::vector<double>* outside_kernels_s) {
  std::vector<NodeRig> rigs;
  for (kv_store::KvDType dtype : dtypes) rigs.push_back(MakeNodeRig(kv, f, dtype, paged));
  for (NodeRig& rig : rigs) {
    for (size_t c = 0; c < std::min<size_t>(rig.requests.size(), 2); ++c) rig.Run(c);  // warm-up
  }
  std::vector<std::vector<double>> times(rigs.size()), outside(rigs.size());
  for (uint32_t rep = 0; rep < reps; ++rep) {
    for (size_t i = 0; i < rigs.size(); ++i) {
      times[i].push_back(rigs[i].Run(rep + 2));
      outside[i].push_back(times[i].back() - rigs[i].last_compute_s);
    }
  }
  std::vector<double> medians;
  bytes_scanned->clear();
  outside_kernels_s->clear();
  for (size_t i = 0; i < rigs.size(); ++i) {
    medians.push_back(Median(times[i]));
    bytes_scanned->push_back(rigs[i].bytes_scanned);
    outside_kernels_s->push_back(Median(outside[i]));
  }
  return medians;
}

const char* IsaName(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

std::string DTypeNames(const std::vector<kv_store::KvDType>& dtypes) {
  std::string out;
  for (kv_store::KvDType d : dtypes) {
    if (!out.empty()) out += ",";
    out += kv_store::KvDTypeName(d);
  }
  return out;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "tandem-attend-bench [--quick] [--heads H] [--group G] [--head_dim D] [--tokens T] "
      "[--n N1,N2] [--reps R] [--threads P] [--mem_mib M] [--chunk C] [--tasks_per_thread K] [--dense_tasks_per_thread K] "
      "[--footprint_mib F] [--select_tokens S] [--page_tokens P] [--node_kv_dtype bf16,int8]");
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  Flags f;
  if (!ReadFlags(f)) {
    std::fprintf(stderr, "bad flags (tandem-attend-bench --help lists them)\n");
    return 2;
  }
  ThreadPool pool(f.threads, std::chrono::microseconds(f.pool_spin_us));
  const unsigned threads = pool.num_threads();
  const uint32_t rows = f.group * f.tokens;
  Emit({{"bench", "config"},
        {"threads", threads},
        {"available_cores", AvailableCores()},
        {"heads", f.heads},
        {"group", f.group},
        {"tokens", f.tokens},
        {"head_dim", f.head_dim},
        {"n", f.n},
        {"reps", f.reps},
        {"chunk", f.chunk},
        {"tasks_per_thread", f.tasks_per_thread},
        {"dense_tasks_per_thread", f.dense_tasks_per_thread},
        {"pool_spin_us", f.pool_spin_us},
        {"huge_pages", g_huge_pages},
        {"node_kv_dtype", DTypeNames(f.node_kv_dtypes)},
        {"dnnl_isa", IsaName(dnnl::get_effective_cpu_isa())},
        {"cpu_isa", CpuIsaName(ActiveCpuIsa())},
        {"native_cpu_isa", CpuIsaName(NativeCpuIsa())},
        {"bf16_attention", cpu_attention::Bf16AttentionPath()}});
  const bool has_raw = OneDnnHasBf16Matmul();

  const MemResult mem = MeasureMemory(pool, f.mem_mib << 20, f.reps);
  Emit({{"bench", "memory"},
        {"bytes", f.mem_mib << 20},
        {"memcpy_rw_gbs", mem.copy_gbs},
        {"read_gbs", mem.read_gbs}});

  struct Row {
    uint64_t n;
    double raw_gbs, sparse_gbs, sparse_us, node_gbs, node_us;
  };
  std::vector<Row> table;
  // The node rows of every --node_kv_dtype (dense and paged Attends): dtype, n, bytes scanned,
  // seconds per call.
  struct DTypeRow {
    kv_store::KvDType dtype;
    uint64_t n, bytes;
    double seconds;
    bool paged;
  };
  std::vector<DTypeRow> dtype_rows;
  for (uint64_t n : f.n) {
    const KvSet kv = MakeKv(pool, f.heads, n, f.head_dim, f.footprint_mib << 20);
    const double bytes = static_cast<double>(kv.bytes_per_copy());
    // oneDNN 2.6 has no bf16 matmul without AVX-512 (or under TANDEM_CPU_ISA below avx512, which
    // caps it): no raw row there, and the ratios to it print as null / nan.
    const double raw_s = has_raw ? TimeRaw(pool, kv, rows, f.reps) : std::nan("");
    if (has_raw) {
      Emit({{"bench", "raw_onednn_scan"},
            {"n_per_head", n},
            {"total_entries", n * f.heads},
            {"kv_bytes", bytes},
            {"median_s", raw_s},
            {"kv_gbs", bytes / raw_s / 1e9}});
    }
    const double sparse_s = TimeSparse(pool, kv, f, f.reps);
    const double sparse_gbs = bytes / sparse_s / 1e9;
    Emit({{"bench", "sparse_attention"},
          {"n_per_head", n},
          {"total_entries", n * f.heads},
          {"kv_bytes", bytes},
          {"median_s", sparse_s},
          {"kv_gbs", sparse_gbs},
          {"ratio_to_raw_onednn", raw_s / sparse_s},
          {"ratio_to_memcpy_rw", sparse_gbs / mem.copy_gbs},
          {"ratio_to_read", sparse_gbs / mem.read_gbs}});
    // PagedAttention alone (c'): each page layout per prefetch distance.
    for (uint32_t prefetch : f.select_tokens > 0 ? f.prefetch_entries : std::vector<uint32_t>{}) {
      for (PageLayout layout :
           {PageLayout::kRandom, PageLayout::kContiguous, PageLayout::kPageMajor,
            PageLayout::kRandomWarm, PageLayout::kContiguousWarm, PageLayout::kGathered}) {
        uint64_t paged_bytes = 0;
        PagedCallShape shape;
        const double paged_s =
            TimePagedKernel(pool, kv, f, prefetch, layout, &paged_bytes, &shape);
        const double paged_gbs = static_cast<double>(paged_bytes) / paged_s / 1e9;
        Emit({{"bench", "paged_kernel"},
              {"pages", PageLayoutName(layout)},
              {"prefetch_entries", prefetch},
              {"n_per_head", n},
              {"select_tokens", f.select_tokens},
              {"page_tokens", f.page_tokens},
              {"kv_bytes_scanned", paged_bytes},
              {"median_s", paged_s},
              {"kv_gbs", paged_gbs},
              {"ratio_to_sparse_attention", paged_gbs / sparse_gbs},
              {"ratio_to_read", paged_gbs / mem.read_gbs},
              {"wall_us", shape.wall_us},
              {"task_start_p50_us", shape.start_p50_us},
              {"last_task_start_us", shape.last_start_us},
              {"task_us", shape.task_us},
              {"last_task_end_us", shape.last_end_us},
              {"busy_share", shape.busy_share},
              {"gather_us", shape.gather_us},
              {"range_start_us", shape.range_start_us},
              {"range_end_us", shape.range_end_us}});
      }
    }
    std::vector<uint64_t> scanned;
    std::vector<double> outside_s;
    const std::vector<double> node_times =
        TimeNodeAttends(kv, f, f.node_kv_dtypes, f.reps, /*paged=*/false, &scanned, &outside_s);
    std::vector<double> node_gbs_of(f.node_kv_dtypes.size());   // dense, per dtype
    const double first_node_s = node_times[0];
    const double first_node_gbs = static_cast<double>(scanned[0]) / first_node_s / 1e9;
    for (size_t i = 0; i < f.node_kv_dtypes.size(); ++i) {
      const kv_store::KvDType dtype = f.node_kv_dtypes[i];
      const uint64_t node_bytes = scanned[i];
      const double node_s = node_times[i];
      const double node_gbs = static_cast<double>(node_bytes) / node_s / 1e9;
      node_gbs_of[i] = node_gbs;
      Emit({{"bench", "node_attend"},
            {"node_kv_dtype", kv_store::KvDTypeName(dtype)},
            {"n_per_head", n},
            {"total_entries", n * f.heads},
            {"kv_bytes_scanned", node_bytes},
            {"median_s", node_s},
            {"kv_gbs", node_gbs},
            {"entries_per_s", static_cast<double>(n * f.heads) / node_s},
            {"outside_kernels_us", outside_s[i] * 1e6},
            {"speedup_vs_first_dtype", first_node_s / node_s},
            {"ratio_to_raw_onednn", node_gbs / (bytes / raw_s / 1e9)},
            {"ratio_to_memcpy_rw", node_gbs / mem.copy_gbs},
            {"ratio_to_read", node_gbs / mem.read_gbs}});
      dtype_rows.push_back({dtype, n, node_bytes, node_s, false});
    }
    table.push_back(
        {n, bytes / raw_s / 1e9, sparse_gbs, sparse_s * 1e6, first_node_gbs, first_node_s * 1e6});
    const std::vector<double> paged_times =
        f.select_tokens > 0
            ? TimeNodeAttends(kv, f, f.node_kv_dtypes, f.reps, /*paged=*/true, &scanned,
                              &outside_s)
            : std::vector<double>{};
    for (size_t i = 0; i < paged_times.size(); ++i) {
      const kv_store::KvDType dtype = f.node_kv_dtypes[i];
      const uint64_t paged_bytes = scanned[i];
      const double paged_s = paged_times[i];
      const double paged_gbs = static_cast<double>(paged_bytes) / paged_s / 1e9;
      Emit({{"bench", "node_paged_attend"},
            {"node_kv_dtype", kv_store::KvDTypeName(dtype)},
            {"n_per_head", n},
            {"select_tokens", f.select_tokens},
            {"page_tokens", f.page_tokens},
            {"kv_bytes_scanned", paged_bytes},
            {"median_s", paged_s},
            {"kv_gbs", paged_gbs},
            {"kv_gbs_per_thread", paged_gbs / threads},
            {"outside_kernels_us", outside_s[i] * 1e6},
            {"ratio_to_node_attend", paged_gbs / node_gbs_of[i]},
            {"ratio_to_read", paged_gbs / mem.read_gbs}});
      dtype_rows.push_back({dtype, n, paged_bytes, paged_s, true});
    }
  }

  std::printf(
      "\nthreads %u, %u kv heads x group %u x %u tokens, head_dim %u, bf16 KV (Attend: %s node "
      "KV)\n",
      threads, f.heads, f.group, f.tokens, f.head_dim,
      kv_store::KvDTypeName(f.node_kv_dtypes.front()));
  std::printf("memory: memcpy %.1f GB/s (read+write), streaming read %.1f GB/s\n", mem.copy_gbs,
              mem.read_gbs);
  std::printf("%10s %12s %10s %10s %10s %8s %8s %9s %10s %10s %8s\n", "n/head", "entries",
              "raw GB/s", "attn GB/s", "attn us", "vs raw", "vs read", "vs memcpy", "Attend GB/s",
              "Attend us", "vs raw");
  for (const Row& r : table) {
    std::printf("%10llu %12llu %10.2f %10.2f %10.0f %7.0f%% %7.0f%% %8.0f%% %11.2f %10.0f %7.0f%%\n",
                static_cast<unsigned long long>(r.n),
                static_cast<unsigned long long>(r.n * f.heads), r.raw_gbs, r.sparse_gbs,
                r.sparse_us, 100.0 * r.sparse_gbs / r.raw_gbs, 100.0 * r.sparse_gbs / mem.read_gbs,
                100.0 * r.sparse_gbs / mem.copy_gbs, r.node_gbs, r.node_us,
                100.0 * r.node_gbs / r.raw_gbs);
  }
  for (const DTypeRow& r : dtype_rows) {
    if (!r.paged) continue;
    std::printf(
        "paged Attend (%s): n/head %llu, %u tokens per (head, token) in pages of %u: %.2f MiB "
        "scanned in %.0f us = %.2f GB/s (%.2f GB/s per thread)\n",
        kv_store::KvDTypeName(r.dtype), static_cast<unsigned long long>(r.n), f.select_tokens,
        f.page_tokens, r.bytes / 1048576.0, r.seconds * 1e6, r.bytes / r.seconds / 1e9,
        r.bytes / r.seconds / 1e9 / threads);
  }
  // Several node dtypes: each one's time per call against the first's (same entries, so the
  // ratio is the speed per entry).
  for (size_t i = 0; f.node_kv_dtypes.size() > 1 && i < dtype_rows.size(); ++i) {
    const DTypeRow& r = dtype_rows[i];
    const DTypeRow* base = nullptr;
    for (const DTypeRow& b : dtype_rows) {
      if (b.n == r.n && b.paged == r.paged && b.dtype == f.node_kv_dtypes.front()) base = &b;
    }
    std::printf(
        "%s Attend n/head %llu, %s node KV: %.0f us per call, %.2f GB/s, %.2fx the speed of %s\n",
        r.paged ? "paged" : "dense", static_cast<unsigned long long>(r.n),
        kv_store::KvDTypeName(r.dtype), r.seconds * 1e6, r.bytes / r.seconds / 1e9,
        base->seconds / r.seconds, kv_store::KvDTypeName(base->dtype));
  }
  return 0;
}

}  // namespace
}  // namespace tandem::cpu_attention

int main(int argc, char** argv) { return tandem::cpu_attention::Main(argc, argv); }
