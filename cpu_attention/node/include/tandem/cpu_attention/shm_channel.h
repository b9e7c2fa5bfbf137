// ShmChannel: a request/response channel between two processes of one host over a POSIX
// shared-memory segment, for the latency-critical Attend round trip and bulk KV appends between
// a GPU worker and a CPU attention node on the same machine (DESIGN.md: "shared memory on one
// host"). One request is outstanding at a time: the client writes a request into the request
// area and publishes it, the server answers into the response area.
//
// Segment layout (host byte order; both peers run on one host):
//   [0, 4096)                                      header: magic, version, nonce, the two areas'
//                                                  offsets and capacities, and the sequence words
//   [request_offset, + request_capacity)           request area (client writes, server reads)
//   [response_offset, + response_capacity)         response area (server writes, client reads)
//
// Signalling: two 32-bit sequence words in the header. The client stores request_seq = s after
// writing request s; the server stores response_seq = s after writing its answer. A waiter spins
// for `spin_us` and then sleeps in FUTEX_WAIT on the word (shared futexes, no
// FUTEX_PRIVATE_FLAG, so they work across processes); a writer calls FUTEX_WAKE only when the
// peer announced that it sleeps. Every wait has a deadline.
//
// Trust: everything read from the segment was written by the peer. The geometry is read once at
// Attach and checked against the mapped size; every later size (request_bytes, response_bytes)
// is bounded by its area's capacity before use. The content of the areas stays writable by the
// peer while it is read: callers copy what they validate before relying on it.
//
// Lifetime: the creator (client) makes the name with O_EXCL and mode 0600, and removes it with
// Unlink() once the peer has mapped it (or in its destructor); the mapping outlives the name.
// Thread safety: one client thread and one server thread; Stop() may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::cpu_attention {

struct ShmChannelOptions {
  uint64_t request_capacity = 32ull << 20;  // bytes of the request area
  uint64_t response_capacity = 8ull << 20;  // bytes of the response area
  uint32_t spin_us = 10;                    // busy-wait this long before sleeping in a futex
};

class ShmChannel {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint64_t kMaxAreaBytes = 1ull << 30;  // per area

  // The first page of the segment (public so tests can play a misbehaving peer). Sequence words
  // sit on their own cache lines so the two sides do not false-share.
  struct Header {
    uint64_t magic;
    uint32_t version;
    uint32_t header_bytes;
    uint64_t segment_bytes;
    uint64_t nonce;
    uint64_t request_offset;
    uint64_t request_capacity;
    uint64_t response_offset;
    uint64_t response_capacity;
    alignas(64) uint32_t request_seq;   // client stores s after writing request s
    uint32_t server_waiting;            // 1 while the server sleeps on request_seq
    uint64_t request_bytes;             // size of request s
    alignas(64) uint32_t response_seq;  // server stores s after answering request s
    uint32_t client_waiting;            // 1 while the client sleeps on response_seq
    uint64_t response_bytes;            // size of the answer
    alignas(64) uint32_t attached;      // server stores 1 once it has mapped the segment
    int32_t server_pid;                 // server's getpid() at Attach (peer liveness)
  };

  // Client side: creates and maps a new segment "/tandem-<pid>-<counter>". INVALID_ARGUMENT
  // for capacities of 0 or above kMaxAreaBytes; INTERNAL when shm_open/ftruncate/mmap fail.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Create(const ShmChannelOptions& options);

  // Server side: maps the segment `name` of `segment_bytes` and checks that its header carries
  // `nonce` and a geometry inside the segment. NOT_FOUND when the name does not exist on this
  // host; INVALID_ARGUMENT for a bad name, size, header or nonce. Marks the segment attached.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Attach(const std::string& name,
                                                            uint64_t segment_bytes, uint64_t nonce,
                                                            uint32_t spin_us);

  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  const std::string& name() const { return name_; }
  uint64_t segment_bytes() const { return segment_bytes_; }
  uint64_t nonce() const { return nonce_; }
  // Client: removes the name (idempotent). The mapping stays valid for both peers.
  void Unlink();
  // Client: whether the server has mapped the segment.
  bool PeerAttached() const;
  // Client, once the server has attached: watches the server process so that a wait for its
  // answer ends within milliseconds when it exits (SIGKILL, crash) instead of at the deadline.
  // Uses a pidfd of the pid the server wrote at Attach, kept only when that process maps this
  // segment (a server in another pid namespace is not watched: waits end at their deadline).
  // Returns whether the peer is watched.
  bool WatchPeer();
  // Client: true once a watched server process has exited.
  bool PeerExited() const;

  // ---- client side
  std::span<std::byte> request_area() { return {base_ + request_offset_, request_capacity_}; }
  // Publishes the first `bytes` of the request area. FAILED_PRECONDITION while the previous
  // request is unanswered (the server may still be reading the area); INVALID_ARGUMENT when
  // `bytes` exceeds the area.
  absl::Status Send(uint64_t bytes);
  // True when a sent request has no answer yet.
  bool Busy() const;
  // Waits until the server answers the last Send or `deadline` passes (DEADLINE_EXCEEDED; the
  // request stays outstanding and Busy() stays true until its late answer arrives), or a
  // watched server exits (UNAVAILABLE, noticed within kPeerCheckSlice). DATA_LOSS
  // when the server wrote a response size beyond the area. The span stays valid until the next
  // Send.
  absl::StatusOr<std::span<const std::byte>> WaitResponse(Clock::time_point deadline);

  // ---- server side
  // Waits for a request until Stop(). CANCELLED once stopped; INVALID_ARGUMENT when the client
  // wrote a request size beyond the area (answer it with an error through Reply()). The span is
  // valid until Reply().
  absl::StatusOr<std::span<const std::byte>> WaitRequest();
  std::span<std::byte> response_area() { return {base_ + response_offset_, response_capacity_}; }
  // Publishes the first `bytes` of the response area as the answer to the last WaitRequest.
  void Reply(uint64_t bytes);
  // Makes WaitRequest return CANCELLED (within its 50 ms sleep slice at worst).
  void Stop();

 private:
  ShmChannel() = default;
  Header* header() const { return reinterpret_cast<Header*>(base_); }
  // Waits until `word` != `old` (spin, then futex sleep with `waiting` raised); false when
  // `until` passed or `stop` became true first.
  bool WaitChange(uint32_t* word, uint32_t old, uint32_t* waiting, Clock::time_point until,
                  bool* stop_flag);

  std::string name_;
  bool creator_ = false;
  bool unlinked_ = true;
  std::byte* base_ = nullptr;
  uint64_t segment_bytes_ = 0;
  uint64_t nonce_ = 0;
  // The geometry, validated once at Create/Attach and never re-read from the segment.
  uint64_t request_offset_ = 0, request_capacity_ = 0;
  uint64_t response_offset_ = 0, response_capacity_ = 0;
  uint32_t spin_us_ = 10;

  int pidfd_ = -1;             // client: the watched server process (WatchPeer), or -1
  uint32_t last_sent_ = 0;     // client: sequence of the last request sent
  uint32_t last_request_ = 0;  // server: sequence of the last request received
  bool stop_ = false;          // server: accessed through std::atomic_ref
};

}  // namespace tandem::cpu_attention
