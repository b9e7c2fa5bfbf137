// The SELECTION_PAGES side of the node's Attend (private to cpu_attention; used by
// cpu_attention_node.cc): checking a query's page ids (AttendQuery.pages) under the session's
// lock, and the problems PagedAttention computes: named pages as PageSpans (the pool's tasks
// read the block tables, beside the scan), every held entry (pages_per_head = 0) as runs.
// Not thread-safe: one Attend call owns one PagedPlan.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/cpu_attention/paged_attention.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/kv_store/kv_store.h"

namespace tandem::cpu_attention::internal {

// Most page ids per (token, kv head) of one query (AttendQuery.pages_per_head).
constexpr uint32_t kMaxPagesPerHead = 1u << 20;
// pages_per_head = 0: the query tokens of one problem over every held entry; the rows are read
// once per block of this many tokens (bounds the scratch of one problem: T·G rows of D floats).
constexpr uint32_t kDenseTokenBlock = 32;

// Copies the page ids of a query of `num_tokens` tokens into *dst after checking them against
// the session: INVALID_ARGUMENT naming `what` for pages on a MAW session, pages_per_head above
// kMaxPagesPerHead, a size other than [num_tokens, H_kv, pages_per_head], or a row that is not
// strictly ascending ids followed by -1 padding. The ids are copied before they are checked
// (they may sit in memory another process writes). The held bound is checked by AddQuery.
absl::Status CopyPages(const kv_store::Session& session, uint32_t num_tokens,
                       std::span<const int32_t> pages, uint32_t pages_per_head,
                       std::string_view what, std::vector<int32_t>* dst);

class PagedPlan {
 public:
  // Plans one query of a pages session under its lock (shared): checks every named page of the
  // owned heads of `layer` against the shard's held count (INVALID_ARGUMENT, nothing added) and
  // collects what each (head, token) reads. `pages` passed CopyPages (empty when
  // pages_per_head = 0: every held entry) and must outlive Run. selected[h] (H_own entries)
  // gets the entries attended per token (mean, rounded up). Returns the K + V bytes the scan
  // will read.
  absl::StatusOr<uint64_t> AddQuery(const kv_store::Session& session, uint32_t layer,
                                    std::span<const uint32_t> owned, std::span<const int32_t> pages,
                                    uint32_t pages_per_head, uint32_t num_tokens,
                                    std::span<uint64_t> selected);
  // Adds the problems of the query last given to AddQuery: q [T, H_q, D]; o [T, H_own * G, D] and
  // lse [T, H_own * G], rows ordered as in v1::AttendResult.
  void AddProblems(const kv_store::Session& session, std::span<const uint32_t> owned,
                   const float* q, float* o, float* lse);
  // Computes every problem added (PagedAttention per (dtype, D, G)), each cut into about
  // `tasks_per_thread` tasks per pool thread.
  absl::Status Run(ThreadPool& pool, uint32_t tasks_per_thread, uint32_t prefetch_entries);

 private:
  struct Group {
    PagedParams params;
    std::vector<KvRun> runs;
    std::vector<PagedProblem> problems;
  };
  std::map<std::tuple<kv_store::KvDType, uint32_t, uint32_t>, Group> groups_;
  // The query last given to AddQuery: its group, and what each (head, token) reads or, dense,
  // each head (a problem with its entries set: runs or pages).
  Group* group_ = nullptr;
  std::vector<PagedProblem> sources_;
  uint32_t num_tokens_ = 0;
  bool dense_ = false;
};

}  // namespace tandem::cpu_attention::internal
