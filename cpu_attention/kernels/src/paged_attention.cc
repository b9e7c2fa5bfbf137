#include "tandem/cpu_attention/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "aligned_buffer.h"
#include "paged_piece.h"
#include "range_count.h"
#include "row_scan_kernels.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_isa/cpu_isa.h"
#include "tandem/cpu_attention/merge_state.h"

namespace tandem::cpu_attention {
namespace {

using internal::AlignedBuffer;
using internal::NextPiece;
using internal::PieceArgs;
using internal::PieceKernel;
using internal::PieceKernelFor;
using internal::RowsOut;
using internal::RunCursor;
using internal::WorkFloats;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A range covers at least this many entries (fewer, larger tasks for tiny problems).
constexpr uint64_t kMinRangeEntries = 256;

// Entries [begin, end) of problem `problem` (in the concatenation of its runs). slot < 0: the
// problem's first piece, which writes the problem's output rows; else partial state `slot`,
// merged into them once every piece of the problem is done.
struct Piece {
  size_t problem;
  uint64_t begin, end;
  int64_t slot;
};

// One call's work: the entries of all problems, end to end, cut into ranges of about equal cost
// (HGCA §3.3 head-merged tasks); range r is pieces [range_first[r], range_first[r + 1]). A
// problem's pieces are consecutive: piece_count[p] of them from first_piece[p].
struct RangePlan {
  std::vector<Piece> pieces;
  std::vector<size_t> range_first;    // [ranges + 1]
  std::vector<size_t> first_piece;    // [problems]
  std::vector<uint32_t> piece_count;  // [problems]
  int64_t num_slots = 0;

  size_t ranges() const { return range_first.size() - 1; }
};

// Cuts the cost `total` = Σ entries[p] · weight[p] into `num_ranges` (>= 1) equal ranges.
RangePlan PlanRanges(const std::vector<uint64_t>& entries, const std::vector<uint64_t>& weight,
                     uint64_t total, uint64_t num_ranges) {
  RangePlan plan;
  plan.range_first.resize(num_ranges + 1);
  plan.first_piece.assign(entries.size(), 0);
  plan.piece_count.assign(entries.size(), 0);
  size_t p = 0;
  uint64_t off = 0, pos = 0;  // entry offset in problem p; cost done so far
  for (uint64_t r = 0; r < num_ranges; ++r) {
    plan.range_first[r] = plan.pieces.size();
    const uint64_t range_end = r + 1 == num_ranges ? total : (r + 1) * total / num_ranges;
    while (pos < range_end) {
      while (entries[p] == 0) ++p;
      const uint64_t want = (range_end - pos + weight[p] - 1) / weight[p];
      const uint64_t take = std::min(entries[p] - off, std::max<uint64_t>(1, want));
      if (plan.piece_count[p]++ == 0) plan.first_piece[p] = plan.pieces.size();
      plan.pieces.push_back(Piece{p, off, off + take, off == 0 ? -1 : plan.num_slots++});
      pos += take * weight[p];
      off += take;
      if (off == entries[p]) {
        ++p;
        off = 0;
      }
    }
  }
  plan.range_first[num_ranges] = plan.pieces.size();
  return plan;
}

absl::Status Validate(const PagedParams& p, std::span<const KvRun> runs,
                      std::span<const PagedProblem> problems) {
  if (p.head_dim < 8 || p.head_dim > 256 || p.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: head_dim ", p.head_dim, " not in 8..256 step 8"));
  }
  if (p.dtype != kv_store::KvDType::kBf16 && p.dtype != kv_store::KvDType::kF32 &&
      p.dtype != kv_store::KvDType::kInt8) {
    return absl::InvalidArgumentError("paged attention: dtype must be bf16, f32 or int8");
  }
  if (p.group < 1 || p.tasks_per_thread < 1 || p.tasks_per_thread > 64) {
    return absl::InvalidArgumentError(
        "paged attention: group must be >= 1 and tasks_per_thread in 1..64");
  }
  if (p.prefetch_entries > PagedParams::kMaxPrefetchEntries) {
    return absl::InvalidArgumentError(absl::StrCat("paged attention: prefetch_entries ",
                                                   p.prefetch_entries, " > ",
                                                   PagedParams::kMaxPrefetchEntries));
  }
  if (!std::isfinite(p.scale) || p.scale < 0) {
    return absl::InvalidArgumentError("paged attention: scale must be finite and >= 0");
  }
  for (size_t i = 0; i < problems.size(); ++i) {
    const PagedProblem& pr = problems[i];
    if (const PageSpan& ps = pr.pages; ps.shard != nullptr) {
      // Every page full but the last, which holds at least one entry.
      const uint64_t pages = ps.ids.size();
      if (ps.page_tokens < 1 || ps.entries > pages * ps.page_tokens ||
          (pages > 0 && ps.entries <= (pages - 1) * ps.page_tokens)) {
        return absl::InvalidArgumentError(absl::StrCat("paged attention: problem ", i, " names ",
                                                       pages, " pages of ", ps.page_tokens,
                                                       " entries covering ", ps.entries));
      }
    }
    if (pr.run_begin > pr.run_end || pr.run_end > runs.size() || pr.num_tokens < 1 ||
        pr.q == nullptr || pr.o == nullptr || pr.lse == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "paged attention: problem ", i, " has runs [", pr.run_begin, ", ", pr.run_end, ") of ",
          runs.size(), ", ", pr.num_tokens, " tokens, or a null pointer"));
    }
  }
  return absl::OkStatus();
}

