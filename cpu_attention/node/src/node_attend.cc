// CpuAttentionNode's Attend (gRPC: a batch of sessions' queries; raw: one session's, from the
// shm channel) and Reselect: the queries are checked and resolved to sessions, then one call
// computes every problem: MAW sessions' selected copies by SparseAttention, grouped by the
// parameters it takes per call; pages sessions' named pages by one PagedPlan.
#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <shared_mutex>
#include <span>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "node_requests.h"
#include "paged_plan.h"
#include "session_owners.h"
#include "tandem/common/status_macros.h"
#include "tandem/cpu_attention/cpu_attention_node.h"
#include "tandem/cpu_attention/salience.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/cpu_attention/tensor_codec.h"
#include "tandem/metrics/node_metrics.h"

namespace tandem::cpu_attention {
namespace {

using internal::CheckBeta;
using internal::CheckLayer;
using internal::CheckOpen;
using internal::CopyQueries;
using internal::DecodeQueries;
using kv_store::KvDType;
using kv_store::Session;
using kv_store::Shard;

AttentionParams ParamsFor(const Session& session, uint32_t num_tokens, const NodeOptions& options) {
  AttentionParams p;
  p.dtype = session.format().dtype;
  p.head_dim = session.geometry().head_dim;
  p.group = session.geometry().group();
  p.num_tokens = num_tokens;
  p.q_token_stride = size_t{session.geometry().num_q_heads} * p.head_dim;
  p.chunk_keys = options.chunk_keys;
  p.tasks_per_thread = options.dense_tasks_per_thread;
  return p;
}

}  // namespace

struct CpuAttentionNode::AttendItem {
  std::shared_ptr<Session> session;
  std::vector<float> q;  // [T, H_q, D]
  uint32_t num_tokens = 0;
  // Pages sessions: [T, H_kv, pages_per_head] page ids; pages_per_head 0 = every held entry.
  std::vector<int32_t> pages;
  uint32_t pages_per_head = 0;
};

absl::Status CpuAttentionNode::Attend(const v1::AttendRequest& request,
                                      v1::AttendResponse* response, const std::string& caller) {
  const int batch = request.queries_size();
  if (batch < 1 || static_cast<uint32_t>(batch) > options_.max_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries: ", batch, " items, expected 1..", options_.max_batch));
  }
  // Resolve and validate every query before computing anything.
  std::vector<AttendItem> items(batch);
  std::set<std::string> seen;
  for (int i = 0; i < batch; ++i) {
    const v1::AttendQuery& query = request.queries(i);
    if (!seen.insert(query.session_id()).second) {
      return absl::InvalidArgumentError(absl::StrCat("queries[", i, "]: session '",
                                                     query.session_id(),
                                                     "' appears more than once"));
    }
    TANDEM_RETURN_IF_ERROR(owners_->Check(query.session_id(), caller));
    TANDEM_ASSIGN_OR_RETURN(items[i].session, store_.Find(query.session_id()));
    TANDEM_RETURN_IF_ERROR(CheckLayer(*items[i].session, request.layer()));
    TANDEM_RETURN_IF_ERROR(DecodeQueries(query.q(), absl::StrCat("queries[", i, "].q"),
                                         *items[i].session, options_.max_query_tokens,
                                         &items[i].q, &items[i].num_tokens));
    TANDEM_RETURN_IF_ERROR(internal::CopyPages(
        *items[i].session, items[i].num_tokens,
        std::span<const int32_t>(query.pages().data(), static_cast<size_t>(query.pages_size())),
        query.pages_per_head(), absl::StrCat("queries[", i, "]"), &items[i].pages));
    items[i].pages_per_head = query.pages_per_head();
  }
  uint64_t compute_micros = 0, bytes_scanned = 0;
  TANDEM_RETURN_IF_ERROR(AttendItems(
      request.layer(), items,
      [response](size_t, const Session& session, uint32_t num_tokens,
                 std::span<const HeadCount> heads) -> absl::StatusOr<AttendTarget> {
        const auto& g = session.geometry();
        const int64_t rows_per_token = static_cast<int64_t>(heads.size()) * g.group();
        v1::AttendResult* result = response->add_results();
        result->set_session_id(session.id());
        for (const HeadCount& h : heads) {
          result->add_kv_heads(h.kv_head);
          result->add_selected(h.selected);
          result->add_held(h.held);
        }
        const int64_t o_shape[] = {num_tokens, rows_per_token, g.head_dim};
        const int64_t lse_shape[] = {num_tokens, rows_per_token};
        return AttendTarget{InitF32(result->mutable_o(), o_shape),
                            InitF32(result->mutable_lse(), lse_shape)};
      },
      &compute_micros, &bytes_scanned));
  response->set_compute_micros(compute_micros);
  response->set_bytes_scanned(bytes_scanned);
  if (options_.metrics != nullptr) options_.metrics->attends_grpc->Increment(batch);
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::AttendRaw(const std::string& session_id, uint32_t layer,
                                         std::span<const float> q, uint32_t num_tokens,
                                         RawAttendOutput* out, std::span<const int32_t> pages,
                                         uint32_t pages_per_head) {
  return AttendRaw(
      session_id, layer, q, num_tokens,
      [out](size_t) -> absl::StatusOr<RawAttendOutput*> { return out; }, pages, pages_per_head);
}

absl::Status CpuAttentionNode::AttendRaw(const std::string& session_id, uint32_t layer,
                                         std::span<const float> q, uint32_t num_tokens,
                                         RawOutputFor output_for, std::span<const int32_t> pages,
                                         uint32_t pages_per_head) {
  std::vector<AttendItem> items(1);
  TANDEM_ASSIGN_OR_RETURN(items[0].session, store_.Find(session_id));
  TANDEM_RETURN_IF_ERROR(CheckLayer(*items[0].session, layer));
  TANDEM_RETURN_IF_ERROR(CopyQueries(q, "q", *items[0].session, num_tokens,
                                     options_.max_query_tokens, &items[0].q));
  items[0].num_tokens = num_tokens;
  TANDEM_RETURN_IF_ERROR(internal::CopyPages(*items[0].session, num_tokens, pages,
                                             pages_per_head, "query", &items[0].pages));
  items[0].pages_per_head = pages_per_head;
  RawAttendOutput* out = nullptr;
  uint64_t compute_micros = 0, bytes_scanned = 0;
  TANDEM_RETURN_IF_ERROR(AttendItems(
      layer, items,
      [&out, output_for](size_t, const Session& session, uint32_t tokens,
                         std::span<const HeadCount> heads) -> absl::StatusOr<AttendTarget> {
        TANDEM_ASSIGN_OR_RETURN(out, output_for(heads.size()));
        const auto& g = session.geometry();
        const size_t rows = size_t{tokens} * heads.size() * g.group();
        if (out == nullptr || out->kv_heads.size() != heads.size() ||
            out->selected.size() != heads.size() || out->held.size() != heads.size() ||
            out->o.size() != rows * g.head_dim || out->lse.size() != rows) {
          return absl::InvalidArgumentError(absl::StrCat(
              "output arrays are not sized for ", heads.size(), " owned kv heads x ", tokens,
              " tokens"));
        }
        for (size_t h = 0; h < heads.size(); ++h) {
          out->kv_heads[h] = heads[h].kv_head;
          out->selected[h] = heads[h].selected;
          out->held[h] = heads[h].held;
        }
        return AttendTarget{out->o.data(), out->lse.data()};
      },
      &compute_micros, &bytes_scanned));
  out->compute_micros = compute_micros;
  out->bytes_scanned = bytes_scanned;
  if (options_.metrics != nullptr) options_.metrics->attends_shm->Increment();
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::AttendItems(uint32_t layer, std::vector<AttendItem>& items,
                                           AttendSink sink, uint64_t* compute_micros,
                                           uint64_t* bytes_scanned_out) {
  attend_calls_.fetch_add(1, std::memory_order_relaxed);
  attend_in_flight_.fetch_add(1, std::memory_order_relaxed);
  struct InFlight {
    std::atomic<uint32_t>* n;
    ~InFlight() { n->fetch_sub(1, std::memory_order_relaxed); }
  } in_flight{&attend_in_flight_};

  // Readers hold each session's lock shared for the whole computation; sorted order (ids are
  // unique, the callers checked) keeps lock acquisition consistent across concurrent calls.
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  {
    std::vector<Session*> order;
    for (AttendItem& item : items) order.push_back(item.session.get());
    std::sort(order.begin(), order.end(),
              [](const Session* a, const Session* b) { return a->id() < b->id(); });
    for (Session* s : order) locks.emplace_back(s->mutex());
  }

  // A session closed between Find and the lock has no shards left.
  for (const AttendItem& item : items) TANDEM_RETURN_IF_ERROR(CheckOpen(*item.session));

  // Problems grouped by the parameters SparseAttention takes for a whole call.
  using ParamKey = std::tuple<KvDType, uint32_t, uint32_t, uint32_t>;  // dtype, D, G, T
  std::map<ParamKey, std::pair<AttentionParams, std::vector<HeadProblem>>> groups;
  internal::PagedPlan paged;   // the pages sessions' problems
  uint64_t bytes_scanned = 0;
  std::vector<HeadCount> counts;
  for (size_t i = 0; i < items.size(); ++i) {
    AttendItem& item = items[i];
    const Session& session = *item.session;
    const auto& g = session.geometry();
    const uint32_t G = g.group();
    const auto owned = session.owned_kv_heads(layer);
    const int64_t rows_per_token = static_cast<int64_t>(owned.size()) * G;
    const bool pages_session = session.options().page_tokens > 0;

    counts.clear();
    for (uint32_t kv_head : owned) {
      const Shard* shard = session.shard(layer, kv_head);
      counts.push_back({kv_head, shard->selected_count(), shard->held()});
    }
    if (pages_session) {
      // Checks the named pages against the held counts and collects their runs; the counters
      // become the entries attended per token.
      std::vector<uint64_t> selected(owned.size());
      TANDEM_ASSIGN_OR_RETURN(const uint64_t bytes,
                              paged.AddQuery(session, layer, owned, item.pages,
                                             item.pages_per_head, item.num_tokens, selected));
      bytes_scanned += bytes;
      for (size_t h = 0; h < owned.size(); ++h) counts[h].selected = selected[h];
    }
    TANDEM_ASSIGN_OR_RETURN(const AttendTarget target,
                            sink(i, session, item.num_tokens, counts));
    // A layer owning no kv head (after ReshardSession) has an empty result: nothing to compute.
    if (owned.empty()) continue;

    if (pages_session) {
      paged.AddProblems(session, owned, item.q.data(), target.o, target.lse);
      continue;
    }

    AttentionParams params = ParamsFor(session, item.num_tokens, options_);
    params.o_token_stride = static_cast<size_t>(rows_per_token) * g.head_dim;
    params.lse_token_stride = static_cast<size_t>(rows_per_token);
    auto& group = groups[{params.dtype, params.head_dim, params.group, params.num_tokens}];
    group.first = params;
    for (size_t h = 0; h < owned.size(); ++h) {
      const Shard* shard = session.shard(layer, owned[h]);
      HeadProblem p;
      p.k = shard->selected_k();
      p.v = shard->selected_v();
      p.n = shard->selected_count();
      p.q = item.q.data() + size_t{owned[h]} * G * g.head_dim;
      p.o = target.o + h * G * g.head_dim;
      p.lse = target.lse + h * G;
      group.second.push_back(p);
      bytes_scanned += 2 * shard->selected_count() * shard->format().row_bytes();
    }
  }

  const auto start = std::chrono::steady_clock::now();
  for (auto& [key, group] : groups) {
    TANDEM_RETURN_IF_ERROR(SparseAttention(group.first, group.second, pool_));
  }
  TANDEM_RETURN_IF_ERROR(paged.Run(pool_, options_.tasks_per_thread, options_.prefetch_entries));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  *compute_micros = static_cast<uint64_t>(seconds * 1e6);
  *bytes_scanned_out = bytes_scanned;
  RecordScan(bytes_scanned, seconds);
  if (options_.metrics != nullptr) {
    options_.metrics->scanned_bytes->Increment(static_cast<double>(bytes_scanned));
  }
  return absl::OkStatus();
}

absl::Status CpuAttentionNode::Reselect(const v1::ReselectRequest& request,
                                        v1::ReselectResponse* response,
                                        const std::string& caller) {
  TANDEM_RETURN_IF_ERROR(owners_->Check(request.session_id(), caller));
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, store_.Find(request.session_id()));
  TANDEM_RETURN_IF_ERROR(CheckLayer(*session, request.layer()));
  if (request.has_beta()) TANDEM_RETURN_IF_ERROR(CheckBeta(request.beta()));
  std::vector<float> q;
  uint32_t num_tokens = 0;
  TANDEM_RETURN_IF_ERROR(DecodeQueries(request.q(), "q", *session, options_.max_query_tokens, &q,
                                       &num_tokens));

  if (!session->options().has_selection_index()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", session->id(), "' uses SELECTION_PAGES: it keeps no salience index to "
        "re-evaluate (each Attend names its pages)"));
  }
  std::unique_lock lock(session->mutex());
  TANDEM_RETURN_IF_ERROR(CheckOpen(*session));
  const float beta = request.has_beta() ? request.beta() : session->beta();
  const auto owned = session->owned_kv_heads(request.layer());
  const auto& g = session->geometry();
  const AttentionParams params = ParamsFor(*session, num_tokens, options_);

