#include "tandem/gateway/accepted_sockets.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>

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

// The peer of `fd` when it is a connected socket with local port `local_port`.
bool PeerOf(int fd, int local_port, std::string* host, int* port) {
  sockaddr_storage peer{}, local{};
  socklen_t peer_len = sizeof(peer), local_len = sizeof(local);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) return false;
  std::string local_host;
  int local_port_of_fd = 0;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      !AddressOf(local, &local_host, &local_port_of_fd) || local_port_of_fd != local_port) {
    return false;
  }
  return AddressOf(peer, host, port);
}

// Calls `visit(fd)` for each open descriptor until it returns false.
template <typename Visit>
void ForEachDescriptor(Visit visit) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    if (!visit(static_cast<int>(fd))) break;
  }
  closedir(dir);
}

}  // namespace

std::vector<AcceptedSocket> AcceptedSockets(int local_port) {
  std::vector<AcceptedSocket> sockets;
  ForEachDescriptor([&](int fd) {
    AcceptedSocket s;
    if (PeerOf(fd, local_port, &s.peer_host, &s.peer_port)) {
      s.fd = fd;
      sockets.push_back(std::move(s));
    }
    return true;
  });
  return sockets;
}

bool IsConnection(int fd, int local_port, const std::string& peer_host, int peer_port) {
  std::string host;
  int port = 0;
  return PeerOf(fd, local_port, &host, &port) && port == peer_port && host == peer_host;
}

int FindRequestSocket(int local_port, const std::string& remote_addr, int remote_port) {
  int found = -1;
  ForEachDescriptor([&](int fd) {
    if (!IsConnection(fd, local_port, remote_addr, remote_port)) return true;
    found = fd;
    return false;
  });
  return found;
}

}  // namespace tandem::gateway
