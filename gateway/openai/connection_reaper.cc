#include "connection_reaper.h"

#include <sys/socket.h>

#include <vector>

#include "spdlog/spdlog.h"
#include "tandem/gateway/accepted_sockets.h"

namespace tandem::gateway {

ConnectionReaper::ConnectionReaper(int local_port, std::chrono::milliseconds header_timeout,
                                   std::chrono::milliseconds scan_interval)
    : local_port_(local_port),
      header_timeout_(header_timeout),
      scan_interval_(scan_interval),
      thread_([this] { Loop(); }) {}

ConnectionReaper::~ConnectionReaper() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void ConnectionReaper::HeadersArrived(const std::string& peer_host, int peer_port) {
  std::lock_guard lock(mu_);
  Connection& c = connections_[{peer_host, peer_port}];
  c.in_request = true;
}

void ConnectionReaper::ResponseSent(const std::string& peer_host, int peer_port) {
  std::lock_guard lock(mu_);
  auto it = connections_.find({peer_host, peer_port});
  if (it == connections_.end()) return;
  it->second.in_request = false;
  it->second.since = Clock::now();
}

void ConnectionReaper::Loop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    lock.unlock();
    Scan();
    lock.lock();
    wake_.wait_for(lock, scan_interval_, [this] { return stop_; });
  }
}

void ConnectionReaper::Scan() {
  const std::vector<AcceptedSocket> open = AcceptedSockets(local_port_);
  const Clock::time_point now = Clock::now();
  std::vector<std::pair<int, Peer>> late;
  {
    std::lock_guard lock(mu_);
    std::map<Peer, Connection> seen;
    for (const AcceptedSocket& s : open) {
      Peer peer{s.peer_host, s.peer_port};
      auto it = connections_.find(peer);
      Connection c;
      if (it != connections_.end() && (it->second.fd == s.fd || it->second.fd == -1)) {
        c = it->second;
        if (c.fd == -1 && !c.in_request) c.since = now;
      } else {
        c.since = now;   // a new connection (or a new one on a reused descriptor)
      }
      c.fd = s.fd;
      if (!c.in_request && !c.reaped && now - c.since > header_timeout_) late.emplace_back(s.fd, peer);
      seen.emplace(std::move(peer), c);
    }
    // A request whose headers were reported before its first scan keeps its mark.
    for (auto& [peer, c] : connections_) {
      if (c.fd == -1 && c.in_request) seen.emplace(peer, c);
    }
    connections_ = std::move(seen);
  }
  for (const auto& [fd, peer] : late) {
    // The descriptor may have been closed and reused since the scan: check it again.
    if (!IsConnection(fd, local_port_, peer.first, peer.second)) continue;
    shutdown(fd, SHUT_RDWR);
    {
      std::lock_guard lock(mu_);
      connections_[peer].reaped = true;
    }
    reaped_.fetch_add(1);
    spdlog::warn("closed the connection from {}:{}: no complete request headers within {} ms",
                 peer.first, peer.second, header_timeout_.count());
  }
}

}  // namespace tandem::gateway
