#include "tandem/metrics/metrics_server.h"

#include <charconv>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "prometheus/exposer.h"

namespace tandem::metrics {
namespace {

// Runs the refresh hook, then collects the registry: the exposer calls Collect() once per
// scrape and collectable.
class RefreshingCollectable : public prometheus::Collectable {
 public:
  RefreshingCollectable(std::shared_ptr<prometheus::Registry> registry,
                        std::function<void()> before)
      : registry_(std::move(registry)), before_(std::move(before)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    if (before_) before_();
    return registry_->Collect();
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_;
};

// civetweb's listening_ports spelling of `address` (host:port, [v6]:port); it takes numeric
// hosts only, so "localhost" becomes 127.0.0.1.
absl::StatusOr<std::string> ListeningPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  const std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  int value = -1;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || end != port.data() + port.size() || value < 0 || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': port must be 0..65535"));
  }
  if (host == "localhost") return absl::StrCat("127.0.0.1:", port);
  return address;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry,
    std::function<void()> before_scrape) {
  if (registry == nullptr) return absl::InvalidArgumentError("metrics server without a registry");
  absl::StatusOr<std::string> listen = ListeningPort(address);
  if (!listen.ok()) return listen.status();
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->source_ =
      std::make_shared<RefreshingCollectable>(std::move(registry), std::move(before_scrape));
  try {
    server->exposer_ = std::make_unique<prometheus::Exposer>(*listen, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on '", address,
                                               "' (address in use or not of this host?): ",
                                               e.what()));
  }
  server->exposer_->RegisterCollectable(server->source_, "/metrics");
  const std::vector<int> ports = server->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("metrics server on '", address, "' has no port"));
  }
  server->port_ = ports.front();
  return server;
}

MetricsServer::~MetricsServer() {
  exposer_.reset();   // stops the server threads before the collectable goes away
}

}  // namespace tandem::metrics
