// ShardMigrator: copies a session's (layer, kv-head) shards from one CPU node to another in the
// background while the session keeps decoding (issue 5: "copy, switch, free").
//
// A job copies entries [0, held) of the shard on `from` (ExportShard: K, V, MAW and each entry's
// selected flag) into the empty shard that RemoteKv already added on `to` (AppendKv with
// explicit `selected`, so the copy selects exactly what the source selects, after a Reselect
// too). The session goes on appending to `from` meanwhile; the entries appended after the bulk
// copy started are the tail, which RemoteKv copies with CopyRange between two steps (no append
// can race it there), before it switches the shard's Attend and Append traffic to `to` and drops
// the shard on `from`.
//
// One background thread per migrator, jobs in FIFO order (one copy at a time keeps the node's
// memory bandwidth for Attend). Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/dtype.h"
#include "tandem/gpu_worker/node_pool.h"

namespace tandem::gpu_worker {

struct MigrationJob {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  size_t from = 0;   // NodePool indices
  size_t to = 0;
};

struct ShardMigratorOptions {
  std::string session_id;   // the session id on the nodes
  int64_t head_dim = 0;
  DType kv_dtype = DType::kBF16;
  int deadline_ms = 30000;              // per ExportShard / AppendKv stream
  uint32_t chunk_entries = 4096;        // entries per exported chunk
};

class ShardMigrator {
 public:
  ShardMigrator(NodePool& pool, const ShardMigratorOptions& options);
  ~ShardMigrator();   // cancels queued jobs and waits for the one in progress
  ShardMigrator(const ShardMigrator&) = delete;
  ShardMigrator& operator=(const ShardMigrator&) = delete;

  void Enqueue(const MigrationJob& job);

  struct Finished {
    MigrationJob job;
    uint64_t copied = 0;   // entries [0, copied) are on `to`
    double seconds = 0;    // wall time of the bulk copy
    absl::Status status;   // not OK: the copy failed part way (the target shard is partial)
  };
  // Jobs whose bulk copy ended since the last call.
  std::vector<Finished> TakeFinished();
  // Jobs queued or being copied.
  size_t pending() const;
  // Drops the queued jobs and waits for the one in progress; returns the dropped and the
  // interrupted jobs (their target shards are partial).
  std::vector<MigrationJob> CancelAll();

  // Copies entries [from_entry, held) of the job's shard from `from` to `to` now, on the
  // calling thread; returns the new copied count (held when the export started).
  absl::StatusOr<uint64_t> CopyRange(const MigrationJob& job, uint64_t from_entry);

  uint64_t bytes_copied() const;   // K + V + MAW bytes moved so far

 private:
  void Loop();

  NodePool& pool_;
  const ShardMigratorOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<MigrationJob> queue_;      // guarded by mu_
  bool busy_ = false;                   // a job is being copied; guarded by mu_
  bool cancel_ = false;                 // abandon the job in progress; guarded by mu_
  bool stop_ = false;                   // guarded by mu_
  // The calls of the copy in progress: cancelled at once by CancelAll and the destructor (a
  // node that stopped answering must not hold them until the deadline). Guarded by mu_.
  grpc::ClientContext* active_export_ = nullptr;
  grpc::ClientContext* active_append_ = nullptr;
  void CancelActiveLocked();
  std::vector<Finished> finished_;      // guarded by mu_
  uint64_t bytes_copied_ = 0;           // guarded by mu_
  std::thread thread_;
};

}  // namespace tandem::gpu_worker
