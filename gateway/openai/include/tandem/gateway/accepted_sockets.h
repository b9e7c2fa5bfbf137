// The gateway's accepted TCP connections as the kernel lists them: cpp-httplib 0.11.4 (Debian's)
// gives handlers no socket, so the disconnect watcher and the connection reaper find a
// connection's socket by its (local port, peer address, peer port).
// NOTE: one getpeername + getsockname per open descriptor of the process (/proc/self/fd):
// ~1 us each, well under a millisecond at a few hundred connections.
#pragma once

#include <string>
#include <vector>

namespace tandem::gateway {

struct AcceptedSocket {
  int fd = -1;
  std::string peer_host;  // numeric, as httplib reports Request::remote_addr
  int peer_port = 0;
};

// The connected sockets of this process whose local port is `local_port`.
std::vector<AcceptedSocket> AcceptedSockets(int local_port);

// Whether `fd` is still the connection local_port <- peer_host:peer_port.
bool IsConnection(int fd, int local_port, const std::string& peer_host, int peer_port);

// The socket of the connection local_port <- remote_addr:remote_port, or -1 when none of this
// process' sockets matches.
int FindRequestSocket(int local_port, const std::string& remote_addr, int remote_port);

}  // namespace tandem::gateway