// Runs one call's ranges on a pool. Each pool task is a stream that claims ranges in order (one
// atomic counter) until none is left: a thread that woke late or runs slow (a core it shares
// with the GPU worker's host thread, say) takes fewer ranges instead of holding up the call; with
// one fixed range per thread the call waited for its slowest thread, ~1.4x the mean task
// (BENCHMARKS "Dispatch and prefetch of the paged scan"). A stream claims its next range when its
// prefetches reach the end of the current one (PieceArgs::next), so their stream runs on into
// the next range's rows and only a stream's first range starts cold, while a stream holds at
// most one prefetch distance of work beyond the piece it computes. (Claiming the next range at
// the start of the current one, as 9b5353d did, let the streams take every range of a call
// with two ranges per thread within its first microseconds: a static split again.) The last
// piece of a problem to finish merges the problem's partial states into its output in entry
// order, so the results do not depend on which thread ran what. The thread_local buffers of
// RunStream are safe because no task of a call runs pool calls of its own.
class RangeRunner {
 public:
  RangeRunner(const PagedParams& params, std::span<const KvRun> runs,
              std::span<const PagedProblem> problems, const RangePlan& plan, float scale,
              size_t max_rows)
      : params_(params),
        runs_(runs),
        problems_(problems),
        plan_(plan),
        scale_(scale),
        slot_floats_(max_rows * params.head_dim + max_rows),
        partials_(static_cast<size_t>(plan.num_slots) * slot_floats_),
        pieces_left_(new std::atomic<uint32_t>[problems.size()]),
        row_kernels_(params.dtype == kv_store::KvDType::kInt8   ? internal::GetInt8ScanKernels()
                     : params.dtype == kv_store::KvDType::kBf16 ? internal::GetBf16ScanKernels()
                                                                : nullptr),
        compute_piece_(PieceKernelFor(params.dtype, ActiveCpuIsa())) {
    for (size_t p = 0; p < problems.size(); ++p) {
      pieces_left_[p].store(plan.piece_count[p], std::memory_order_relaxed);
    }
  }

  absl::Status Run(ThreadPool& pool) {
    const size_t streams = std::min<size_t>(pool.num_threads(), plan_.ranges());
    statuses_.assign(streams, absl::OkStatus());
    if (PagedTaskTimes* times = params_.task_times; times != nullptr) {
      times->start_s.assign(plan_.ranges(), 0.0);
      times->end_s.assign(plan_.ranges(), 0.0);
    }
    call_start_ = std::chrono::steady_clock::now();
    pool.ParallelFor(streams, [this](size_t stream) { RunStream(stream); });
    for (const absl::Status& s : statuses_) TANDEM_RETURN_IF_ERROR(s);
    return absl::OkStatus();
  }

 private:
  // A claimed range made ready to run: its pieces' arguments, page runs resolved.
  struct Ready {
    size_t range = 0;
    std::vector<KvRun> page_runs;   // the page problems' pieces' runs, end to end
    std::vector<size_t> first_run;  // per piece: its first in page_runs, or kNoPageRuns
    std::vector<PieceArgs> args;    // per piece; `work` and the prefetch chaining set at run
  };
  static constexpr size_t kNoPageRuns = ~size_t{0};

