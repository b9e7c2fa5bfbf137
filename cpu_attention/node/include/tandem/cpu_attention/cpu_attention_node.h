// CpuAttentionNode: the CPU attention service's logic, independent of gRPC, so the GPU worker
// can embed a node in-process and the gRPC adapter (grpc_service.h) can serve it remotely with
// the same behaviour. Requests and responses are the proto messages of
// proto/tandem/v1/cpu_attention.proto; that file states the semantics and layouts.
//
// The class's definitions: cpu_attention_node.cc (creation, sessions, appends, leases, stats),
// node_attend.cc (Attend, AttendRaw, Reselect), node_migration.cc (ReshardSession, exports).
//
// Every method validates its request completely (shapes, dtypes, ranges, finiteness, sizes
// against the limits below) before allocating or changing anything and answers a Status with a
// message; a bad request never aborts the process. Thread-safe: methods may be called
// concurrently from any number of threads.
//
// Selection: MAW sessions attend over their selected copies (sparse_attention.h); pages
// sessions (OpenSessionRequest.selection = SELECTION_PAGES) keep no selected copy and attend over
// the pages each query names, read in place from the blocks (paged_attention.h). Reselect on a
// pages session is FAILED_PRECONDITION.
//
// Shared memory: an OpenSessionRequest with `shm` makes the node map that channel and serve the
// session's Attend and AppendKv from it on a thread of its own (shm_session_server.h), through
// AttendRaw / AppendKvRaw below, until CloseSession or the node's destruction.
//
// Shard migration and draining: ReshardSession changes a session's owned shards, ExportShard /
// StartExport read a shard's entries out in chunks, AppendKv with `selected` imports them with
// their flags. SetDraining(true) makes the node refuse new sessions and shards (UNAVAILABLE)
// while it keeps serving everything else.
//
// Leases: sessions opened with a SessionLease close when it lapses or a newer incarnation of its
// holder supersedes it (cpu_attention.proto, "Leases"), on a reaper thread of the node that
// sleeps until the next deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/kv_store/free_memory_releaser.h"
#include "tandem/kv_store/kv_store.h"
#include "tandem/security/authenticator.h"
#include "tandem/v1/cpu_attention.pb.h"

namespace tandem::metrics {
struct NodeMetrics;
}  // namespace tandem::metrics