  // Score every head in parallel, then apply the selections; nothing changes on failure.
  std::vector<std::vector<uint8_t>> flags(owned.size());
  std::vector<absl::Status> statuses(owned.size());
  pool_.ParallelFor(owned.size(), [&](size_t h) {
    const Shard& shard = *session->shard(request.layer(), owned[h]);
    const uint64_t held = shard.held();
    flags[h].assign(held, 1);
    if (beta == 0 || held == 0) return;  // dense mode selects everything
    std::vector<float> a(held);
    statuses[h] = ComputeSalience(params, shard, q.data() + size_t{owned[h]} * g.group() *
                                                                g.head_dim,
                                  a);
    const float threshold = beta / static_cast<float>(held);
    for (uint64_t i = 0; i < held; ++i) flags[h][i] = a[i] > threshold;
  });
  for (const absl::Status& s : statuses) TANDEM_RETURN_IF_ERROR(s);
  for (size_t h = 0; h < owned.size(); ++h) {
    TANDEM_RETURN_IF_ERROR(session->shard(request.layer(), owned[h])->SetSelection(flags[h]));
  }
  if (request.has_beta()) session->set_beta(beta);
  for (size_t h = 0; h < owned.size(); ++h) {
    const Shard& shard = *session->shard(request.layer(), owned[h]);
    response->add_kv_heads(owned[h]);
    response->add_selected(shard.selected_count());
    response->add_held(shard.held());
  }
  return absl::OkStatus();
}

}  // namespace tandem::cpu_attention
