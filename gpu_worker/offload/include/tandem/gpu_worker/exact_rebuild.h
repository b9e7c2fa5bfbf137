// Exact mode's recovery from a lost CPU node (issue 16; remote_kv.h, "Failure model").
//
// An ExactTier's node session holds a subset of the offloaded positions (of every batch that
// leaves the window, the entries after the recompute and host shares), not a prefix as a
// hybrid session's does. EntryPositions records which positions those are, in the session's
// append order, so that the lost shards can be rebuilt exactly as in hybrid mode: the engine
// recomputes the K/V of those positions (RecomputeAt: a gpu-mode forward pass over the token
// prefix up to the last of them, keeping only them; kv_recompute.h) and RemoteKv::RebuildLost
// plans the surviving nodes for the lost shards and appends them there.
//
// When no node can take the lost shards (none accepts, or none has room: the placement
// planner's UNAVAILABLE / RESOURCE_EXHAUSTED), the tier gives the nodes up: the K/V of every
// node-held position is recomputed into the host pages (the fetch path), the node session is
// closed and later evictions go to the host and recompute shares only. Attention over the
// offloaded entries does not depend on their order, so host pages holding positions out of
// order attend exactly.
//
// Until a rebuild completes, the lost shards' attends are degraded (empty partial state,
// flagged in the response) and a failed rebuild is retried kRetry later, as in hybrid mode.
//
// Exactness afterwards: a step whose attends were degraded computed the hidden states of its
// positions from incomplete attention, so their K/V above the first layer (and their layer
// inputs x̂, for the recompute share) are not exact, and every later step would read them. The
// tier records the first such position (a degraded attend's first query position) and the
// rebuild's forward pass runs over every token fed so far, rewriting those positions' K/V in
// the device window and their pending layer inputs (RecomputeAtRequest::repair_from), so that
// the sequence is exact again. A degraded node (a missed deadline, not lost) is repaired the
// same way once its attends answer again. Tainted positions that left the window before the
// repair (a prompt chunk larger than the window, or a repair delayed past a window's worth of
// steps) cannot be rewritten where they went: the tier then flags every later attend degraded
// (inexact) rather than answer wrongly in silence.
//
// Not thread-safe: the engine's executor thread, between passes.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/offloaded_kv.h"
#include "tandem/gpu_worker/remote_kv.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {

// What RecomputeAt recomputes: one forward pass over the sequence's tokens up to the end of the
// last run (and up to every token fed so far when repair_from >= 0).
struct RecomputeAtRequest {
  // Positions whose K/V go to the sink: each run first_pos .. first_pos + count - 1 (first_slot
  // ignored), ascending and disjoint; may be empty when repair_from >= 0.
  std::vector<EvictedBlock> runs;
  // >= 0: positions [repair_from, tokens fed) were computed from degraded attention; their K/V
  // in the sequence's window and their layer inputs pending in its tier are rewritten.
  int64_t repair_from = -1;
};
// Runs `request` and calls sink once per layer, in layer order, with k, v: [num_kv_heads,
// Σ count, head_dim] of the window dtype, the runs' entries in the runs' order (no call for
// empty runs). The repair is done before the first sink call.
using RecomputeAt =
    std::function<absl::Status(const RecomputeAtRequest& request, const RebuiltLayerSink& sink)>;

// The positions of a session's entries in append order, as runs of consecutive positions.
class EntryPositions {
 public:
  // Appends entries [from, from + count) of a batch of `blocks` (their entries concatenated in
  // the blocks' order), merging with the last run where positions continue.
  void AddFromBatch(const std::vector<EvictedBlock>& blocks, int64_t from, int64_t count);
  int64_t size() const { return size_; }
  // Runs with first_slot = first_pos (the slot of that position in an unlimited window).
  const std::vector<EvictedBlock>& runs() const { return runs_; }
  void Clear() {
    runs_.clear();
    size_ = 0;
  }

 private:
  void Add(int64_t first_pos, int64_t count);
  std::vector<EvictedBlock> runs_;
  int64_t size_ = 0;
};

// What an ExactTier keeps to rebuild what a lost node held and to repair degraded steps.
struct ExactNodeRecovery {
  static constexpr std::chrono::milliseconds kRetry{200};
  EntryPositions positions;  // of the node session's entries, in its append order
  RecomputeAt recompute;     // null: nothing is rebuilt (the lost entries stay degraded)
  std::chrono::steady_clock::time_point next_try{};
  // The nodes were given up: their entries are in the host pages, the node session is closed.
  bool on_host = false;
  // First position computed from a degraded attend since the last repair; -1: none.
  int64_t first_tainted = -1;
  bool last_attend_degraded = false;  // the last node attend missed some answer
  int64_t evicted_end = 0;            // one past the last position that left the window
  // Tainted positions left the window unrepaired: every later attend is reported degraded.
  bool inexact = false;

  // Records a batch leaving the window whose entries [from, from + count) go to the nodes.
  void NoteEvicted(const std::vector<EvictedBlock>& blocks, int64_t from, int64_t count);
  // Records a node attend's outcome; `q_pos` (device, [rows] i32, ascending): its positions,
  // read (one element, a device sync) only when it starts a taint. The backend's error.
  absl::Status NoteAttend(Backend& backend, const int32_t* q_pos, bool degraded);
  // Whether Rebuild has something to do (a lost shard is RemoteKv's to say).
  bool needs_repair() const { return first_tainted >= 0 && !inexact; }
  // Whether steps now read K/V that degraded attends computed (repairable or not).
  bool tainted() const { return inexact || first_tainted >= 0; }
};

// Between passes: rebuilds the lost shards of `remote` on surviving nodes from K/V that
// recovery.recompute produces at recovery.positions, or, when no node can take them (the
// placement fails before anything is recomputed), moves every node entry into `host` (sets
// recovery.on_host and closes `remote`); and repairs the positions degraded attends computed
// (in the same forward pass; alone once the nodes answer again). Returns whether a recompute
// ran. Nothing to do (no loss or taint, no recompute set, a retry not due yet): false. Errors
// leave the entries lost and the taint in place (degraded; retried after kRetry): the
// recompute's (RESOURCE_EXHAUSTED: no device room for its window now), RESOURCE_EXHAUSTED when
// the host lacks the memory for the fallback, INTERNAL when the positions do not match the
// session.
absl::StatusOr<bool> RebuildExactNodes(RemoteKv& remote, OffloadedKv& host,
                                       ExactNodeRecovery& recovery);

}  // namespace tandem::gpu_worker
