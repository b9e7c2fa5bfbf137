// ShmChannel: round trips between two threads and two processes, deadlines, the futex sleep
// path, and a peer that writes garbage into the shared header (an error, never a crash).
#include "tandem/cpu_attention/shm_channel.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

namespace tandem::cpu_attention {
namespace {

using Clock = ShmChannel::Clock;
using std::chrono::milliseconds;

ShmChannelOptions SmallOptions(uint32_t spin_us = 10) {
  ShmChannelOptions o;
  o.request_capacity = 1 << 16;
  o.response_capacity = 1 << 16;
  o.spin_us = spin_us;
  return o;
}

// Serves `count` requests: the answer is the request's bytes, each plus one.
void ServeIncrement(ShmChannel& server, int count, milliseconds delay = milliseconds(0)) {
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<std::span<const std::byte>> request = server.WaitRequest();
    if (!request.ok()) return;
    std::this_thread::sleep_for(delay);
    std::span<std::byte> out = server.response_area();
    for (size_t j = 0; j < request->size(); ++j) {
      out[j] = static_cast<std::byte>(static_cast<uint8_t>((*request)[j]) + 1);
    }
    server.Reply(request->size());
  }
}

// A second mapping of the segment, to play a misbehaving peer.
struct RawMapping {
  explicit RawMapping(const ShmChannel& ch) : bytes(ch.segment_bytes()) {
    const int fd = shm_open(ch.name().c_str(), O_RDWR, 0);
    EXPECT_GE(fd, 0);
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    EXPECT_NE(base, MAP_FAILED);
  }
  ~RawMapping() { munmap(base, bytes); }
  ShmChannel::Header* header() { return static_cast<ShmChannel::Header*>(base); }
  size_t bytes;
  void* base;
};

TEST(ShmChannelTest, RoundTripsBetweenThreads) {
  auto client = ShmChannel::Create(SmallOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  auto server =
      ShmChannel::Attach((*client)->name(), (*client)->segment_bytes(), (*client)->nonce(), 10);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE((*client)->PeerAttached());
  constexpr int kRounds = 200;
  std::thread thread([&] { ServeIncrement(**server, kRounds); });
  for (int i = 0; i < kRounds; ++i) {
    const size_t n = 1 + (i * 37) % 5000;
    std::span<std::byte> request = (*client)->request_area();
    for (size_t j = 0; j < n; ++j) request[j] = static_cast<std::byte>((i + j) & 0xff);
    ASSERT_TRUE((*client)->Send(n).ok());
    auto answer = (*client)->WaitResponse(Clock::now() + milliseconds(5000));
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->size(), n);
    for (size_t j = 0; j < n; ++j) {
      ASSERT_EQ(static_cast<uint8_t>((*answer)[j]), static_cast<uint8_t>((i + j + 1) & 0xff));
    }
    EXPECT_FALSE((*client)->Busy());
  }
  thread.join();
}

TEST(ShmChannelTest, SleepingPeersAreWokenByFutex) {
  // No spinning at all, and a server slower than any spin: both sides sleep in FUTEX_WAIT.
  auto client = ShmChannel::Create(SmallOptions(/*spin_us=*/0));
  ASSERT_TRUE(client.ok());
  auto server =
      ShmChannel::Attach((*client)->name(), (*client)->segment_bytes(), (*client)->nonce(), 0);
  ASSERT_TRUE(server.ok());
  std::thread thread([&] { ServeIncrement(**server, 3, milliseconds(30)); });
  for (int i = 0; i < 3; ++i) {
    std::this_thread::sleep_for(milliseconds(20));  // the server is asleep by now
    (*client)->request_area()[0] = std::byte{41};
    ASSERT_TRUE((*client)->Send(1).ok());
    auto answer = (*client)->WaitResponse(Clock::now() + milliseconds(5000));
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(static_cast<uint8_t>((*answer)[0]), 42);
  }
  thread.join();
}

TEST(ShmChannelTest, DeadlineExpiresAndTheLateAnswerIsDrained) {
  auto client = ShmChannel::Create(SmallOptions());
  ASSERT_TRUE(client.ok());
  auto server =
      ShmChannel::Attach((*client)->name(), (*client)->segment_bytes(), (*client)->nonce(), 10);
  ASSERT_TRUE(server.ok());
  (*client)->request_area()[0] = std::byte{1};
  ASSERT_TRUE((*client)->Send(1).ok());
  const auto start = Clock::now();
  auto answer = (*client)->WaitResponse(start + milliseconds(30));
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(Clock::now() - start, milliseconds(30));
  EXPECT_LT(Clock::now() - start, milliseconds(2000));
  EXPECT_TRUE((*client)->Busy());
  EXPECT_EQ((*client)->Send(1).code(), absl::StatusCode::kFailedPrecondition);
  ServeIncrement(**server, 1);  // the late answer
  answer = (*client)->WaitResponse(Clock::now() + milliseconds(1000));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(static_cast<uint8_t>((*answer)[0]), 2);
  EXPECT_FALSE((*client)->Busy());
}

TEST(ShmChannelTest, StopEndsAWaitingServer) {
  auto client = ShmChannel::Create(SmallOptions());
  ASSERT_TRUE(client.ok());
  auto server =
      ShmChannel::Attach((*client)->name(), (*client)->segment_bytes(), (*client)->nonce(), 10);
  ASSERT_TRUE(server.ok());
  absl::Status result;
  std::thread thread([&] { result = (*server)->WaitRequest().status(); });
  std::this_thread::sleep_for(milliseconds(20));
  (*server)->Stop();
  thread.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled);
}

