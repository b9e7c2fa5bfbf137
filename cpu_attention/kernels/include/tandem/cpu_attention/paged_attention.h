// Exact attention over named pages of a shard, read in place through its block table (the CPU
// side of query-aware `pages` selection, DESIGN "Selection"; issue 11).
//
// Pages: the held entries of a (session, layer, kv head) shard, numbered 0..held-1 in append
// order, are cut into pages of `page_tokens` entries; page p = entries
// [p * page_tokens, (p + 1) * page_tokens) ∩ [0, held). Entry i lives in block
// blocks()[i / block_tokens] at row i % block_tokens, so a page is one or more runs of
// consecutive rows inside blocks; consecutive selected pages inside one block form one longer
// run. The kernel reads only those rows: no per-step copy into a scratch buffer.
//
// Numerics (contract in proto/tandem/v1/common.proto): scores q·k * scale (scale 0 =
// 1/sqrt(head_dim)) accumulated in fp32, fp32 online softmax (base-2 exponentials with a ~2 ulp
// polynomial, tandem/common/exp2_approx.h), natural-log LSE; an empty selection gives O = 0 and
// LSE = -inf.
//
// Work split (HGCA §3.3, as sparse_attention.h): the entries of all problems, end to end, are
// cut into about tasks_per_thread × threads ranges of equal cost; a long problem is split along
// its runs, short ones share a range (a range may come out empty). The pool's threads claim
// ranges in order until none is left (a late or slow thread takes fewer), each claiming its next
// range when its prefetches reach the end of the current one and prefetching on into it. Each
// piece of a split problem yields a partial (O, LSE) state; the problem's last piece to finish
// merges them in entry order with MergeStateInPlace (results independent of the threads). The
// inner loop is hand-written with GCC vector types (bf16 rows widened to f32, fp32 dot products and accumulation), compiled for AVX-512, AVX2 and baseline
// x86-64 and picked at run time, because oneDNN primitive calls per 16-row page cost more than
// the scan; the rows ahead are prefetched (short scattered runs defeat the hardware prefetcher).
// int8 rows on AVX-512 CPUs go through hand-written kernels that widen the codes in registers
// (src/row_scan_kernels.h); SparseAttention routes its few-row int8 problems here too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/kv_store/block_format.h"
#include "tandem/kv_store/shard.h"

namespace tandem::cpu_attention {

// Consecutive rows of one block.
struct KvRun {
  const std::byte* k = nullptr;  // [n, head_dim] of the KV dtype, row-major
  const std::byte* v = nullptr;  // [n, head_dim]
  uint32_t n = 0;
};

// Named pages of one shard as a problem's entries, resolved into runs by the task that reads
// them: a decode step's block-table reads (one per page, cold after the step's scan of other
// layers) then run on every pool thread beside the scan, not on the calling thread before it
// (BENCHMARKS "The node's planning"). `ids` ascending without padding, each passed CheckPageRow
// against shard->held(); `entries` = PageEntries(ids, page_tokens, held). The shard must not
// change during the call (the caller holds its session's lock).
struct PageSpan {
  const kv_store::Shard* shard = nullptr;
  std::span<const int32_t> ids;
  uint32_t page_tokens = 0;
  uint64_t entries = 0;
};

// The held entries that pages `ids` (ascending, each starting below `held`) of a shard holding
// `held` entries cover: page_tokens each, but the last may end at `held`.
uint64_t PageEntries(std::span<const int32_t> ids, uint32_t page_tokens, uint64_t held);

// One problem: the query rows of `num_tokens` tokens of one kv head (G rows per token)
// attending over runs[run_begin, run_end) of the runs array given to PagedAttention, or, when
// pages.shard is set, over those pages (run_begin and run_end unused).
// Query row (t, j) of the group is at q + t * q_token_stride + j * head_dim, its output at
// o + t * o_token_stride + j * head_dim and lse + t * lse_token_stride + j (strides in floats;
// unused when num_tokens == 1). Problems sharing their runs over several tokens (dense) read
// each row once for all of them.
struct PagedProblem {
  size_t run_begin = 0;
  size_t run_end = 0;
  PageSpan pages;
  uint32_t num_tokens = 1;
  const float* q = nullptr;
  float* o = nullptr;
  float* lse = nullptr;
  size_t q_token_stride = 0;
  size_t o_token_stride = 0;
  size_t lse_token_stride = 0;
};

struct PagedParams {
  kv_store::KvDType dtype = kv_store::KvDType::kBf16;
  uint32_t head_dim = 128;  // 8..256, a multiple of 8
  uint32_t group = 1;       // G: query heads per kv head
  float scale = 0.0f;       // 0 = 1/sqrt(head_dim)
  // Ranges per pool thread (1..64): more balance a call over threads that start late or run
  // slow, at a partial state to merge per extra piece of a problem.
  uint32_t tasks_per_thread = 2;
  // Entries ahead of the scan whose K and V rows a task prefetches (0..kMaxPrefetchEntries); the
  // row-scan kernels issue them between their keys. 0 still prefetches each 64-entry chunk's rows while
  // its scores are computed (most of the gain on scattered pages; BENCHMARKS, issue 27). 256
  // beat 128 in each of 8 same-process pairs on the H200 host's 16 cores (random 16-token pages,
  // +3-16%; BENCHMARKS "Dispatch and prefetch of the paged scan").
  static constexpr uint32_t kMaxPrefetchEntries = 4096;
  uint32_t prefetch_entries = 256;
  // Benchmarks: when set, the call records when each of its ranges ran (PagedTaskTimes).
  struct PagedTaskTimes* task_times = nullptr;
};

// One call's ranges on the clock: range i was computed from start_s[i] to end_s[i], seconds
// after the call began (a stream computes its ranges one after another; end_s includes the
// merges its last pieces did); `entries` is what the ranges read (every problem's entries).
struct PagedTaskTimes {
  std::vector<double> start_s, end_s;
  uint64_t entries = 0;
};

// Checks one row of page ids (int32 [pages_per_head]): non-negative ids strictly ascending,
// then -1 padding only. held < 0 skips the bound; else a page whose first entry is >= held is
// an error. INVALID_ARGUMENT naming `what`, the position and the problem.
absl::Status CheckPageRow(std::span<const int32_t> row, int64_t held, uint32_t page_tokens,
                          const char* what);

// Appends to `runs` the runs of the named pages of `shard` (a row that passed CheckPageRow
// against shard.held()), merging pages adjacent in one block; returns the entries they cover.
uint64_t AppendPageRuns(const kv_store::Shard& shard, std::span<const int32_t> row,
                        uint32_t page_tokens, std::vector<KvRun>* runs);
// Appends one run per block covering every held entry of `shard`; returns held().
uint64_t AppendAllRuns(const kv_store::Shard& shard, std::vector<KvRun>* runs);

// Computes O and LSE of every problem. INVALID_ARGUMENT on bad params, a problem whose run
// range is outside `runs` or whose pages do not cover `entries`; RESOURCE_EXHAUSTED if scratch
// memory cannot be had. Thread-safe; uses `pool` for the tasks. The runs' memory (and the
// pages' shards) must not change during the call.
absl::Status PagedAttention(const PagedParams& params, std::span<const KvRun> runs,
                            std::span<const PagedProblem> problems, ThreadPool& pool);

}  // namespace tandem::cpu_attention
