#include "tandem/gateway/disconnect_watcher.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <utility>

namespace tandem::gateway {
namespace {

// The numeric address and port of a socket address (IPv4 or IPv6); false for other families.
bool AddressOf(const sockaddr_storage& a, std::string* host, int* port) {
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) return false;
    *port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a);
    if (inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text)) == nullptr) return false;
    *port = ntohs(in6->sin6_port);
  } else {
    return false;
  }
  *host = text;
  return true;
}

}  // namespace

int FindRequestSocket(int local_port, const std::string& remote_addr, int remote_port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_len = sizeof(peer), local_len = sizeof(local);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0)
      continue;
    std::string host;
    int port = 0;
    if (!AddressOf(peer, &host, &port) || port != remote_port || host != remote_addr) continue;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        !AddressOf(local, &host, &port) || port != local_port) {
      continue;
    }
    found = static_cast<int>(fd);
    break;
  }
  closedir(dir);
  return found;
}

bool PeerClosed(int fd) {
  char c;
  const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return false;
  if (n == 0) return true;
  return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

DisconnectWatcher::DisconnectWatcher(int poll_interval_ms)
    : poll_interval_ms_(poll_interval_ms < 1 ? 1 : poll_interval_ms), thread_([this] { Loop(); }) {}

DisconnectWatcher::~DisconnectWatcher() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::unique_ptr<DisconnectWatcher::Watch> DisconnectWatcher::Add(int fd,
                                                                 std::function<void()> on_close) {
  std::lock_guard lock(mu_);
  const int id = next_id_++;
  entries_.emplace(id, Entry{fd, std::move(on_close)});
  return std::unique_ptr<Watch>(new Watch(this, id));
}

DisconnectWatcher::Watch::~Watch() {
  std::lock_guard lock(owner_->mu_);
  owner_->entries_.erase(id_);
}

bool DisconnectWatcher::Watch::closed() const {
  std::lock_guard lock(owner_->mu_);
  auto it = owner_->entries_.find(id_);
  return it != owner_->entries_.end() && it->second.closed;
}

void DisconnectWatcher::FireAll() {
  std::lock_guard lock(mu_);
  for (auto& [id, entry] : entries_) {
    if (entry.closed) continue;
    entry.closed = true;
    if (entry.on_close) entry.on_close();
  }
}

void DisconnectWatcher::Loop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    for (auto& [id, entry] : entries_) {
      if (entry.closed || !PeerClosed(entry.fd)) continue;
      entry.closed = true;
      if (entry.on_close) entry.on_close();
    }
    cv_.wait_for(lock, std::chrono::milliseconds(poll_interval_ms_), [this] { return stop_; });
  }
}

}  // namespace tandem::gateway