namespace tandem::cpu_attention {

struct NodeOptions {
  uint64_t pool_bytes = 1ull << 30;  // budget for KV blocks + selected copies
  uint32_t block_tokens = 64;        // default block size (16..256)
  unsigned threads = 0;              // attention threads; 0 = cores this process may use
  uint32_t max_sessions = 4096;
  // Sessions one principal (caller identity, see "Ownership" above) may hold; 0 = no bound
  // but max_sessions.
  uint32_t max_sessions_per_principal = 0;
  uint32_t max_query_tokens = 4096;     // per AttendQuery / ReselectRequest
  uint32_t max_batch = 256;             // queries per AttendRequest
  uint32_t chunk_keys = 2048;           // keys per matmul chunk (see sparse_attention.h)
  // Ranges per attention thread one Attend's entries are cut into, 1..64: more even out threads
  // that start late or run slow, fewer cost less per range (range_count.h bounds them on
  // multi-token calls by the partial states they keep). Paged attends
  // (PagedParams::tasks_per_thread): the scan's streams claim ranges as they go, so 2, 4 and 8
  // measured alike and 2 stays. Dense attends (AttentionParams): equal static ranges, where
  // 8 per thread beat 2 on a 16-core host (BENCHMARKS, issue 24: 0.70–0.91 of the read rate
  // against 0.61–0.69 on the AVX2 path, 0.73–0.83 against 0.49–0.65 with oneDNN).
  uint32_t tasks_per_thread = 2;
  uint32_t dense_tasks_per_thread = 8;
  // Entries a paged scan prefetches ahead of the one it reads (PagedParams::prefetch_entries,
  // 0..4096): a stream's first range issues this many rows' prefetches at once, so long
  // distances clog the first wave of a call (BENCHMARKS "Issue 27 at its close").
  uint32_t prefetch_entries = 256;
  // Attention threads spin this long after a call, watching for the next, before they sleep
  // (ThreadPool): the per-layer calls of a decode step then skip the wake-ups (0..100000). 0 for
  // a node sharing its cores (the worker's embedded node); tandem-cpu-attention sets 100.
  uint32_t pool_spin_us = 0;
  bool allow_shm = true;                // serve shm channels requested at OpenSession
  uint32_t shm_spin_us = 10;            // a channel thread spins this long before sleeping
  // KV blocks free this long give their pages back to the kernel (kv_store::FreeMemoryReleaser);
  // negative: never (free blocks stay resident until reused).
  std::chrono::milliseconds release_free_after{30000};
  // Back KV blocks with transparent huge pages (kv_store::BlockPool): a fresh block's first
  // write faults 2 MiB at once, not 4 KiB (BENCHMARKS "Settle appends at memory speed").
  bool huge_pages = true;
  // Free block bytes kept faulted in while sessions hold blocks (kv_store::BlockWarmer), so a
  // settle's appends copy at memory speed, not a page fault per 4 KiB; 0: none.
  uint64_t warm_reserve_bytes = 512ull << 20;
  // How KV blocks are stored (--node_kv_dtype): kBf16 = as each session sends it (its kv_dtype,
  // bf16 or f32); kInt8 = 8-bit rows with a per-row scale (kv_store/int8_rows.h), quantised on
  // AppendKv and dequantised to the session's kv_dtype by ExportShard, so the wire and the
  // worker are unchanged and a shard migrates between int8 and bf16 nodes either way.
  kv_store::KvDType kv_dtype = kv_store::KvDType::kBf16;
  // Prometheus counters (tandem/metrics/node_metrics.h): attends by transport (Attend: grpc,
  // AttendRaw: shm) and scanned bytes, counted as they are served; null: none. Not owned; must
  // outlive the node.
  const metrics::NodeMetrics* metrics = nullptr;
};

// The value of a --node_kv_dtype flag: "bf16" -> kBf16, "int8" -> kInt8; INVALID_ARGUMENT
// naming the accepted values otherwise.
absl::StatusOr<kv_store::KvDType> ParseNodeKvDType(absl::string_view name);

// Caller-owned arrays AttendRaw fills, sized for the session's owned kv heads of the layer
// (H_own of them) and the query's T tokens; rows are ordered as in v1::AttendResult.
struct RawAttendOutput {
  std::span<float> o;            // [T, H_own * G, D]
  std::span<float> lse;          // [T, H_own * G]
  std::span<uint32_t> kv_heads;  // [H_own], ascending
  std::span<uint64_t> selected;  // [H_own]
  std::span<uint64_t> held;      // [H_own]
  uint64_t compute_micros = 0;   // set by AttendRaw
  uint64_t bytes_scanned = 0;    // set by AttendRaw
};

class ShmSessionServer;
class CpuAttentionNode;
namespace internal {
class SessionOwners;
class SessionLeases;
}  // namespace internal

// An ExportShard in progress: the validated range and the next entry to read. Made by
// CpuAttentionNode::StartExport; each Next() reads one chunk under the session's shared lock
// only, so Attend is not blocked for the whole export. Not thread-safe (one stream uses it);
// the node must outlive it.
class ShardExport {
 public:
  bool done() const { return next_ >= end_; }
  uint64_t next_entry() const { return next_; }
  uint64_t end_entry() const { return end_; }
  uint32_t chunk_entries() const { return chunk_entries_; }

  // Fills `chunk` with the next min(chunk_entries(), end - next) entries (see
  // v1::ExportShardChunk). NOT_FOUND if the session was closed meanwhile, ABORTED if the shard
  // was dropped (or dropped and added again) since the export started, FAILED_PRECONDITION
  // when done().
  absl::Status Next(v1::ExportShardChunk* chunk);

 private:
  friend class CpuAttentionNode;
  ShardExport() = default;

  std::shared_ptr<kv_store::Session> session_;
  kv_store::ShardKey key_;
  uint64_t serial_ = 0;  // Shard::serial() of the exported shard
  uint64_t next_ = 0;
  uint64_t end_ = 0;
  uint32_t chunk_entries_ = 0;
};

class CpuAttentionNode {
 public:
  // INVALID_ARGUMENT for out-of-range options.
  static absl::StatusOr<std::unique_ptr<CpuAttentionNode>> Create(const NodeOptions& options);

