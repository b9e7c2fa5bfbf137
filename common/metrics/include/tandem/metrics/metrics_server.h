// MetricsServer: GET /metrics over HTTP for one registry, in the text exposition format 0.0.4
// (SerializeText). RAII: serving starts in Start() and stops in the destructor (promptly: the
// listening socket is shut down and the two handler threads joined).
//
// NOTE: served with cpp-httplib rather than prometheus-cpp's Exposer: the Exposer's civetweb
// takes 2.0 s to stop (its master thread's poll quantum), which every process exit and every
// test that starts a server would pay.
//
// Thread-safe: the server's threads collect the registry while the process updates it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace httplib {
class Server;
}  // namespace httplib

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

  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_scrape_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;  // runs the listen loop until the destructor stops it
  int port_ = 0;
};

}  // namespace tandem::metrics
