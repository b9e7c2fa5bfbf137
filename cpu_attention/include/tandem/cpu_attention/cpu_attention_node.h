// CpuAttentionNode: the CPU attention service's logic, independent of gRPC, so the GPU worker
// can embed a node in-process and the gRPC adapter (grpc_service.h) can serve it remotely with
// the same behaviour. Requests and responses are the proto messages of
// proto/tandem/v1/cpu_attention.proto; that file states the semantics and layouts.
//
// Every method validates its request completely (shapes, dtypes, ranges, finiteness, sizes
// against the limits below) before allocating or changing anything and answers a Status with a
// message; a bad request never aborts the process. Thread-safe: methods may be called
// concurrently from any number of threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/kv_store/kv_store.h"
#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::cpu_attention {

struct NodeOptions {
  uint64_t pool_bytes = 1ull << 30;  // budget for KV blocks + selected copies
  uint32_t block_tokens = 64;        // default block size (16..256)
  unsigned threads = 0;              // attention threads; 0 = cores this process may use
  uint32_t max_sessions = 4096;
  uint32_t max_query_tokens = 4096;     // per AttendQuery / ReselectRequest
  uint32_t max_batch = 256;             // queries per AttendRequest
  uint32_t chunk_keys = 2048;           // keys per matmul chunk (see sparse_attention.h)
};

class CpuAttentionNode {
 public:
  // INVALID_ARGUMENT for out-of-range options.
  static absl::StatusOr<std::unique_ptr<CpuAttentionNode>> Create(const NodeOptions& options);

  absl::Status OpenSession(const v1::OpenSessionRequest& request,
                           v1::OpenSessionResponse* response);
  // Applies one message of the AppendKv stream and adds its counts to `totals`.
  absl::Status AppendKv(const v1::AppendKvRequest& request, v1::AppendKvResponse* totals);
  absl::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response);
  absl::Status Reselect(const v1::ReselectRequest& request, v1::ReselectResponse* response);
  absl::Status CloseSession(const v1::CloseSessionRequest& request,
                            v1::CloseSessionResponse* response);
  v1::StatsResponse Stats() const;

  const NodeOptions& options() const { return options_; }
  kv_store::KvStore& store() { return store_; }

 private:
  explicit CpuAttentionNode(const NodeOptions& options);
  void RecordScan(uint64_t bytes, double seconds);

  const NodeOptions options_;
  kv_store::KvStore store_;
  ThreadPool pool_;

  std::atomic<uint64_t> attend_calls_{0};
  std::atomic<uint32_t> attend_in_flight_{0};
  mutable std::mutex scan_mu_;
  double scan_bytes_per_second_ = 0.0;  // exponential moving average, guarded by scan_mu_
};

}  // namespace tandem::cpu_attention
