#include "tandem/gpu_worker/placement_readiness.h"

#include "spdlog/spdlog.h"

namespace tandem::gpu_worker {

std::unique_ptr<PlacementReadiness> PlacementReadiness::Watch(
    NodePool& pool, grpc::HealthCheckServiceInterface* health, std::string service) {
  if (health == nullptr) return nullptr;
  auto readiness = std::unique_ptr<PlacementReadiness>(new PlacementReadiness(pool));
  pool.WatchAccepting([health, service = std::move(service)](bool any_accepting) {
    health->SetServingStatus(any_accepting);
    health->SetServingStatus(service, any_accepting);
    if (any_accepting) {
      spdlog::info("readiness: SERVING (a CPU node accepts hybrid sessions)");
    } else {
      spdlog::warn("readiness: NOT_SERVING (no CPU node accepts hybrid sessions)");
    }
  });
  return readiness;
}

PlacementReadiness::~PlacementReadiness() { pool_.UnwatchAccepting(); }

}  // namespace tandem::gpu_worker
