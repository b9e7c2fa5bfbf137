// tandem-delay-proxy: a TCP forwarder that adds a fixed latency to every byte in each direction.
// Used by the multi-host tests where the kernel has no sch_netem: NetnsCluster runs it inside a
// CPU node's network namespace, listening on the namespace's veth address and forwarding to the
// node on 127.0.0.1, so every path to that node crosses the delay.
//
//   tandem-delay-proxy --listen=10.0.0.2:0 --target=127.0.0.1:50061 --delay_us=10000
//
// Prints "LISTENING <port>" on stdout once it accepts connections; exits 0 on SIGTERM or SIGINT
// (open connections are cut).
//
// How the delay is real and not a sleep before connect: each chunk read from one side is stamped
// with `read time + delay` and queued per direction (FIFO, so stamps are monotonic); a timerfd
// armed at the earliest stamp releases chunks to the other side when they are due. A request and
// its response therefore each wait `delay` in flight, on every connection, for the whole life of
// the connection, and throughput is unaffected up to max_buffer_bytes / delay per direction
// (8 MiB / 10 ms = 800 MiB/s by default). EOF travels as a queued marker (shutdown(SHUT_WR) on
// the other side when due), so half-closes are forwarded in order; a reset or an error on either
// side cuts both sockets at once.
//
// One thread, one epoll set, level-triggered, non-blocking sockets.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "host:port to accept on (port 0: any free port)");
ABSL_FLAG(std::string, target, "", "host:port every accepted connection is forwarded to");
ABSL_FLAG(int64_t, delay_us, 0, "latency added to each direction, microseconds (0..60000000)");
ABSL_FLAG(int64_t, max_buffer_bytes, 8 << 20,
          "bytes queued per direction before reading from its source pauses");

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kReadBytes = 64 << 10;  // one read() per chunk at most

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// "host:port" or "[v6]:port" to a socket address (numeric hosts only: no DNS in a test proxy).
absl::StatusOr<std::pair<sockaddr_storage, socklen_t>> ParseAddress(const std::string& text) {
  const size_t colon = text.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(text.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad address '", text, "', want host:port"));
  }
  std::string host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("bad host in '", text, "' (numeric only)"));
  }
  std::pair<sockaddr_storage, socklen_t> out{};
  std::memcpy(&out.first, found->ai_addr, found->ai_addrlen);
  out.second = found->ai_addrlen;
  freeaddrinfo(found);
  return out;
}

void SetNoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// One forwarded direction of a connection: bytes read from `src` wait in `queue` until due, then
// go to `dst`.
struct Direction {
  struct Chunk {
    Clock::time_point due;
    std::string bytes;  // empty: the EOF marker
  };
  int src = -1, dst = -1;
  std::deque<Chunk> queue;
  size_t queued_bytes = 0;
  size_t front_written = 0;  // bytes of queue.front() already written
  bool src_eof = false;      // read() returned 0; the EOF marker is queued
  bool dst_shut = false;     // the EOF marker was delivered (shutdown(dst, SHUT_WR))
  bool dst_blocked = false;  // the last write to dst hit EAGAIN: wait for EPOLLOUT
};

struct Connection {
  uint64_t id = 0;
  int client = -1, upstream = -1;
  bool connected = false;  // the non-blocking connect to the target completed
  Direction up, down;      // client -> upstream, upstream -> client
  uint32_t client_events = 0, upstream_events = 0;  // registered epoll interest
  bool client_registered = true, upstream_registered = true;
};

class DelayProxy {
 public:
  DelayProxy(Clock::duration delay, size_t max_buffer_bytes)
      : delay_(delay), max_buffer_bytes_(max_buffer_bytes) {}

  ~DelayProxy() {
    while (!connections_.empty()) Close(connections_.begin()->second.get());
    for (int fd : {listen_fd_, timer_fd_, signal_fd_, epoll_fd_}) {
      if (fd >= 0) close(fd);
    }
  }