  absl::Status OpenSession(const v1::OpenSessionRequest& request,
                           v1::OpenSessionResponse* response,
                           const std::string& caller = security::kAnonymous);
  // Applies one message of the AppendKv stream and adds its counts to `totals`.
  absl::Status AppendKv(const v1::AppendKvRequest& request, v1::AppendKvResponse* totals,
                        const std::string& caller = security::kAnonymous);
  absl::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response,
                      const std::string& caller = security::kAnonymous);
  absl::Status Reselect(const v1::ReselectRequest& request, v1::ReselectResponse* response,
                        const std::string& caller = security::kAnonymous);
  absl::Status CloseSession(const v1::CloseSessionRequest& request,
                            v1::CloseSessionResponse* response,
                            const std::string& caller = security::kAnonymous);
  v1::StatsResponse Stats() const;
  // Renews the caller's lease, closing the sessions of the holder's older incarnations
  // (see the proto for the errors).
  absl::Status RenewLease(const v1::RenewLeaseRequest& request, v1::RenewLeaseResponse* response,
                          const std::string& caller = security::kAnonymous);
  // Adds empty shards and drops owned ones (see the proto for the errors). Atomic.
  absl::Status ReshardSession(const v1::ReshardSessionRequest& request,
                              v1::ReshardSessionResponse* response,
                              const std::string& caller = security::kAnonymous);

  // Most bytes of one ExportShardChunk (K + V + MAW + flags) by default.
  static constexpr uint64_t kMaxExportChunkBytes = 16ull << 20;
  // Validates an ExportShard request (errors as in the proto) and fixes its range (to_entry 0 =
  // the shard's held count now). A chunk holds at most max_chunk_entries entries and at most
  // `max_chunk_bytes` bytes of K + V + MAW + flags (at least one entry).
  absl::StatusOr<ShardExport> StartExport(const v1::ExportShardRequest& request,
                                          uint64_t max_chunk_bytes = kMaxExportChunkBytes,
                                          const std::string& caller = security::kAnonymous);
  // The whole export in the calling thread: `emit` gets each chunk in order. Stops at the first
  // error of the export or of `emit`, and returns it.
  absl::Status ExportShard(const v1::ExportShardRequest& request,
                           absl::FunctionRef<absl::Status(const v1::ExportShardChunk&)> emit,
                           uint64_t max_chunk_bytes = kMaxExportChunkBytes);

  // Draining: OpenSession and ReshardSession with shards to add answer UNAVAILABLE; every other
  // call keeps working; Stats().draining() tells. Thread-safe.
  void SetDraining(bool draining) { draining_.store(draining, std::memory_order_relaxed); }
  bool draining() const { return draining_.load(std::memory_order_relaxed); }
  // Random 16 hex digits chosen when the node was created (StatsResponse.node_id).
  const std::string& node_id() const { return node_id_; }

  // Pool bytes a session's bookkeeping is charged (OpenSession; kept in step with the owned
  // shards by ReshardSession): `num_layers` of the geometry, `num_shards` owned.
  static uint64_t SessionMetadataBytes(uint64_t num_layers, uint64_t num_shards);

  ~CpuAttentionNode();   // stops every shm channel thread first

  // Raw-pointer forms of Attend (one query) and AppendKv for the shared-memory transport: no
  // protobuf per call, the same validation and errors as the proto methods (they share the
  // code). `q` is [num_tokens, H_q, D] f32; `out` must be sized for the layer (see
  // RawAttendOutput; INVALID_ARGUMENT otherwise). The inputs may live in memory another process
  // writes concurrently: q and maw are copied before they are validated.
  // `pages`, `pages_per_head`: as AttendQuery.pages / pages_per_head (int32
  // [num_tokens, H_kv, pages_per_head], SELECTION_PAGES sessions only); copied before they are
  // validated.
  absl::Status AttendRaw(const std::string& session_id, uint32_t layer, std::span<const float> q,
                         uint32_t num_tokens, RawAttendOutput* out,
                         std::span<const int32_t> pages = {}, uint32_t pages_per_head = 0);
  // As above, with the output arrays chosen once the layer's owned kv heads are known, under
  // the session's lock (a concurrent ReshardSession cannot change them in between):
  // `output_for(H_own)` returns the arrays to fill, sized as RawAttendOutput says, or an error
  // that AttendRaw returns. compute_micros and bytes_scanned are set in the arrays it returned.
  using RawOutputFor = absl::FunctionRef<absl::StatusOr<RawAttendOutput*>(size_t num_heads)>;
  absl::Status AttendRaw(const std::string& session_id, uint32_t layer, std::span<const float> q,
                         uint32_t num_tokens, RawOutputFor output_for,
                         std::span<const int32_t> pages = {}, uint32_t pages_per_head = 0);
  // k, v: [kv_heads.size(), n, D] of the session's kv dtype (as sent, also on an int8 node); maw: [kv_heads.size(), n] f32
  // bytes (any alignment). Empty kv_heads = all owned kv heads of the layer.
  absl::Status AppendKvRaw(const std::string& session_id, uint32_t layer,
                           std::span<const uint32_t> kv_heads, std::span<const std::byte> k,
                           std::span<const std::byte> v, std::span<const std::byte> maw,
                           uint32_t n, uint32_t window_entries, v1::AppendKvResponse* totals);

