#include "paged_plan.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::cpu_attention::internal {

absl::Status CopyPages(const kv_store::Session& session, uint32_t num_tokens,
                       std::span<const int32_t> pages, uint32_t pages_per_head,
                       std::string_view what_view, std::vector<int32_t>* dst) {
  // Debian's absl has its own string_view: StrCat takes std::string.
  const std::string what(what_view);
  dst->clear();
  const uint32_t page_tokens = session.options().page_tokens;
  if (page_tokens == 0) {
    if (pages_per_head != 0 || !pages.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": pages given (pages_per_head ", pages_per_head, ", ", pages.size(),
                       " ids) for session '", session.id(),
                       "', which uses MAW selection (open it with SELECTION_PAGES to name pages)"));
    }
    return absl::OkStatus();
  }
  if (pages_per_head > kMaxPagesPerHead) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": pages_per_head ", pages_per_head, " exceeds ", kMaxPagesPerHead));
  }
  const uint32_t num_kv_heads = session.geometry().num_kv_heads;
  const uint64_t rows = uint64_t{num_tokens} * num_kv_heads;
  const uint64_t expected = rows * pages_per_head;
  if (pages.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ".pages: ", pages.size(), " ids, expected [num_tokens, num_kv_heads, ",
                     "pages_per_head] = [", num_tokens, ", ", num_kv_heads, ", ", pages_per_head,
                     "] = ", expected));
  }
  dst->assign(pages.begin(), pages.end());
  for (uint64_t row = 0; pages_per_head > 0 && row < rows; ++row) {
    const std::span<const int32_t> ids(dst->data() + row * pages_per_head, pages_per_head);
    if (absl::Status s = CheckPageRow(ids, /*held=*/-1, page_tokens, "pages"); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " token ", row / num_kv_heads, " kv head ", row % num_kv_heads, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> PagedPlan::AddQuery(const kv_store::Session& session, uint32_t layer,
                                             std::span<const uint32_t> owned,
                                             std::span<const int32_t> pages,
                                             uint32_t pages_per_head, uint32_t num_tokens,
                                             std::span<uint64_t> selected) {
  const auto& g = session.geometry();
  const uint32_t page_tokens = session.options().page_tokens;
  // A row's ids without the -1 padding (CopyPages checked: ascending ids, then padding).
  auto ids_of = [&](uint32_t t, uint32_t kv_head) {
    std::span<const int32_t> row =
        pages.subspan((size_t{t} * g.num_kv_heads + kv_head) * pages_per_head, pages_per_head);
    size_t n = row.size();
    while (n > 0 && row[n - 1] < 0) --n;
    return row.first(n);
  };
  // Bound every named page by its shard's held count before anything is planned: the rows are
  // ascending, so their last ids.
  for (size_t h = 0; h < owned.size() && pages_per_head > 0; ++h) {
    const uint64_t held = session.shard(layer, owned[h])->held();
    for (uint32_t t = 0; t < num_tokens; ++t) {
      const std::span<const int32_t> ids = ids_of(t, owned[h]);
      if (ids.empty() || static_cast<uint64_t>(ids.back()) * page_tokens < held) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          "session '", session.id(), "' layer ", layer, " token ", t, " kv head ", owned[h],
          ": pages[", ids.size() - 1, "]: page ", ids.back(), " starts at entry ",
          static_cast<uint64_t>(ids.back()) * page_tokens, " but the shard holds ", held,
          " entries (", page_tokens, " per page)"));
    }
  }
  group_ = &groups_[{session.format().dtype, g.head_dim, g.group()}];
  group_->params.dtype = session.format().dtype;
  group_->params.head_dim = g.head_dim;
  group_->params.group = g.group();
  sources_.clear();
  num_tokens_ = num_tokens;
  dense_ = pages_per_head == 0;
  const size_t row_bytes = session.format().row_bytes();
  const uint64_t token_blocks = (num_tokens + kDenseTokenBlock - 1) / kDenseTokenBlock;
  uint64_t bytes = 0;
  for (size_t h = 0; h < owned.size(); ++h) {
    const kv_store::Shard& shard = *session.shard(layer, owned[h]);
    PagedProblem source;
    if (dense_) {
      source.run_begin = group_->runs.size();
      const uint64_t held = AppendAllRuns(shard, &group_->runs);
      source.run_end = group_->runs.size();
      sources_.push_back(source);
      bytes += token_blocks * 2 * held * row_bytes;  // read once per block of tokens
      selected[h] = held;
      continue;
    }
    uint64_t attended = 0;
    for (uint32_t t = 0; t < num_tokens; ++t) {
      const std::span<const int32_t> ids = ids_of(t, owned[h]);
      source.pages =
          PageSpan{&shard, ids, page_tokens, PageEntries(ids, page_tokens, shard.held())};
      sources_.push_back(source);
      attended += source.pages.entries;
    }
    bytes += 2 * attended * row_bytes;
    selected[h] = (attended + num_tokens - 1) / num_tokens;
  }
  return bytes;
}

void PagedPlan::AddProblems(const kv_store::Session& session, std::span<const uint32_t> owned,
                            const float* q, float* o, float* lse) {
  const auto& g = session.geometry();
  const size_t G = g.group(), D = g.head_dim;
  const size_t q_stride = size_t{g.num_q_heads} * D;
  const size_t lse_stride = owned.size() * G;
  const size_t o_stride = lse_stride * D;
  for (size_t h = 0; h < owned.size(); ++h) {
    // Dense: one problem per block of tokens over the head's runs; else one per token.
    const uint32_t step = dense_ ? kDenseTokenBlock : 1;
    for (uint32_t t = 0; t < num_tokens_; t += step) {
      PagedProblem p = sources_[dense_ ? h : h * num_tokens_ + t];
      p.num_tokens = std::min(step, num_tokens_ - t);
      p.q = q + t * q_stride + size_t{owned[h]} * G * D;
      p.o = o + t * o_stride + h * G * D;
      p.lse = lse + t * lse_stride + h * G;
      p.q_token_stride = q_stride;
      p.o_token_stride = o_stride;
      p.lse_token_stride = lse_stride;
      group_->problems.push_back(p);
    }
  }
}

absl::Status PagedPlan::Run(ThreadPool& pool, uint32_t tasks_per_thread,
                            uint32_t prefetch_entries) {
  for (auto& [key, group] : groups_) {
    group.params.tasks_per_thread = tasks_per_thread;
    group.params.prefetch_entries = prefetch_entries;
    TANDEM_RETURN_IF_ERROR(PagedAttention(group.params, group.runs, group.problems, pool));
  }
  return absl::OkStatus();
}

}  // namespace tandem::cpu_attention::internal
