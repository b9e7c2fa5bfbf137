// A raw HTTP/1.1 connection for the gateway's e2e tests: send a request, read what arrives,
// hang up at a chosen moment (what a client that goes away does). Blocking POSIX sockets with
// poll timeouts; loopback only.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::gateway::testing {

class RawHttpConnection {
 public:
  explicit RawHttpConnection(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) Close();
  }
  ~RawHttpConnection() { Close(); }
  RawHttpConnection(const RawHttpConnection&) = delete;
  RawHttpConnection& operator=(const RawHttpConnection&) = delete;

  bool ok() const { return fd_ >= 0; }

  // Sends `bytes` as they are (hostile framing, a byte at a time); false once the peer is gone.
  bool SendRaw(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

  // True when the peer has closed the connection (a read returns end of file or an error),
  // reading whatever arrived before.
  bool PeerClosed() {
    while (true) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 0) <= 0) return false;
      char buffer[4096];
      const ssize_t n = recv(fd_, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n <= 0) return true;
      received_.append(buffer, static_cast<size_t>(n));
    }
  }

  bool Post(const std::string& path, const std::string& json_body) {
    const std::string request = absl::StrCat(
        "POST ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
        "Content-Length: ", json_body.size(), "\r\n\r\n", json_body);
    size_t sent = 0;
    while (sent < request.size()) {
      const ssize_t n = send(fd_, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

  // Reads until `text` has arrived (true) or `timeout_ms` passed / the peer closed (false).
  bool ReadUntil(const std::string& text, int timeout_ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (received_.find(text) == std::string::npos) {
      const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            deadline - std::chrono::steady_clock::now())
                                            .count());
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, left) <= 0) continue;
      char buffer[4096];
      const ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
      if (n <= 0) return false;
      received_.append(buffer, static_cast<size_t>(n));
    }
    return true;
  }

  // Hangs up (the kernel sends FIN, or RST when unread bytes wait).
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  const std::string& received() const { return received_; }

 private:
  int fd_ = -1;
  std::string received_;
};

}  // namespace tandem::gateway::testing