  // Binds and listens; returns the bound port.
  absl::StatusOr<int> Listen(const std::string& listen, const std::string& target) {
    TANDEM_ASSIGN_OR_RETURN(auto listen_address, ParseAddress(listen));
    TANDEM_ASSIGN_OR_RETURN(target_, ParseAddress(target));
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    sigprocmask(SIG_BLOCK, &stop, nullptr);
    signal_fd_ = signalfd(-1, &stop, SFD_NONBLOCK | SFD_CLOEXEC);
    listen_fd_ =
        socket(listen_address.first.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (epoll_fd_ < 0 || timer_fd_ < 0 || signal_fd_ < 0 || listen_fd_ < 0) {
      return absl::InternalError(Errno("setup"));
    }
    const int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(listen_fd_, reinterpret_cast<const sockaddr*>(&listen_address.first),
             listen_address.second) != 0) {
      return absl::UnavailableError(Errno(absl::StrCat("bind ", listen).c_str()));
    }
    if (::listen(listen_fd_, 512) != 0) return absl::InternalError(Errno("listen"));
    sockaddr_storage bound{};
    socklen_t bound_len = sizeof(bound);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &bound_len);
    const int port =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    for (int fd : {listen_fd_, timer_fd_, signal_fd_}) {
      epoll_event e{};
      e.events = EPOLLIN;
      e.data.fd = fd;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &e) != 0) {
        return absl::InternalError(Errno("epoll_ctl"));
      }
    }
    return port;
  }

  // Serves until SIGTERM or SIGINT.
  absl::Status Run() {
    std::vector<epoll_event> events(256);
    for (;;) {
      const int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        return absl::InternalError(Errno("epoll_wait"));
      }
      for (int i = 0; i < n; ++i) {
        const int fd = events[i].data.fd;
        if (fd == signal_fd_) return absl::OkStatus();
        if (fd == listen_fd_) {
          AcceptAll();
        } else if (fd == timer_fd_) {
          uint64_t expirations;
          (void)!read(timer_fd_, &expirations, sizeof(expirations));
          ReleaseDue();
        } else {
          OnSocketEvent(fd, events[i].events);
        }
      }
      ArmTimer();
    }
  }

 private:
  void AcceptAll() {
    for (;;) {
      const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (client < 0) return;  // EAGAIN, or a connection reset before accept: nothing to do
      const int upstream =
          socket(target_.first.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (upstream < 0) {
        close(client);
        continue;
      }
      SetNoDelay(client);
      SetNoDelay(upstream);
      auto c = std::make_unique<Connection>();
      c->id = next_id_++;
      c->client = client;
      c->upstream = upstream;
      c->up.src = c->down.dst = client;
      c->up.dst = c->down.src = upstream;
      const int rc =
          connect(upstream, reinterpret_cast<const sockaddr*>(&target_.first), target_.second);
      if (rc != 0 && errno != EINPROGRESS) {
        close(client);
        close(upstream);
        continue;
      }
      c->connected = rc == 0;
      Connection* raw = c.get();
      connections_[raw->id] = std::move(c);
      by_fd_[client] = raw->id;
      by_fd_[upstream] = raw->id;
      for (int fd : {client, upstream}) {
        epoll_event e{};
        e.data.fd = fd;
        epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &e);
      }
      UpdateInterest(raw);
    }
  }

  void OnSocketEvent(int fd, uint32_t events) {
    auto it = by_fd_.find(fd);
    if (it == by_fd_.end()) return;
    Connection* c = connections_[it->second].get();
    const bool is_client = fd == c->client;
    if (!is_client && !c->connected) {
      int error = 0;
      socklen_t len = sizeof(error);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
      if (error != 0 || (events & (EPOLLERR | EPOLLHUP)) != 0) return Close(c);
      if ((events & EPOLLOUT) == 0) return;
      c->connected = true;
    }
    if ((events & EPOLLERR) != 0) return Close(c);
    Direction& from = is_client ? c->up : c->down;  // this fd is its source
    Direction& to = is_client ? c->down : c->up;    // this fd is its destination
    if ((events & (EPOLLIN | EPOLLHUP | EPOLLRDHUP)) != 0 && !from.src_eof) {
      if (!ReadAvailable(c, &from)) return Close(c);
    }
    if ((events & EPOLLHUP) != 0 && !to.dst_shut) {
      // Both halves of this socket are shut and we never shut our sending half: the peer reset
      // it, so what is queued for it cannot be delivered.
      return Close(c);
    }
    if ((events & EPOLLOUT) != 0) to.dst_blocked = false;
    if (!Flush(c, &c->up) || !Flush(c, &c->down)) return Close(c);
    if (Finished(*c)) return Close(c);
    UpdateInterest(c);
  }

  // Reads what the source has (up to the buffer limit) into timestamped chunks. False on a
  // read error (reset).
  bool ReadAvailable(Connection* c, Direction* d) {
    while (d->queued_bytes < max_buffer_bytes_) {
      std::string chunk(kReadBytes, '\0');
      const ssize_t n = read(d->src, chunk.data(), chunk.size());
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      const Clock::time_point due = Clock::now() + delay_;
      if (n == 0) {
        d->src_eof = true;
        d->queue.push_back({due, std::string()});
        timers_.push({due, c->id});
        return true;
      }
      chunk.resize(static_cast<size_t>(n));
      d->queued_bytes += chunk.size();
      d->queue.push_back({due, std::move(chunk)});
      timers_.push({due, c->id});
      if (static_cast<size_t>(n) < kReadBytes) return true;
    }
    return true;
  }

  // Writes the due chunks to the destination. False on a write error.
  bool Flush(Connection* c, Direction* d) {
    if (!c->connected || d->dst_blocked) return true;
    const Clock::time_point now = Clock::now();
    while (!d->queue.empty() && d->queue.front().due <= now) {
      Direction::Chunk& front = d->queue.front();
      if (front.bytes.empty()) {
        shutdown(d->dst, SHUT_WR);
        d->dst_shut = true;
        d->queue.pop_front();
        continue;
      }
      const ssize_t n = send(d->dst, front.bytes.data() + d->front_written,
                             front.bytes.size() - d->front_written, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          d->dst_blocked = true;
          return true;
        }
        if (errno == EINTR) continue;
        return false;
      }
      d->front_written += static_cast<size_t>(n);
      if (d->front_written < front.bytes.size()) continue;
      d->queued_bytes -= front.bytes.size();
      d->front_written = 0;
      d->queue.pop_front();
    }
    return true;
  }

  static bool Finished(const Connection& c) { return c.up.dst_shut && c.down.dst_shut; }

  // Level-triggered interest: EPOLLIN while a source may be read (not at EOF, buffer not full),
  // EPOLLOUT while a destination is blocked or the connect is pending. A socket that will never
  // be read or written again leaves the epoll set (EPOLLHUP would otherwise spin).
  void UpdateInterest(Connection* c) {
    auto want = [&](int fd, const Direction& from, const Direction& to) {
      uint32_t e = 0;
      if (!from.src_eof && from.queued_bytes < max_buffer_bytes_) e |= EPOLLIN | EPOLLRDHUP;
      if (to.dst_blocked || (fd == c->upstream && !c->connected)) e |= EPOLLOUT;
      return e;
    };
    auto apply = [&](int fd, uint32_t wanted, uint32_t* current, bool* registered, bool done) {
      if (done) {
        if (*registered) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
        *registered = false;
        return;
      }
      if (wanted == *current) return;
      epoll_event e{};
      e.events = wanted;
      e.data.fd = fd;
      epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &e);
      *current = wanted;
    };
    apply(c->client, want(c->client, c->up, c->down), &c->client_events, &c->client_registered,
          c->up.src_eof && c->down.dst_shut);
    apply(c->upstream, want(c->upstream, c->down, c->up), &c->upstream_events,
          &c->upstream_registered, c->down.src_eof && c->up.dst_shut);
  }

  void Close(Connection* c) {
    for (int fd : {c->client, c->upstream}) {
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
      by_fd_.erase(fd);
      close(fd);
    }
    connections_.erase(c->id);  // stale timer entries of this id are skipped later
  }

  void ReleaseDue() {
    const Clock::time_point now = Clock::now();
    while (!timers_.empty() && timers_.top().first <= now) {
      const uint64_t id = timers_.top().second;
      timers_.pop();
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      Connection* c = it->second.get();
      if (!Flush(c, &c->up) || !Flush(c, &c->down) || Finished(*c)) {
        Close(c);
        continue;
      }
      UpdateInterest(c);
    }
  }

  void ArmTimer() {
    while (!timers_.empty() && connections_.count(timers_.top().second) == 0) timers_.pop();
    itimerspec spec{};
    if (!timers_.empty()) {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          timers_.top().first.time_since_epoch())
                          .count();
      // steady_clock is CLOCK_MONOTONIC on Linux; an all-zero value would disarm the timer.
      spec.it_value.tv_sec = ns / 1000000000;
      spec.it_value.tv_nsec = std::max<int64_t>(ns % 1000000000, 1);
    }
    timerfd_settime(timer_fd_, TFD_TIMER_ABSTIME, &spec, nullptr);
  }

  const Clock::duration delay_;
  const size_t max_buffer_bytes_;
  std::pair<sockaddr_storage, socklen_t> target_{};
  int epoll_fd_ = -1, listen_fd_ = -1, timer_fd_ = -1, signal_fd_ = -1;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::unordered_map<int, uint64_t> by_fd_;
  // (due, connection id), earliest first; entries of closed connections are dropped lazily.
  std::priority_queue<std::pair<Clock::time_point, uint64_t>,
                      std::vector<std::pair<Clock::time_point, uint64_t>>,
                      std::greater<std::pair<Clock::time_point, uint64_t>>>
      timers_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "TCP forwarder adding a fixed latency per direction (multi-host tests).\n"
      "  tandem-delay-proxy --listen=10.0.0.2:0 --target=127.0.0.1:50061 --delay_us=10000");
  absl::ParseCommandLine(argc, argv);
  const int64_t delay_us = absl::GetFlag(FLAGS_delay_us);
  const int64_t max_buffer = absl::GetFlag(FLAGS_max_buffer_bytes);
  if (delay_us < 0 || delay_us > 60'000'000) {
    std::fprintf(stderr, "--delay_us must be in [0, 60000000], got %lld\n",
                 static_cast<long long>(delay_us));
    return 2;
  }
  if (max_buffer < static_cast<int64_t>(kReadBytes) || max_buffer > (int64_t{1} << 30)) {
    std::fprintf(stderr, "--max_buffer_bytes must be in [64KiB, 1GiB]\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_target).empty()) {
    std::fprintf(stderr, "--target is required\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  DelayProxy proxy(std::chrono::microseconds(delay_us), static_cast<size_t>(max_buffer));
  absl::StatusOr<int> port = proxy.Listen(absl::GetFlag(FLAGS_listen), absl::GetFlag(FLAGS_target));
  if (!port.ok()) {
    std::fprintf(stderr, "tandem-delay-proxy: %s\n", port.status().ToString().c_str());
    return 1;
  }
  std::printf("LISTENING %d\n", *port);
  std::fflush(stdout);
  const absl::Status status = proxy.Run();
  if (!status.ok()) {
    std::fprintf(stderr, "tandem-delay-proxy: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
