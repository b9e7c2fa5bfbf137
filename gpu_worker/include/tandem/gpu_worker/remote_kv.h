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
// Not thread-safe: one thread (the engine's executor) drives a RemoteKv; the gRPC completions
// of StartAttend land on gRPC threads and are joined by FinishAttend.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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
  const RemoteKvOptions& options() const { return options_; }

 private:
  struct PendingCall {
    grpc::ClientContext context;
    v1::AttendRequest request;
    v1::AttendResponse response;
    grpc::Status status;
    size_t node = 0;
  };
  RemoteKv(NodePool& pool, const RemoteKvOptions& options);
  std::vector<uint32_t> HeadsOf(size_t node, int64_t layer) const;
  size_t NodeOf(int64_t layer, int64_t kv_head) const;

  NodePool& pool_;
  RemoteKvOptions options_;
  std::vector<bool> opened_;    // per node: OpenSession succeeded
  std::vector<bool> lost_;      // per node: an AppendKv failed, its entries are incomplete
  bool closed_ = false;
  int64_t offloaded_tokens_ = 0;

  // The Attend in flight.
  int64_t attend_layer_ = -1;
  int64_t attend_tokens_ = 0;
  std::vector<std::unique_ptr<PendingCall>> calls_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  size_t outstanding_ = 0;   // guarded by mu_

  std::vector<LayerSelection> last_selection_;
  std::vector<double> share_sum_;
  std::vector<uint64_t> share_count_;
  uint64_t degraded_attends_ = 0;
};

}  // namespace tandem::gpu_worker
