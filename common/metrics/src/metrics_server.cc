#include "tandem/metrics/metrics_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <charconv>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/metrics/registry.h"

namespace tandem::metrics {
namespace {

struct HostPort {
  std::string host;  // without IPv6 brackets
  int port = 0;
};

// host:port or [v6]:port; port 0..65535.
absl::StatusOr<HostPort> ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  HostPort hp;
  hp.host = address.substr(0, colon);
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  const char* begin = address.data() + colon + 1;
  const char* end = address.data() + address.size();
  const auto [stop, ec] = std::from_chars(begin, end, hp.port);
  if (ec != std::errc() || stop != end || hp.port < 0 || hp.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': port must be 0..65535"));
  }
  return hp;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry,
    std::function<void()> before_scrape) {
  if (registry == nullptr) return absl::InvalidArgumentError("metrics server without a registry");
  absl::StatusOr<HostPort> hp = ParseAddress(address);
  if (!hp.ok()) return hp.status();
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->registry_ = std::move(registry);
  server->before_scrape_ = std::move(before_scrape);
  server->http_ = std::make_unique<httplib::Server>();
  httplib::Server& http = *server->http_;
  // Scrapes come every few seconds from one or two Prometheus servers: two threads suffice.
  http.new_task_queue = [] { return new httplib::ThreadPool(2); };
  // httplib's default also sets SO_REUSEPORT, which lets a second process bind the same port
  // and silently take half the scrapes: SO_REUSEADDR only (a restart may rebind at once).
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  MetricsServer* self = server.get();
  http.Get("/metrics", [self](const httplib::Request&, httplib::Response& response) {
    if (self->before_scrape_) self->before_scrape_();
    response.set_content(SerializeText(*self->registry_), std::string(kTextContentType).c_str());
  });

  if (hp->port == 0) {
    server->port_ = http.bind_to_any_port(hp->host);
  } else if (http.bind_to_port(hp->host, hp->port)) {
    server->port_ = hp->port;
  }
  if (server->port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on '", address,
                                               "' (address in use or not of this host?)"));
  }
  server->thread_ = std::thread([&http] { http.listen_after_bind(); });
  // stop() only takes effect once the loop runs: wait for it, so the destructor cannot miss it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!http.is_running() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!http.is_running()) {
    return absl::InternalError(absl::StrCat("metrics server on '", address, "' did not start"));
  }
  return server;
}

MetricsServer::~MetricsServer() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace tandem::metrics
