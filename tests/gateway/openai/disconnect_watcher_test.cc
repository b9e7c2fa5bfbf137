// The disconnect watcher on real loopback TCP connections: the accepted socket is found from the
// connection's addresses, an open peer (even with unread bytes) is not "closed", a peer that
// hangs up is noticed within a few polls and its callback runs once, and a destroyed Watch never
// calls back.
#include "tandem/gateway/disconnect_watcher.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace tandem::gateway {
namespace {

// A listening socket and one accepted connection on loopback.
struct Loopback {
  Loopback() {
    listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(listener, 1);
    socklen_t len = sizeof(a);
    getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
    server_port = ntohs(a.sin_port);
    client = socket(AF_INET, SOCK_STREAM, 0);
    connect(client, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    accepted = accept(listener, nullptr, nullptr);
    sockaddr_in c{};
    len = sizeof(c);
    getsockname(client, reinterpret_cast<sockaddr*>(&c), &len);
    client_port = ntohs(c.sin_port);
  }
  ~Loopback() {
    for (int fd : {listener, client, accepted}) {
      if (fd >= 0) close(fd);
    }
  }
  int listener = -1, client = -1, accepted = -1;
  int server_port = 0, client_port = 0;
};

bool WaitFor(const std::atomic<int>& value, int expected, int ms) {
  for (int i = 0; i < ms / 5 && value.load() != expected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return value.load() == expected;
}

TEST(GatewayDisconnectWatcher, FindsTheAcceptedSocket) {
  Loopback c;
  ASSERT_GE(c.accepted, 0);
  EXPECT_EQ(FindRequestSocket(c.server_port, "127.0.0.1", c.client_port), c.accepted);
  EXPECT_EQ(FindRequestSocket(c.server_port, "127.0.0.1",
                              c.client_port + 1 == 65536 ? 1 : c.client_port + 1),
            -1);
  EXPECT_EQ(FindRequestSocket(c.server_port, "10.1.2.3", c.client_port), -1);
}

TEST(GatewayDisconnectWatcher, OpenPeerWithUnreadBytesIsNotClosed) {
  Loopback c;
  EXPECT_FALSE(PeerClosed(c.accepted));
  ASSERT_EQ(send(c.client, "GET", 3, 0), 3);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(PeerClosed(c.accepted));  // a pipelined request waits: still open
  char buffer[3];
  EXPECT_EQ(recv(c.accepted, buffer, 3, 0), 3);  // the peek consumed nothing
}

TEST(GatewayDisconnectWatcher, HangUpCallsBackOnce) {
  DisconnectWatcher watcher(5);
  Loopback c;
  std::atomic<int> calls{0};
  auto watch = watcher.Add(c.accepted, [&] { calls.fetch_add(1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(calls.load(), 0);
  EXPECT_FALSE(watch->closed());
  close(c.client);
  c.client = -1;
  ASSERT_TRUE(WaitFor(calls, 1, 2000));
  EXPECT_TRUE(watch->closed());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(calls.load(), 1);
}

TEST(GatewayDisconnectWatcher, DestroyedWatchNeverCallsBack) {
  DisconnectWatcher watcher(5);
  Loopback c;
  std::atomic<int> calls{0};
  watcher.Add(c.accepted, [&] { calls.fetch_add(1); }).reset();
  close(c.client);
  c.client = -1;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(calls.load(), 0);
}

}  // namespace
}  // namespace tandem::gateway
