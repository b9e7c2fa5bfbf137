// PlacementReadiness: the worker's gRPC health follows whether hybrid sessions can be placed
// (issue 14): NOT_SERVING while no CPU node accepts shards (every node failed, left or drains),
// SERVING again as soon as one does (NodePool's health watch takes a returning node back).
// A worker with the embedded node always has one.
//
// Lifetime: construct after the health service exists; destroy before it (the destructor
// unregisters from the pool, after which no status is set). Thread-safe.
#pragma once

#include <grpcpp/health_check_service_interface.h>

#include <memory>
#include <string>

#include "tandem/gpu_worker/node_pool.h"

namespace tandem::gpu_worker {

class PlacementReadiness {
 public:
  // Sets "" and `service` on `health` now and on every change; null health: nothing to do.
  static std::unique_ptr<PlacementReadiness> Watch(NodePool& pool,
                                                   grpc::HealthCheckServiceInterface* health,
                                                   std::string service);
  ~PlacementReadiness();
  PlacementReadiness(const PlacementReadiness&) = delete;
  PlacementReadiness& operator=(const PlacementReadiness&) = delete;

 private:
  explicit PlacementReadiness(NodePool& pool) : pool_(pool) {}
  NodePool& pool_;
};

}  // namespace tandem::gpu_worker