  double SecondsSinceStart() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - call_start_).count();
  }

  void Resolve(size_t range, Ready& out) {
    const size_t D = params_.head_dim, G = params_.group;
    out.range = range;
    out.page_runs.clear();
    out.first_run.clear();
    out.args.clear();
    for (size_t i = plan_.range_first[range]; i < plan_.range_first[range + 1]; ++i) {
      const Piece& piece = plan_.pieces[i];
      const PagedProblem& pr = problems_[piece.problem];
      PieceArgs a;
      a.prefetch_entries = params_.prefetch_entries;
      if (const PageSpan& ps = pr.pages; ps.shard != nullptr) {
        // The pages holding entries [begin, end): every page but the last is full.
        const uint64_t first = piece.begin / ps.page_tokens;
        const uint64_t last = (piece.end + ps.page_tokens - 1) / ps.page_tokens;
        out.first_run.push_back(out.page_runs.size());
        AppendPageRuns(*ps.shard, ps.ids.subspan(first, last - first), ps.page_tokens,
                       &out.page_runs);
        a.skip = piece.begin - first * ps.page_tokens;
      } else {
        out.first_run.push_back(kNoPageRuns);
        a.runs = runs_.data() + pr.run_begin;
        a.skip = piece.begin;
      }
      a.count = piece.end - piece.begin;
      a.q = pr.q;
      a.q_stride = pr.q_token_stride;
      a.T = pr.num_tokens;
      a.G = static_cast<uint32_t>(G);
      a.D = static_cast<uint32_t>(D);
      a.scale = scale_;
      if (piece.slot < 0) {
        a.out = RowsOut{pr.o, pr.o_token_stride, pr.lse, pr.lse_token_stride};
      } else {
        float* base = partials_.data() + piece.slot * slot_floats_;
        a.out = RowsOut{base, G * D, base + size_t{pr.num_tokens} * G * D, G};
      }
      a.row_kernels = row_kernels_;
      out.args.push_back(a);
    }
    // page_runs is complete: point the pieces into it and at the run holding entry `skip`.
    for (size_t j = 0; j < out.args.size(); ++j) {
      PieceArgs& a = out.args[j];
      if (out.first_run[j] != kNoPageRuns) a.runs = out.page_runs.data() + out.first_run[j];
      while (a.skip >= a.runs->n) a.skip -= (a.runs++)->n;
    }
  }

  // One stream's position: the range it computes, and the next one once claimed.
  struct Stream {
    RangeRunner* runner;
    Ready* cur;
    Ready* next;
    size_t piece = 0;      // of cur->args, being computed
    bool claimed = false;  // `next` was claimed (next_valid: and holds a range)
    bool next_valid = false;
  };

  // Claims the next range into `out` (false: none left).
  bool Claim(Ready& out) {
    const size_t r = next_range_.fetch_add(1, std::memory_order_relaxed);
    if (r >= plan_.ranges()) return false;
    Resolve(r, out);
    return true;
  }

  static RunCursor CursorOf(const PieceArgs& a) { return RunCursor{a.runs, a.skip, a.count}; }

  // NextPiece::fn: the piece after the one being computed; at a range's last piece this claims
  // the stream's next range, a prefetch distance before the range ends.
  static RunCursor NextPieceOf(void* ctx) {
    Stream& st = *static_cast<Stream*>(ctx);
    if (st.piece + 1 < st.cur->args.size()) return CursorOf(st.cur->args[st.piece + 1]);
    if (!st.claimed) {
      st.claimed = true;
      st.next_valid = st.runner->Claim(*st.next);
    }
    return st.next_valid && !st.next->args.empty() ? CursorOf(st.next->args[0]) : RunCursor{};
  }

  void RunStream(size_t stream) {
    thread_local Ready ready[2];
    thread_local AlignedBuffer work_buffer;
    PagedTaskTimes* const times = params_.task_times;
    const bool int8 = params_.dtype == kv_store::KvDType::kInt8;
    try {
      Stream st{this, &ready[0], &ready[1]};
      if (!Claim(*st.cur)) return;
      uint64_t prefetched = 0;  // entries at the next piece's start already prefetched
      while (true) {
        if (times != nullptr) times->start_s[st.cur->range] = SecondsSinceStart();
        for (st.piece = 0; st.piece < st.cur->args.size(); ++st.piece) {
          PieceArgs& a = st.cur->args[st.piece];
          a.prefetched = prefetched;
          a.next = NextPiece{&NextPieceOf, &st};
          a.next_prefetched = &prefetched;
          a.work = work_buffer.Get<float>(WorkFloats(size_t{a.T} * a.G, a.D, int8));
          compute_piece_(a);
          FinishPiece(plan_.pieces[plan_.range_first[st.cur->range] + st.piece]);
        }
        if (times != nullptr) times->end_s[st.cur->range] = SecondsSinceStart();
        if (!st.claimed) {  // an empty range, or prefetches that never reached past it
          st.next_valid = Claim(*st.next);
          prefetched = 0;
        }
        if (!st.next_valid) break;
        std::swap(st.cur, st.next);
        st.claimed = st.next_valid = false;
      }
    } catch (const std::bad_alloc&) {
      statuses_[stream] =
          absl::ResourceExhaustedError("paged attention: scratch allocation failed");
    } catch (const std::exception& e) {
      statuses_[stream] = absl::InternalError(absl::StrFormat("paged attention: %s", e.what()));
    }
  }

  // Called once per piece when it is done; the problem's last merges its partial states.
  void FinishPiece(const Piece& piece) {
    const size_t p = piece.problem;
    if (plan_.piece_count[p] == 1) return;  // its only piece wrote the output
    // acq_rel: the merging thread sees the other pieces' partial states.
    if (pieces_left_[p].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    const PagedProblem& pr = problems_[p];
    const size_t D = params_.head_dim, G = params_.group;
    const size_t rows = size_t{pr.num_tokens} * G;
    for (size_t i = plan_.first_piece[p] + 1; i < plan_.first_piece[p] + plan_.piece_count[p];
         ++i) {
      const float* src_o = partials_.data() + plan_.pieces[i].slot * slot_floats_;
      const float* src_lse = src_o + rows * D;
      for (size_t t = 0; t < pr.num_tokens; ++t) {
        for (size_t j = 0; j < G; ++j) {
          MergeStateInPlace(pr.o + t * pr.o_token_stride + j * D,
                            pr.lse + t * pr.lse_token_stride + j, src_o + (t * G + j) * D,
                            src_lse[t * G + j], D);
        }
      }
    }
  }

  const PagedParams& params_;
  const std::span<const KvRun> runs_;
  const std::span<const PagedProblem> problems_;
  const RangePlan& plan_;
  const float scale_;
  const size_t slot_floats_;     // one partial state: [rows, D] o, [rows] lse
  std::vector<float> partials_;  // [num_slots, slot_floats_]
  std::unique_ptr<std::atomic<uint32_t>[]> pieces_left_;  // per problem: pieces not yet done
  const internal::RowScanKernels* const row_kernels_;
  const PieceKernel compute_piece_;
  std::atomic<size_t> next_range_{0};   // the first range not yet claimed
  std::vector<absl::Status> statuses_;  // per stream
  std::chrono::steady_clock::time_point call_start_;
};

