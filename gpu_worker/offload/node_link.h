// Node links: the data path of one RemoteKv session to one CPU attention node: appends of
// evicted KV and the per-layer Attend round trip, over one of two transports with one answer
// type (NodeAnswer):
//   GrpcLink  AppendKv client streams and asynchronous Attend calls (any node)
//   ShmLink   the session's shared-memory channel to a node on this host
//             (cpu_attention/shm_channel.h): q is written into the request area and the node
//             wakes; the answer is read from the response area; appends go in chunks that
//             alternate between the two halves of the request area
// Control calls (OpenSession, Reselect, ReshardSession, CloseSession) stay in RemoteKv, over
// gRPC; placement (which heads a node owns) too: a link sends what it is given and returns
// what the node answered, checked for size and shape only.
//
// Not thread-safe: RemoteKv's thread drives its links; one Attend in flight per link (the gRPC
// completion lands on a gRPC thread and is joined by FinishAttend).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "tandem/common/grpc_status.h"
#include "tandem/cpu_attention/shm_channel.h"
#include "tandem/gpu_worker/dtype.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/page_selection.h"

namespace tandem::gpu_worker {

// What a link knows of its session.
struct LinkSession {
  std::string session_id;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  DType kv_dtype = DType::kBF16;
  int attend_deadline_ms = 1000;
  int control_deadline_ms = 30000;
  uint64_t shm_append_chunk_bytes = 8ull << 20;   // ShmLink: at most half the request area
};

// One Attend of one layer: q [tokens, num_q_heads, head_dim] f32 (host; copied), and optionally
// the pages each (token, kv head) attends over (page_selection.h; null = every held entry).
struct NodeQuery {
  int64_t layer = 0;
  const float* q = nullptr;
  int64_t tokens = 0;
  const PageSelection* pages = nullptr;
  // Heads the node answers for (its own, migrating shards included): sizes the shm answer.
  int64_t answer_heads = 0;
};

// A node's answer to an Attend: the partial states of the kv heads it holds, each with its G
// query heads. Views into the link's buffers, valid until the link's next call. Entries of
// kv_heads come from the node: the caller checks them against its placement before use.
struct NodeAnswer {
  std::span<const uint32_t> kv_heads;   // [own]
  const float* o = nullptr;             // [tokens, own, G, head_dim]: row t·own·G + h·G + j
  const float* lse = nullptr;           // [tokens, own, G]
  std::span<const uint64_t> selected;   // [own] entries attended per head, or empty
  std::span<const uint64_t> held;       // [own] entries held per head, or empty
  uint64_t compute_micros = 0;
  uint64_t bytes_scanned = 0;
  uint64_t handle_micros = 0;   // shm: the node's whole time serving the call (0 over gRPC)
};

class GrpcLink {
 public:
  // node: the node's index in `pool`; both outlive the link.
  GrpcLink(NodePool& pool, size_t node, const LinkSession& session)
      : pool_(pool), node_(node), session_(session) {}
  ~GrpcLink() { Join(); }
  GrpcLink(const GrpcLink&) = delete;
  GrpcLink& operator=(const GrpcLink&) = delete;

  // Appends `num_tokens` entries of `heads` of `layer` from head-major host arrays holding all
  // kv heads: k, v [num_kv_heads, num_tokens, head_dim] of kv_dtype; maw [num_kv_heads,
  // num_tokens]. The node's error (with its address) on failure.
  absl::Status Append(int64_t layer, std::span<const uint32_t> heads, const void* k,
                      const void* v, const float* maw, int64_t num_tokens,
                      int64_t window_entries);
  // Sends the query (the call's deadline is attend_deadline_ms).
  void StartAttend(const NodeQuery& query);
  // Waits for the call; nullopt when it failed or its answer is malformed.
  std::optional<NodeAnswer> FinishAttend();
  // Waits for a call in flight, if any (nothing of it may outlive the link).
  void Join();
  // The status of the last Attend (after FinishAttend).
  absl::Status status() const { return FromGrpcStatus(status_); }

 private:
  NodePool& pool_;
  size_t node_;
  LinkSession session_;
  int64_t tokens_ = 0;
  // The call in flight (a fresh context per call, as gRPC requires).
  std::unique_ptr<grpc::ClientContext> context_;
  v1::AttendRequest request_;
  v1::AttendResponse response_;
  grpc::Status status_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  bool in_flight_ = false;   // guarded by mu_
};

class ShmLink {
 public:
  using Clock = std::chrono::steady_clock;
  // `channel`: the session's channel, mapped by the node. address: for error messages.
  // `fill`: the threads that copy append chunks into the channel (NodePool's; outlives it).
  ShmLink(std::unique_ptr<cpu_attention::ShmChannel> channel, std::string address,
          const LinkSession& session, cpu_attention::ThreadPool& fill)
      : channel_(std::move(channel)), address_(std::move(address)), session_(session),
        fill_(fill) {
    channel_->WatchPeer();   // a node process that exits ends our waits at once
  }

  // GrpcLink::Append over the channel; adds the chunks sent to *chunks.
  absl::Status Append(int64_t layer, std::span<const uint32_t> heads, const void* k,
                      const void* v, const float* maw, int64_t num_tokens,
                      int64_t window_entries, uint64_t* chunks);
  // kTooLarge: q or the answer exceeds the areas (send it over gRPC); kBusy: the node has not
  // answered the previous request yet (it missed a deadline).
  enum class Start { kSent, kBusy, kTooLarge };
  Start StartAttend(const NodeQuery& query);
  // Waits for the answer until `deadline`; nullopt when it is missing or malformed (error()
  // says why: DEADLINE_EXCEEDED, UNAVAILABLE when the node process exited, DATA_LOSS).
  std::optional<NodeAnswer> FinishAttend(Clock::time_point deadline);
  const absl::Status& error() const { return error_; }
  // Whether the node's process is known to have exited (ShmChannel::WatchPeer).
  bool peer_exited() const { return channel_->PeerExited(); }

 private:
  std::unique_ptr<cpu_attention::ShmChannel> channel_;
  std::string address_;
  LinkSession session_;
  cpu_attention::ThreadPool& fill_;
  int64_t tokens_ = 0;
  absl::Status error_;
};

}  // namespace tandem::gpu_worker
