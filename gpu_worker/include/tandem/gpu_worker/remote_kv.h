// RemoteKv: one sequence's offloaded KV cache, spread over the CPU attention nodes of a NodePool.
// The (layer, kv head) shards are assigned round-robin over the nodes (an even spread; issue 5
// brings cost-balanced placement). It opens the session on every node, appends evicted blocks,
// runs the per-layer Attend in the background while the device attends over its window, and
// closes the session (also from the destructor, best effort).
//
// Failure model (DESIGN.md): every call has a deadline. A node that misses an Attend deadline or
// fails it leaves its heads' partial state empty (LSE -inf, valid by the merge): the step is
// degraded and counted. A node whose AppendKv fails has lost entries, so it is marked lost for
// this sequence and every later Attend of its heads is degraded too.
//
// Transport (per node, chosen at Open; see NodeTransport): over shared memory (a node on this
// host, cpu_attention/shm_channel.h) StartAttend writes q into the session's segment and wakes
// the node, FinishAttend spins and then sleeps in a futex until the answer or the attend
// deadline, and Append streams the blocks in chunks that fill the request area. An Attend too
// large for the areas (a long prefill chunk) goes over gRPC. A node that has not answered the
// previous shm request yet (it missed a deadline) is skipped for the next Attend (degraded).
// Control calls (OpenSession, Reselect, CloseSession) always use gRPC.
//
// Not thread-safe: one thread (the engine's executor) drives a RemoteKv; the gRPC completions
// of StartAttend land on gRPC threads and are joined by FinishAttend.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/cpu_attention/shm_channel.h"
#include "tandem/gpu_worker/dtype.h"
#include "tandem/gpu_worker/node_pool.h"

namespace tandem::gpu_worker {

struct RemoteKvOptions {
  std::string session_id;
  int64_t num_layers = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  DType kv_dtype = DType::kBF16;  // kBF16 or kF32 (as stored on the device window)
  float beta = 1.0f;
  uint32_t block_tokens = 0;      // 0 = the node's default
  int attend_deadline_ms = 1000;
  int control_deadline_ms = 30000;   // OpenSession, AppendKv, Reselect, CloseSession
  // Unset: the pool's transport (NodePoolOptions::transport).
  std::optional<NodeTransport> transport;
  // Shared-memory channel per node (reserved in /dev/shm while the session is open): the
  // request area holds two Append chunks or the q of one Attend, the response area the
  // (o, lse) of one Attend (T * H_q * (D + 1) * 4 bytes at most). The defaults carry a
  // 512-token prefill chunk of Llama-3-8B (H_q 32, D 128) in both directions.
  uint64_t shm_request_bytes = (16ull << 20) + (64 << 10);
  uint64_t shm_response_bytes = 9ull << 20;
  uint32_t shm_spin_us = 10;          // spin before sleeping while waiting for an answer
  // Bytes of one Append chunk over shm (at most half the request area: two chunks alternate).
  uint64_t shm_append_chunk_bytes = 8ull << 20;
};

// Selection counters of one layer, summed over its kv heads.
struct LayerSelection {
  uint64_t selected = 0;
  uint64_t held = 0;
};

class RemoteKv {
 public:
  static absl::StatusOr<std::unique_ptr<RemoteKv>> Open(NodePool& pool,
                                                        const RemoteKvOptions& options);
  ~RemoteKv();
  RemoteKv(const RemoteKv&) = delete;
  RemoteKv& operator=(const RemoteKv&) = delete;

  // Appends `num_tokens` entries of every kv head of `layer`, head-major:
  //   k, v: [num_kv_heads, num_tokens, head_dim] of kv_dtype; maw: [num_kv_heads, num_tokens]
  // window_entries: entries on the device when they were evicted (the β / n_gpu threshold).
  absl::Status Append(int64_t layer, const void* k, const void* v, const float* maw,
                      int64_t num_tokens, int64_t window_entries);