absl::Status PagedAttentionImpl(const PagedParams& params, std::span<const KvRun> runs,
                                std::span<const PagedProblem> problems, ThreadPool& pool) {
  const size_t D = params.head_dim, G = params.group;
  const float scale = params.scale > 0 ? params.scale : 1.0f / std::sqrt(static_cast<float>(D));

  // Entries and cost per problem; cost ~ memory (K + V rows) plus compute (R dot products and
  // R axpys per entry), in units of one entry with 4 query rows.
  std::vector<uint64_t> entries(problems.size(), 0);
  std::vector<uint64_t> weight(problems.size(), 0);
  uint64_t total = 0;
  size_t max_rows = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    const PagedProblem& pr = problems[i];
    if (pr.pages.shard != nullptr) {
      entries[i] = pr.pages.entries;
    } else {
      for (size_t r = pr.run_begin; r < pr.run_end; ++r) entries[i] += runs[r].n;
    }
    const size_t rows = size_t{pr.num_tokens} * G;
    weight[i] = rows + 4;
    total += entries[i] * weight[i];
    if (entries[i] > 0) max_rows = std::max(max_rows, rows);
    if (entries[i] != 0) continue;
    for (size_t t = 0; t < pr.num_tokens; ++t) {
      std::fill_n(pr.o + t * pr.o_token_stride, G * D, 0.0f);
      std::fill_n(pr.lse + t * pr.lse_token_stride, G, kNegInf);
    }
  }
  if (total == 0) return absl::OkStatus();

  uint64_t all_entries = 0;
  for (uint64_t e : entries) all_entries += e;
  if (params.task_times != nullptr) params.task_times->entries = all_entries;
  const uint64_t num_ranges = RangeCount(
      all_entries, kMinRangeEntries, uint64_t{params.tasks_per_thread} * pool.num_threads(),
      2 * kv_store::BlockFormat{16, params.head_dim, params.dtype}.row_bytes(),
      uint64_t{max_rows} * (D + 1) * 4);
  const RangePlan plan = PlanRanges(entries, weight, total, num_ranges);
  RangeRunner runner(params, runs, problems, plan, scale, max_rows);
  return runner.Run(pool);
}

}  // namespace

