// NodePool's membership upkeep between discovery refreshes (node_pool.h, "Membership"): failures
// reported by sessions, the health watch that takes a node back once it answers, sessions left
// behind on failed nodes, and the accepting watcher behind the worker's readiness.
#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/gpu_worker/node_pool.h"

namespace tandem::gpu_worker {

void NodePool::ReportFailure(size_t i, const absl::Status& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (i >= nodes_.size()) return;
    NodeState& st = nodes_[i]->state;
    // Not `refused`: only the pool's own Stats call says that (a session's made-up status for a
    // suspect node, or a draining node's UNAVAILABLE, must not lose the node for everyone).
    if (!st.reachable) return;
    st.reachable = false;
    // Answers to Stats calls sent before this failure would put it back: dropped (AskStats).
    nodes_[i]->stats_applied = nodes_[i]->stats_asked;
    generation_.fetch_add(1, std::memory_order_acq_rel);
    spdlog::warn("CPU node {} failed a call ({}): out of placement until it answers again",
                 st.address, std::string(why.message()));
  }
  NotifyAccepting();
}

void NodePool::DeferClose(size_t i, const std::string& session_id, const std::string& node_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (i >= nodes_.size() || node_id.empty()) return;
  pending_closes_.push_back({i, session_id, node_id});
}

size_t NodePool::deferred_closes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_closes_.size();
}

void NodePool::WatchAccepting(std::function<void(bool)> on_change) {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    on_accepting_ = std::move(on_change);
    last_accepting_ = -1;
  }
  NotifyAccepting();
}

void NodePool::UnwatchAccepting() {
  std::lock_guard<std::mutex> lock(watch_mu_);
  on_accepting_ = nullptr;
}

void NodePool::NotifyAccepting() {
  // Counted under watch_mu_ (then mu_; never the other way): a count taken before another
  // thread's newer one must not be applied after it (readiness stuck at the older value).
  std::lock_guard<std::mutex> lock(watch_mu_);
  const bool any = accepting_count() > 0;
  if (!on_accepting_ || last_accepting_ == static_cast<int>(any)) return;
  last_accepting_ = static_cast<int>(any);
  on_accepting_(any);
}

void NodePool::ProbeLoop() {
  std::unique_lock<std::mutex> lock(stop_mu_);
  while (!stop_cv_.wait_for(lock, std::chrono::milliseconds(options_.probe_ms),
                            [this] { return stop_; })) {
    lock.unlock();
    ProbeOnce();
    lock.lock();
  }
}

void NodePool::ProbeOnce() {
  // Which nodes to ask: listed ones out of placement, reachable ones with sessions to close,
  // and reachable ones whose connection is not up (a node that died while nobody called it:
  // its channel left READY when the connection closed).
  std::vector<size_t> probe;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const NodeState& st = nodes_[i]->state;
      const bool closes = std::any_of(pending_closes_.begin(), pending_closes_.end(),
                                      [i](const PendingClose& c) { return c.node == i; });
      const bool connected =
          embedded_ != nullptr ||
          nodes_[i]->channel->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY;
      if (st.listed && (!st.reachable || closes || !connected)) probe.push_back(i);
    }
  }
  if (probe.empty()) return;
  bool changed = false;
  for (size_t i : probe) {
    v1::StatsResponse stats;
    grpc::Status s;
    changed |= AskStats(i, options_.probe_deadline_ms, &stats, &s);
    if (!s.ok()) continue;
    std::vector<PendingClose> closes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Sessions of a process that is gone are gone with it; those of the same process close.
      auto it = std::stable_partition(pending_closes_.begin(), pending_closes_.end(),
                                      [i](const PendingClose& c) { return c.node != i; });
      for (auto c = it; c != pending_closes_.end(); ++c) {
        if (c->node_id == stats.node_id()) closes.push_back(*c);
      }
      pending_closes_.erase(it, pending_closes_.end());
    }
    for (const PendingClose& c : closes) {
      grpc::ClientContext close_ctx;
      close_ctx.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::milliseconds(options_.probe_deadline_ms));
      v1::CloseSessionRequest close;
      close.set_session_id(c.session_id);
      v1::CloseSessionResponse closed;
      const grpc::Status cs = stub(i).CloseSession(&close_ctx, close, &closed);
      if (cs.ok() || cs.error_code() == grpc::StatusCode::NOT_FOUND) {
        spdlog::info("CPU node {}: closed session {} left behind when it failed", address(i),
                     c.session_id);
      } else {
        std::lock_guard<std::mutex> lock(mu_);
        pending_closes_.push_back(c);  // retried at the next probe
      }
    }
  }
  if (changed) NotifyAccepting();
}

}  // namespace tandem::gpu_worker
