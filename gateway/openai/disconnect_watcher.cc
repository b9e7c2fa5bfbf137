#include "tandem/gateway/disconnect_watcher.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <utility>

namespace tandem::gateway {

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