absl::Status CheckPageRow(std::span<const int32_t> row, int64_t held, uint32_t page_tokens,
                          const char* what) {
  bool padding = false;
  int64_t prev = -1;
  for (size_t i = 0; i < row.size(); ++i) {
    const int32_t id = row[i];
    if (id == -1) {
      padding = true;
      continue;
    }
    if (id < -1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i, "]: page id ", id, " is negative (only -1 pads)"));
    }
    if (padding) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i, "]: page id ", id, " follows -1 padding"));
    }
    if (id <= prev) {
      return absl::InvalidArgumentError(absl::StrCat(what, "[", i, "]: page id ", id,
                                                     " is not above the previous id ", prev,
                                                     " (ids must be strictly ascending)"));
    }
    if (held >= 0 && static_cast<int64_t>(id) * page_tokens >= held) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "[", i, "]: page ", id, " starts at entry ", static_cast<int64_t>(id) * page_tokens,
          " but the shard holds ", held, " entries (", page_tokens, " per page)"));
    }
    prev = id;
  }
  return absl::OkStatus();
}

uint64_t AppendPageRuns(const kv_store::Shard& shard, std::span<const int32_t> row,
                        uint32_t page_tokens, std::vector<KvRun>* runs) {
  const uint64_t held = shard.held();
  const uint64_t bt = shard.format().block_tokens;
  const size_t row_bytes = shard.format().row_bytes();
  uint64_t covered = 0;
  size_t i = 0;
  while (i < row.size() && row[i] >= 0) {
    // Merge consecutive page ids into one entry range [first, end).
    const uint64_t first = static_cast<uint64_t>(row[i]) * page_tokens;
    int64_t last_id = row[i++];
    while (i < row.size() && row[i] == last_id + 1) last_id = row[i++];
    const uint64_t end =
        std::min<uint64_t>(held, (static_cast<uint64_t>(last_id) + 1) * page_tokens);
    // Split the range at block boundaries.
    for (uint64_t e = first; e < end;) {
      const uint64_t block = e / bt, in_block = e % bt;
      const uint64_t n = std::min(end - e, bt - in_block);
      runs->push_back(KvRun{shard.block_k(block) + in_block * row_bytes,
                            shard.block_v(block) + in_block * row_bytes, static_cast<uint32_t>(n)});
      e += n;
    }
    covered += end - first;
  }
  return covered;
}

uint64_t PageEntries(std::span<const int32_t> ids, uint32_t page_tokens, uint64_t held) {
  if (ids.empty()) return 0;
  const uint64_t last_end =
      std::min<uint64_t>(held, (static_cast<uint64_t>(ids.back()) + 1) * page_tokens);
  const uint64_t last_first = static_cast<uint64_t>(ids.back()) * page_tokens;
  return (ids.size() - 1) * uint64_t{page_tokens} + (last_end - last_first);
}

uint64_t AppendAllRuns(const kv_store::Shard& shard, std::vector<KvRun>* runs) {
  for (size_t b = 0; b < shard.blocks().size(); ++b) {
    const uint32_t n = shard.block_entries(b);
    if (n > 0) runs->push_back(KvRun{shard.block_k(b), shard.block_v(b), n});
  }
  return shard.held();
}

absl::Status PagedAttention(const PagedParams& params, std::span<const KvRun> runs,
                            std::span<const PagedProblem> problems, ThreadPool& pool) {
  TANDEM_RETURN_IF_ERROR(Validate(params, runs, problems));
  try {
    return PagedAttentionImpl(params, runs, problems, pool);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("paged attention: out of memory for the task plan");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrFormat("paged attention: %s", e.what()));
  }
}

}  // namespace tandem::cpu_attention