  // Sends q ([num_tokens, num_q_heads, head_dim] f32, host; copied) of `layer` to the nodes
  // that own heads of it. Exactly one FinishAttend must follow.
  absl::Status StartAttend(int64_t layer, const float* q, int64_t num_tokens);
  // Waits for the replies of StartAttend and writes the partial states of all query heads:
  //   o: [num_tokens, num_q_heads, head_dim] f32, lse: [num_tokens, num_q_heads] f32
  // Heads without an answer (or without entries) get o = 0, lse = -inf. Returns true when
  // some node's answer is missing (a degraded step).
  absl::StatusOr<bool> FinishAttend(float* o, float* lse);

  // Re-evaluates the salience of `layer`'s offloaded entries with fresh queries (multi-turn).
  absl::Status Reselect(int64_t layer, const float* q, int64_t num_tokens,
                        std::optional<float> beta);

  absl::Status Close();

  int64_t offloaded_tokens() const { return offloaded_tokens_; }   // per (layer, kv head)
  // Mean over Attend calls of selected/held per layer (entries held > 0 only).
  std::vector<double> MeanSelectedShare() const;
  // The last Attend's counters per layer.
  const std::vector<LayerSelection>& last_selection() const { return last_selection_; }
  uint64_t degraded_attends() const { return degraded_attends_; }
  // Nodes whose Attend / AppendKv go over shared memory, and the requests sent that way.
  size_t shm_nodes() const;
  uint64_t shm_attends() const { return shm_attends_; }
  uint64_t shm_append_chunks() const { return shm_append_chunks_; }
  const RemoteKvOptions& options() const { return options_; }

 private:
  struct PendingCall {
    grpc::ClientContext context;
    v1::AttendRequest request;
    v1::AttendResponse response;
    grpc::Status status;
    size_t node = 0;
  };
  using Clock = std::chrono::steady_clock;
  RemoteKv(NodePool& pool, const RemoteKvOptions& options);
  std::vector<uint32_t> HeadsOf(size_t node, int64_t layer) const;
  size_t NodeOf(int64_t layer, int64_t kv_head) const;
  absl::Status OpenOn(size_t node, NodeTransport transport, v1::OpenSessionRequest& request);
  absl::Status AppendGrpc(size_t node, int64_t layer, const std::vector<uint32_t>& heads,
                          const void* k, const void* v, const float* maw, int64_t num_tokens,
                          int64_t window_entries);
  absl::Status AppendShm(size_t node, int64_t layer, const std::vector<uint32_t>& heads,
                         const void* k, const void* v, const float* maw, int64_t num_tokens,
                         int64_t window_entries);
  // Sends q over node's channel. kTooLarge: q or the answer exceeds the areas (use gRPC);
  // kBusy: the node has not answered the previous request yet.
  enum class ShmStart { kSent, kBusy, kTooLarge };
  ShmStart StartAttendShm(size_t node, const float* q);
  // Waits for node's shm answer and scatters it; false when it is missing or malformed.
  bool FinishAttendShm(size_t node, float* o, float* lse, LayerSelection* selection);
  // Writes one node's answer (rows h*G+j of its owned heads) into the all-heads o and lse.
  void Scatter(std::span<const uint32_t> kv_heads, const float* src_o, const float* src_lse,
               float* o, float* lse) const;

  NodePool& pool_;
  RemoteKvOptions options_;
  std::vector<bool> opened_;    // per node: OpenSession succeeded
  std::vector<bool> lost_;      // per node: an AppendKv failed, its entries are incomplete
  // Per node: its shared-memory channel, or null when it is served over gRPC.
  std::vector<std::unique_ptr<cpu_attention::ShmChannel>> shm_;
  bool closed_ = false;
  int64_t offloaded_tokens_ = 0;

  // The Attend in flight.
  int64_t attend_layer_ = -1;
  int64_t attend_tokens_ = 0;
  std::vector<std::unique_ptr<PendingCall>> calls_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  size_t outstanding_ = 0;   // guarded by mu_
  std::vector<size_t> shm_calls_;        // nodes with an Attend sent over shm
  Clock::time_point attend_deadline_;

  std::vector<LayerSelection> last_selection_;
  std::vector<double> share_sum_;
  std::vector<uint64_t> share_count_;
  uint64_t degraded_attends_ = 0;
  uint64_t shm_attends_ = 0;
  uint64_t shm_append_chunks_ = 0;
};

}  // namespace tandem::gpu_worker
