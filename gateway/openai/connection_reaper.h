// Closes HTTP connections that hold a connection thread without finishing a request's headers:
// httplib 0.11.4 bounds each read (--read_timeout_s) but not a request trickled a byte per read
// (slowloris), and each open connection holds one of its threads. A connection gets
// header_timeout from its arrival, or from its previous response, to finish sending a request's
// line and headers; past that, the reaper shuts its socket down (the client sees the connection
// close, httplib's thread moves on). From the end of the headers the body deadline
// (request_guard.h) and the handler take over; a connection in a handler is never reaped.
//
// A scan thread lists the accepted sockets (accepted_sockets.h) every scan_interval; the
// pre-routing handler reports HeadersArrived and the logger ResponseSent, by peer address.
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace tandem::gateway {

class ConnectionReaper {
 public:
  ConnectionReaper(int local_port, std::chrono::milliseconds header_timeout,
                   std::chrono::milliseconds scan_interval = std::chrono::milliseconds(250));
  ~ConnectionReaper();
  ConnectionReaper(const ConnectionReaper&) = delete;
  ConnectionReaper& operator=(const ConnectionReaper&) = delete;

  // The request on peer_host:peer_port is past its headers (not reaped until ResponseSent).
  void HeadersArrived(const std::string& peer_host, int peer_port);
  // Its response was written: the next request's headers are due within header_timeout.
  void ResponseSent(const std::string& peer_host, int peer_port);

  int64_t reaped() const { return reaped_.load(); }

 private:
  using Clock = std::chrono::steady_clock;
  using Peer = std::pair<std::string, int>;
  struct Connection {
    int fd = -1;            // -1 until a scan has seen it
    Clock::time_point since;  // arrival or previous response
    bool in_request = false;  // between HeadersArrived and ResponseSent
    bool reaped = false;      // shut down, waiting for httplib to close it
  };

  void Loop();
  void Scan();

  const int local_port_;
  const std::chrono::milliseconds header_timeout_;
  const std::chrono::milliseconds scan_interval_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;                     // guarded by mu_
  std::map<Peer, Connection> connections_;  // guarded by mu_
  std::atomic<int64_t> reaped_{0};
  std::thread thread_;
};

}  // namespace tandem::gateway
