// Sequence: the state of one token sequence (a session) on the GPU worker: its window of KV on
// the device, the tier that holds the rest (CPU nodes in hybrid mode, pinned host memory in
// offload mode; none in gpu mode), the tokens fed so far and the counters a response reports.
// Owned by the engine; driven by ModelRunner.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {

enum class AttentionMode {
  kGpu,     // all KV on the device (the exact baseline)
  kHybrid,  // sink + recent window on the device, the rest on CPU nodes (HGCA)
  kOffload, // sink + recent window on the device, the rest in host memory, streamed every step
  kExact,   // sink + recent window on the device, the rest split by a planner between host
            // memory streamed every step and CPU nodes attending densely (ExactTier)
};

// "gpu" / "hybrid" / "offload" / "exact" (case-insensitive) -> mode; INVALID_ARGUMENT otherwise.
absl::StatusOr<AttentionMode> ParseAttentionMode(std::string_view name);
std::string_view AttentionModeName(AttentionMode mode);

struct Sequence {
  Sequence(std::string id, AttentionMode mode, WindowCache window)
      : id(std::move(id)), mode(mode), window(std::move(window)) {}

  std::string id;
  AttentionMode mode;
  WindowCache window;
  // The KV beyond the window: NodeTier (hybrid), HostTier (offload), ExactTier (exact), null
  // (gpu).
  std::unique_ptr<OffloadTier> offload;
  std::vector<int32_t> tokens;        // every token fed through the model, in position order
  // A sampled token not fed yet (it is fed at the start of the next step or turn).
  std::optional<int32_t> pending_token;
  // Device prefill: the position after the current prompt's last token. While the window is
  // widened (WindowCache::Widen) the runner narrows it after the pass that reaches it.
  int64_t prefill_end = 0;
  // Set when a new turn appends a prompt: its first forward pass re-selects the offloaded
  // entries of every layer with the new queries (HGCA Alg. 1 line 21), with this beta if set.
  bool reselect_pending = false;
  std::optional<float> reselect_beta;
  uint64_t degraded_steps = 0;        // layer attends in which some CPU node did not answer
  // A runner pass over it is under way (ModelRunner sets it for the pass; a pass paused for an
  // interlude, pass_breaks.h, included): its tokens and window already hold the pass's tokens
  // but their KV is written only up to the layer reached, so nothing may fork or read them.
  bool in_pass = false;
  CapturedMass captured_mass;         // selection = pages, when the runner measures it

  // What the engine asks of the offloaded part, whatever holds it (no-ops without one):
  // room for `tokens` offloaded entries per (layer, kv head) (RESOURCE_EXHAUSTED otherwise);
  // between-step upkeep (placement re-plans, migrations; failures are logged, not fatal);
  // closing; the mean selected/held share per layer over the sequence's life (hybrid).
  absl::Status ReserveOffloaded(int64_t tokens);
  void MaintainOffloaded();
  absl::Status CloseOffloaded();
  std::vector<double> MeanSelectedShare() const;

  // Keeps the first `positions` tokens and forgets the rest and the pending token (a cached
  // session reused by a prompt that shares only that prefix). The forgotten tokens must all be
  // on the device (WindowCache::Truncate): FAILED_PRECONDITION otherwise, leaving it unchanged.
  absl::Status TruncateTo(int64_t positions);

  // A sequence `id` that continues this one's first `positions` tokens, this one unchanged (a
  // fork of a cached prefix: several requests over one document, prefix_cache.h). Its window is
  // WindowCache::Fork(positions, max_context); its tier this one's OffloadTier::Fork with what
  // `tier_fork` gives for the new sequence (its rebuild hook refers to it); its tokens,
  // counters start at 0. Between passes only.
  // INVALID_ARGUMENT beyond the tokens held; either fork's error (UNIMPLEMENTED: a tier that
  // cannot fork; FAILED_PRECONDITION: positions after `positions` have left the device).
  using TierForkFor = std::function<TierFork(Sequence& fork)>;
  absl::StatusOr<std::unique_ptr<Sequence>> Fork(std::string fork_id, int64_t positions,
                                                 int64_t max_context,
                                                 const TierForkFor& tier_fork) const;

  // Parking (a cached session when the device needs its memory, DESIGN "KV reuse across
  // requests"): the window and the page summaries move into `pool` (pinned host memory) and
  // free their device memory; the offloaded part stays where its tier holds it (CPU nodes,
  // host pages). Unpark() brings them back over PCIe before the sequence runs again. Between
  // passes only; either leaves the sequence as it was when it fails (RESOURCE_EXHAUSTED for
  // memory, FAILED_PRECONDITION for a widened or settling window).
  absl::Status Park(ParkingPool& pool);
  absl::Status Unpark();
  bool parked() const { return window.parked(); }
  size_t ParkBytes() const;      // bytes Park() copies to the host now
  size_t parked_bytes() const;   // pool bytes held while parked
  size_t resident_bytes() const;  // device bytes of window and summaries once on the device

  // Device bytes of its window and page summaries now (0 while parked): what the engine's
  // --kv_cache_bytes admission counts.
  size_t device_bytes() const;
  // The tier that holds this prompt's spill is dropped once the prompt is in
  // (OffloadTier::ReleaseAfterPrefill); a no-op for other tiers.
  void EndPrefillSpill();

  int64_t device_entries() const { return window.entries(); }
  int64_t offloaded_entries() const { return offload ? offload->offloaded_tokens() : 0; }

 private:
  ParkingPool* parked_in_ = nullptr;   // while parked: the pool that holds it
};

}  // namespace tandem::gpu_worker
