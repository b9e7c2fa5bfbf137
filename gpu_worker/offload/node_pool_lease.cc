// NodePool's lease upkeep (node_pool.h, "Leases"): renewals on every listed node, in parallel,
// each lease_period_ms / 3, so one slow or dead node delays no other's renewal.
#include <chrono>
#include <latch>
#include <memory>
#include <mutex>
#include <vector>

#include "spdlog/spdlog.h"
#include "tandem/gpu_worker/node_pool.h"

namespace tandem::gpu_worker {

void NodePool::LeaseLoop() {
  const auto every = std::chrono::milliseconds(lease_->period_ms() / 3);
  std::unique_lock<std::mutex> lock(stop_mu_);
  while (!stop_cv_.wait_for(lock, every, [this] { return stop_; })) {
    lock.unlock();
    RenewLeases();
    lock.lock();
  }
}

void NodePool::RenewLeases() {
  // One renewal in flight per listed node; the calls complete on gRPC's threads.
  struct Call {
    size_t node;
    grpc::ClientContext context;
    v1::RenewLeaseRequest request;
    v1::RenewLeaseResponse response;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Call>> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (!nodes_[i]->state.listed) continue;
      calls.push_back(std::make_unique<Call>());
      calls.back()->node = i;
    }
  }
  std::latch done(static_cast<std::ptrdiff_t>(calls.size()));
  for (auto& call : calls) {
    call->context.set_deadline(std::chrono::system_clock::now() +
                               std::chrono::milliseconds(options_.probe_deadline_ms));
    *call->request.mutable_lease() = *lease_;
    Call* c = call.get();
    stub(c->node).async()->RenewLease(&c->context, &c->request, &c->response,
                                      [c, &done](grpc::Status s) {
                                        c->status = std::move(s);
                                        done.count_down();
                                      });
  }
  done.wait();
  for (const auto& c : calls) {
    if (c->status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      spdlog::error("CPU node {}: {}; its sessions of this worker are closed", address(c->node),
                    c->status.error_message());
    } else if (!c->status.ok()) {
      // A node that does not answer is the health watch's business; it renews at the next turn.
      spdlog::debug("CPU node {}: lease renewal failed: {}", address(c->node),
                    c->status.error_message());
    } else if (c->response.lapsed_sessions() > 0) {
      spdlog::warn("CPU node {} closed {} session(s) of this worker: its lease lapsed (no renewal "
                   "for 2 x {} ms)", address(c->node), c->response.lapsed_sessions(),
                   lease_->period_ms());
    } else if (c->response.superseded_sessions() > 0) {
      spdlog::info("CPU node {}: freed {} session(s) a previous process of worker '{}' left",
                   address(c->node), c->response.superseded_sessions(), lease_->holder());
    }
  }
}

}  // namespace tandem::gpu_worker
