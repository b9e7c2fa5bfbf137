// MetricsServer: GET /metrics over HTTP (prometheus-cpp's Exposer, civetweb) for one registry:
// the text exposition format, plus the exposer's own exposer_* families (scrapes, bytes,
// scrape latency). RAII: serving starts in Start() and stops in the destructor.
//
// Thread-safe: the server's threads collect the registry while the process updates it.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace tandem::metrics {

class MetricsServer {
 public:
  // Serves `registry` at http://`address`/metrics. `address` is host:port (port 0 picks a free
  // one; port() tells which). `before_scrape`, when set, runs on a server thread before each
  // collection: it sets gauges that are cheaper to read on demand than to keep current (pool
  // bytes, sessions open); it must be thread-safe and must not block for long.
  // INVALID_ARGUMENT for an address that is not host:port; UNAVAILABLE when it cannot be bound
  // (in use, or not an address of this host).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry,
      std::function<void()> before_scrape = {});
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsServer() = default;

  // The collectable that runs before_scrape, then collects the registry (the exposer holds it
  // by weak_ptr; destroyed after the exposer stops).
  std::shared_ptr<prometheus::Collectable> source_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace tandem::metrics
