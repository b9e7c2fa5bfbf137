// Notices HTTP clients that hang up while their request runs, so the gateway cancels the
// worker's generation (streamed or not) instead of computing tokens nobody reads.
//
// cpp-httplib 0.11.4 (Debian's) gives handlers no way to ask whether the peer is still there, and
// a non-streamed handler writes nothing until the end. So the gateway finds the connection's
// socket itself: the accepted socket is the one whose (local port, peer address, peer port) are
// the request's (FindRequestSocket), and a watcher thread peeks at every watched socket every
// `poll_interval_ms` (recv MSG_PEEK | MSG_DONTWAIT, what newer httplib's is_socket_alive does):
// end of file or an error means the client is gone, and the watch's callback runs once.
//
// Thread-safe. A Watch must be destroyed before its socket is closed (it is: httplib closes
// the socket after the handler and the content provider have returned), and the callback's
// captures must outlive the Watch: after ~Watch returns the callback never runs.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tandem/gateway/accepted_sockets.h"

namespace tandem::gateway {

// True when the peer of `fd` has closed the connection (or it failed); false while it is open,
// including when unread bytes wait (a pipelined request).
bool PeerClosed(int fd);

class DisconnectWatcher {
 public:
  explicit DisconnectWatcher(int poll_interval_ms = 50);
  ~DisconnectWatcher();
  DisconnectWatcher(const DisconnectWatcher&) = delete;
  DisconnectWatcher& operator=(const DisconnectWatcher&) = delete;

  class Watch {
   public:
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;
    bool closed() const;  // the callback has run

   private:
    friend class DisconnectWatcher;
    Watch(DisconnectWatcher* owner, int id) : owner_(owner), id_(id) {}
    DisconnectWatcher* owner_;
    int id_;
  };

  // Watches `fd` until the Watch is destroyed; `on_close` runs once, on the watcher thread
  // (under its lock: keep it short and non-blocking, e.g. ClientContext::TryCancel).
  std::unique_ptr<Watch> Add(int fd, std::function<void()> on_close);

  // Runs the callback of every watch that has not fired (shutdown: cancel what still runs).
  void FireAll();

 private:
  struct Entry {
    int fd;
    std::function<void()> on_close;
    bool closed = false;
  };
  void Loop();

  const int poll_interval_ms_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<int, Entry> entries_;  // by watch id; guarded by mu_
  int next_id_ = 0;               // guarded by mu_
  bool stop_ = false;             // guarded by mu_
  std::thread thread_;
};

}  // namespace tandem::gateway
