#include "tandem/gpu_worker/node_claims.h"

#include <algorithm>

namespace tandem::gpu_worker {

uint64_t NodeClaims::Add() {
  const uint64_t id = next_id_++;
  claims_[id];
  return id;
}

void NodeClaims::Remove(uint64_t id) { claims_.erase(id); }

void NodeClaims::Set(uint64_t id, size_t node, uint64_t projected_bytes, uint64_t charged_bytes) {
  auto it = claims_.find(id);
  if (it == claims_.end()) return;
  std::vector<OnNode>& nodes = it->second;
  if (nodes.size() <= node) nodes.resize(node + 1);
  nodes[node].projected = projected_bytes;
  nodes[node].charged = charged_bytes;
}

void NodeClaims::AskingStats(size_t node) {
  for (auto& [id, nodes] : claims_) {
    if (node < nodes.size()) nodes[node].asking = nodes[node].charged;
  }
}

void NodeClaims::SawStats(size_t node) {
  for (auto& [id, nodes] : claims_) {
    if (node < nodes.size()) nodes[node].seen = nodes[node].asking;
  }
}

void NodeClaims::Forget(size_t node) {
  for (auto& [id, nodes] : claims_) {
    if (node < nodes.size()) nodes[node].seen = nodes[node].asking = 0;
  }
}

uint64_t NodeClaims::Pending(size_t node, uint64_t except) const {
  uint64_t pending = 0;
  for (const auto& [id, nodes] : claims_) {
    if (id == except || node >= nodes.size()) continue;
    const OnNode& on = nodes[node];
    const uint64_t total = std::max(on.projected, on.charged);
    pending += total > on.seen ? total - on.seen : 0;
  }
  return pending;
}

}  // namespace tandem::gpu_worker