  const NodeOptions& options() const { return options_; }
  kv_store::KvStore& store() { return store_; }

 private:
  explicit CpuAttentionNode(const NodeOptions& options);
  void RecordScan(uint64_t bytes, double seconds);
  // The store's pool budget, which session metadata is charged to as well.
  kv_store::MemoryBudget& Budget();

  // The parts the proto and raw paths share.
  struct AttendItem;
  struct HeadCount {
    uint32_t kv_head;
    uint64_t selected;
    uint64_t held;
  };
  struct AttendTarget {
    float* o;     // [T, H_own * G, D]
    float* lse;   // [T, H_own * G]
  };
  // Called once per item under the sessions' locks, before any computation: returns where the
  // item's output goes, given its owned heads and their counters.
  using AttendSink = absl::FunctionRef<absl::StatusOr<AttendTarget>(
      size_t item, const kv_store::Session& session, uint32_t num_tokens,
      std::span<const HeadCount> heads)>;
  absl::Status AttendItems(uint32_t layer, std::vector<AttendItem>& items, AttendSink sink,
                           uint64_t* compute_micros, uint64_t* bytes_scanned);
  struct AppendTarget;
  absl::StatusOr<AppendTarget> ResolveAppend(const std::string& session_id, uint32_t layer,
                                             std::span<const uint32_t> kv_heads);
  // `selected`: empty, or [heads, n] flags that replace the MAW rule.
  absl::Status ApplyAppend(AppendTarget& target, uint32_t layer, const std::byte* k,
                           const std::byte* v, const std::byte* maw, uint32_t n,
                           uint32_t window_entries, std::span<const uint8_t> selected,
                           v1::AppendKvResponse* totals);
  // Maps the requested channel for a just-opened session; sets transport in `response`.
  void StartShm(const std::shared_ptr<kv_store::Session>& session, const v1::ShmChannelSpec& spec,
                v1::OpenSessionResponse* response);
  // Closes a session whatever its owner (after the owner check, or for a lapsed or superseded
  // lease): its shm channel, blocks, charge, owner and lease records. Returns the blocks
  // released; NOT_FOUND when it is not open.
  absl::StatusOr<uint64_t> CloseOpenSession(const std::string& id);
  // Closes sessions of a lapsed or superseded lease; `why` goes to the log.
  void CloseExpired(const std::vector<std::string>& ids, const char* why);
  void ReapLapsedLeases();   // the reaper thread's loop

  const NodeOptions options_;
  const std::string node_id_;
  kv_store::KvStore store_;
  std::unique_ptr<kv_store::FreeMemoryReleaser> releaser_;   // null: release_free_after < 0
  ThreadPool pool_;
  std::atomic<bool> draining_{false};
  std::unique_ptr<internal::SessionOwners> owners_;
  std::unique_ptr<internal::SessionLeases> leases_;
  std::atomic<uint64_t> sessions_expired_{0};

  std::atomic<uint64_t> attend_calls_{0};
  std::atomic<uint32_t> attend_in_flight_{0};
  mutable std::mutex scan_mu_;
  double scan_bytes_per_second_ = 0.0;  // exponential moving average, guarded by scan_mu_

  std::atomic<uint64_t> shm_requests_{0};
  // Declared last so the channel threads stop before the store and pool they use go away.
  mutable std::mutex shm_mu_;
  std::map<std::string, std::unique_ptr<ShmSessionServer>> shm_servers_;  // by session id
  std::thread lease_reaper_;   // started last, stopped first (the destructor)
};

}  // namespace tandem::cpu_attention