TEST(ShmChannelTest, GarbageSizesFromThePeerAreErrors) {
  auto client = ShmChannel::Create(SmallOptions());
  ASSERT_TRUE(client.ok());
  auto server =
      ShmChannel::Attach((*client)->name(), (*client)->segment_bytes(), (*client)->nonce(), 10);
  ASSERT_TRUE(server.ok());
  RawMapping raw(**client);
  ShmChannel::Header* h = raw.header();

  // A client that claims a request larger than the area.
  ASSERT_TRUE((*client)->Send(4).ok());
  h->request_bytes = ~uint64_t{0};
  auto request = (*server)->WaitRequest();
  EXPECT_EQ(request.status().code(), absl::StatusCode::kInvalidArgument) << request.status();
  (*server)->Reply(0);
  auto empty = (*client)->WaitResponse(Clock::now() + milliseconds(1000));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->size(), 0u);

  // A server that claims a response larger than the area.
  ASSERT_TRUE((*client)->Send(4).ok());
  request = (*server)->WaitRequest();
  ASSERT_TRUE(request.ok());
  (*server)->Reply(4);
  h->response_bytes = uint64_t{1} << 40;
  auto answer = (*client)->WaitResponse(Clock::now() + milliseconds(1000));
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kDataLoss) << answer.status();

  // Sizes beyond the area are refused on the sending side too.
  EXPECT_EQ((*client)->Send((1 << 16) + 1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmChannelTest, AttachChecksNameSizeNonceAndGeometry) {
  auto client = ShmChannel::Create(SmallOptions());
  ASSERT_TRUE(client.ok());
  const std::string name = (*client)->name();
  const uint64_t bytes = (*client)->segment_bytes();
  const uint64_t nonce = (*client)->nonce();
  EXPECT_EQ(ShmChannel::Attach(name, bytes, nonce + 1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmChannel::Attach(name, bytes + 4096, nonce, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmChannel::Attach("no-slash", bytes, nonce, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmChannel::Attach("/tandem-does-not-exist-0", bytes, nonce, 0).status().code(),
            absl::StatusCode::kNotFound);
  {
    RawMapping raw(**client);
    const uint64_t saved = raw.header()->response_capacity;
    raw.header()->response_capacity = uint64_t{1} << 29;  // past the end of the segment
    EXPECT_EQ(ShmChannel::Attach(name, bytes, nonce, 0).status().code(),
              absl::StatusCode::kInvalidArgument);
    raw.header()->response_capacity = saved;
    raw.header()->request_offset = raw.header()->response_offset;  // overlapping areas
    EXPECT_EQ(ShmChannel::Attach(name, bytes, nonce, 0).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  (*client)->Unlink();
  EXPECT_EQ(ShmChannel::Attach(name, bytes, nonce, 0).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmChannelTest, NameIsRemovedWithTheCreator) {
  std::string name;
  {
    auto client = ShmChannel::Create(SmallOptions());
    ASSERT_TRUE(client.ok());
    name = (*client)->name();
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    EXPECT_GE(fd, 0);
    close(fd);
  }
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);
  EXPECT_EQ(errno, ENOENT);
}

TEST(ShmChannelTest, RoundTripsBetweenTwoProcesses) {
  auto client = ShmChannel::Create(SmallOptions());
  ASSERT_TRUE(client.ok());
  constexpr int kRounds = 100;
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // the server process: sums the request's u32 values
    prctl(PR_SET_PDEATHSIG, SIGKILL);   // never outlive a failed test
    auto server =
        ShmChannel::Attach((*client)->name(), (*client)->segment_bytes(), (*client)->nonce(), 10);
    if (!server.ok()) _exit(2);
    for (int i = 0; i < kRounds; ++i) {
      auto request = (*server)->WaitRequest();
      if (!request.ok()) _exit(3);
      std::vector<uint32_t> values(request->size() / 4);
      std::memcpy(values.data(), request->data(), values.size() * 4);
      const uint64_t sum = std::accumulate(values.begin(), values.end(), uint64_t{0});
      std::memcpy((*server)->response_area().data(), &sum, sizeof(sum));
      (*server)->Reply(sizeof(sum));
    }
    _exit(0);
  }
  for (int i = 0; i < kRounds; ++i) {
    const uint32_t n = 1 + i * 13;
    std::vector<uint32_t> values(n);
    std::iota(values.begin(), values.end(), static_cast<uint32_t>(i));
    std::memcpy((*client)->request_area().data(), values.data(), n * 4);
    ASSERT_TRUE((*client)->Send(n * 4).ok());
    auto answer = (*client)->WaitResponse(Clock::now() + milliseconds(10000));
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->size(), sizeof(uint64_t));
    uint64_t sum = 0;
    std::memcpy(&sum, answer->data(), sizeof(sum));
    EXPECT_EQ(sum, std::accumulate(values.begin(), values.end(), uint64_t{0}));
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace tandem::cpu_attention
