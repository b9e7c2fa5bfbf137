// OffloadTier: where one sequence's KV beyond its device window lives, as the runner sees it.
//
// The runner keeps a window of recent KV on the device and attends over it; everything older is
// in a tier. For every layer of a forward pass it asks the tier for the partial attention state
// (O, LSE) of the same query rows over the offloaded KV and merges it into the window's state
// with the exact LSE merge, whatever the tier is:
//
//   NodeTier (node_tier.h)   CPU attention nodes hold the KV and attend where it lives; q goes
//                            out at StartAttend, (O, LSE) come back at FinishAttend, are uploaded
//                            and merged (hybrid mode; MAW or page selection).
//   HostTier (host_tier.h)   pinned host pages streamed over PCIe every step and attended on the
//                            device at FinishAttend, merged page by page (offload mode; exact).
//
// A pass, per sequence that has a tier and offloaded entries:
//   BeginPass(context, stream)          once, before the first layer
//   per layer, for the segments of a micro-batch together:
//     PrepareAttend(rows) of each; context.FlushDownloads(); StartAttend(rows) of each;
//     ...window attention queued on the device...
//     (RunnerOptions::speculate_pages: Speculate(next layer's rows) of each that speculates;
//     context.FlushSelects())
//     FinishAttend(rows) of each (or CancelAttend(rows) after an error elsewhere: nothing may
//     outlive the pass); context.FlushMerges()
// and after the pass Append() of the window blocks that leave the device.
//
// PrepareAttend queues device work and the downloads StartAttend needs (q, chosen page ids):
// the context runs the downloads of all segments at once, so the host waits for the device
// once per layer and micro-batch, not once per sequence. StartAttend should return quickly:
// what runs off the device (the CPU nodes) overlaps with the device's work until FinishAttend.
// off_device_work() tells the runner how much such work a row brings, so that it can split a
// batch into micro-batches that alternate (DESIGN "ping-pong").
//
// Not thread-safe: the engine's executor thread drives the runner, the tiers and the context.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {

class PageIndex;
struct PagePolicy;

// Share of the offloaded softmax mass the chosen pages captured, per layer (sum over query
// rows of exp(lse_selected - lse_all), and the rows): RunnerOptions::measure_captured_mass.
struct CapturedMass {
  std::vector<double> sum;
  std::vector<uint64_t> count;
};

// Where the host thread spent a pass's offloaded attention time (seconds, summed over layers
// and passes). q_download waits for the device to finish the work queued before it and copies
// q and the chosen page ids (FlushDownloads); select queues page selection on the device;
// cpu_wait is time blocked on CPU nodes in FinishAttend; merge_upload copies their partial
// states to the device and queues the merges (FlushMerges). Of the CPU nodes' side (NodeTier):
// attend_round_trip is from sending q (StartAttend) to holding the answer, node_handle the
// slowest shm node's whole time serving it (checks, planning, its kernels, the answer's
// layout), node_compute that node's time in its kernels alone (from waking its threads). The
// round trip beyond node_handle is the channel's, plus the host's own work between StartAttend
// and FinishAttend (launches) where that outlasted the node.
struct OffloadProfile {
  double q_download_s = 0.0;
  double select_s = 0.0;
  double cpu_wait_s = 0.0;
  double merge_upload_s = 0.0;
  double attend_round_trip_s = 0.0;
  double node_handle_s = 0.0;
  double node_compute_s = 0.0;
  // Evicted blocks leaving the window for the tier (evictions and settle slices), summed: the
  // page index's part (summaries, low-rank keys), the blocks' download to host staging, and the
  // tier's append of them (CPU nodes, host pages). A node tier's appends overlap the next
  // layer's download (TierContext::ReadEvicted), so read + append may exceed the wall time.
  double evict_index_s = 0.0;
  double evict_read_s = 0.0;
  double evict_append_s = 0.0;
};

// What a sequence asks of its tier's attention in this pass (from Sequence).
struct AttendPolicy {
  // A new turn: re-evaluate the offloaded entries' salience with these queries (HGCA Alg. 1
  // line 21; MAW selection), with this beta if set.
  bool reselect = false;
  std::optional<float> reselect_beta;
  CapturedMass* captured_mass = nullptr;      // where to record RunnerOptions::measure_captured_mass
};

// One segment's query rows at one layer, and the buffers their offloaded attention may use.
// All pointers stay valid from StartAttend to FinishAttend / CancelAttend.
struct AttendRows {
  int64_t layer = 0;
  // The window attention of these rows: q (device, post-RoPE, rows of q_row_stride floats whose
  // first num_q_heads·head_dim are the query heads), q_pos, num_tokens, head counts, scale, and
  // o [num_tokens, num_q_heads, head_dim] / lse [num_tokens, num_q_heads] (device), which hold
  // the window's partial state once the window attention queued after StartAttend has run.
  // FinishAttend merges the tier's state into o and lse.
  WindowAttentionParams window;
  // Host staging: q_host, o_host [num_tokens, num_q_heads, head_dim], lse_host [.., num_q_heads].
  float* q_host = nullptr;
  float* o_host = nullptr;
  float* lse_host = nullptr;
  // Device scratch for a partial state before its merge, the shapes of o and lse.
  float* part_o = nullptr;
  float* part_lse = nullptr;
  AttendPolicy policy;
  size_t stream = 0;   // the segment's index in the pass (the order of BeginPass / FinishAttend)
};

// Pass-wide work that the tiers of one pass share and that the runner knows nothing of (the
// host tiers' page streamer, offload/host_page_streams.h). Made by the first tier that needs it
// (TierContext::AddShared) and kept by the context for its life. The context tells it when a
// pass begins (BeginPass: forget the last plan, which a failed pass may have left unfinished)
// and when every tier's BeginPass has run (StartPass: queue the pass's first work).
class PassShared {
 public:
  virtual ~PassShared() = default;
  virtual void BeginPass(size_t segments) = 0;
  virtual absl::Status StartPass() = 0;
};

// What the tiers of one runner share: the backend, device scratch for page selection, batched
// downloads, merges and selections, host staging for evictions, the PassShared work of tiers,
// options and profile counters. Owned by a ModelRunner; one pass at a time.
class TierContext {
 public:
  // num_q_heads: of the model; max_rows: most query rows of one pass.
  TierContext(Backend& backend, int64_t num_q_heads, int64_t max_rows,
              bool measure_captured_mass);
  ~TierContext();
  TierContext(const TierContext&) = delete;
  TierContext& operator=(const TierContext&) = delete;

  Backend& backend() { return backend_; }
  int64_t num_q_heads() const { return num_q_heads_; }
  int64_t max_rows() const { return max_rows_; }
  bool measure_captured_mass() const { return measure_captured_mass_; }
  OffloadProfile& profile() { return profile_; }
  const OffloadProfile& profile() const { return profile_; }

  // --- Pass planning. BeginPass(n) starts a pass of n segments: every PassShared forgets its
  // last plan; then each tier's BeginPass (segment index `stream` < n) adds its work, and
  // StartPass() lets every PassShared queue its first work.
  void BeginPass(size_t segments);
  absl::Status StartPass();
  // The PassShared of type T (a class deriving from PassShared), null if none was added.
  template <typename T>
  T* FindShared() {
    for (const auto& s : shared_) {
      if (auto* found = dynamic_cast<T*>(s.get())) return found;
    }
    return nullptr;
  }
  template <typename T>
  const T* FindShared() const {
    return const_cast<TierContext*>(this)->FindShared<T>();
  }
  // Keeps `shared` for the context's life; one added during a pass joins it at once (its
  // BeginPass with the pass's segment count runs here). Returns it.
  template <typename T>
  T* AddShared(std::unique_ptr<T> shared) {
    T* raw = shared.get();
    raw->BeginPass(pass_segments_);
    shared_.push_back(std::move(shared));
    return raw;
  }

  // --- Page selection scratch (device; grown on demand, contents unspecified), shared by the
  // selections queued one after the other on the device. Valid until the next call.
  absl::StatusOr<void*> SelectScratch(size_t bytes);
  // Queues a page selection of this micro-batch phase; the queued ones run as one
  // Backend::SelectPagesBatch per selection phase (0, then 1: a selection that keeps the pages
  // of another, SelectPagesParams::keep, queues after it) at FlushSelects, which FlushDownloads
  // calls first (so the ids are chosen before they are downloaded). p.scratch is ignored: each
  // queued selection gets its own SelectPagesScratchBytes(p.num_tokens, p.num_kv_heads,
  // p.num_pages) of a buffer apart from SelectScratch's. p's q, summaries, keep and pages must
  // stay valid until the flush.
  static constexpr int kSelectPhases = 2;
  void QueueSelect(const SelectPagesParams& p, int phase = 0);
  absl::Status FlushSelects();

  // --- Batched transfers of one micro-batch phase. Copies and merges queued by tiers run at
  // Flush*, in queue order, neighbours coalesced (the rows of adjacent segments: one copy).
  // Device -> host: `rows` rows of row_bytes from src (pitch src_pitch) to dst_host; run after
  // the queued selections.
  void QueueDownload(void* dst_host, size_t dst_pitch, const void* src, size_t src_pitch,
                     size_t row_bytes, size_t rows);
  absl::Status FlushDownloads();
  // A partial state on the host, o_host [rows, head_dim] and lse_host [rows] (rows = tokens ·
  // query heads), uploaded to the device scratch (part_o, part_lse) and merged into (o, lse).
  struct HostState {
    const float* o_host = nullptr;
    const float* lse_host = nullptr;
    float* part_o = nullptr;
    float* part_lse = nullptr;
    float* o = nullptr;
    float* lse = nullptr;
    int64_t rows = 0;
    int64_t head_dim = 0;
  };
  void QueueMerge(const HostState& state);
  absl::Status FlushMerges();
  // Drops what a failed phase left queued.
  void ClearQueues();

  // --- Evictions: reads `blocks` of every layer of `window` into host staging and calls
  // sink(layer, k, v, maw, tokens, window_entries) once per layer, in layer order, with
  //   k, v: [num_kv_heads, tokens, head_dim] of the window dtype, maw: [num_kv_heads, tokens]
  // and window_entries the entries on the device when they leave it (the β / n_gpu threshold).
  //
  // The runner hands evictions over in groups of at most kEvictGroupTokens tokens (a block
  // larger than that alone), so the page-locked staging is EvictStagingBytes(geometry, block).
  static constexpr int64_t kEvictGroupTokens = 32768;
  static size_t EvictStagingBytes(const WindowGeometry& geometry, int64_t block_tokens);
  using EvictedLayerSink = std::function<absl::Status(int64_t layer, const void* k,
                                                      const void* v, const float* maw,
                                                      int64_t tokens, int64_t window_entries)>;
  // What the sink may touch. kHostOnly (no Backend call: a node append) lets ReadEvicted run
  // the sink on a thread of its own, one layer behind the reads, with the staging cut into two
  // slots when the group fits half of it: layer l + 1's device-to-host read then overlaps layer
  // l's sink, and a settle slice costs about max(reads, sinks) instead of their sum. Groups
  // under overlap_min_bytes of K per layer (a decode step's 16-token eviction: 32 KiB at
  // Llama-3-8B's geometry) run on the caller: a thread and a hand-over per layer would cost
  // more than the overlap saves.
  enum class SinkUses { kBackend, kHostOnly };
  static constexpr size_t kOverlapMinLayerBytes = size_t{256} << 10;
  absl::Status ReadEvicted(WindowCache& window, const std::vector<EvictedBlock>& blocks,
                           const EvictedLayerSink& sink, SinkUses uses = SinkUses::kBackend,
                           size_t overlap_min_bytes = kOverlapMinLayerBytes);

 private:
  Backend& backend_;
  int64_t num_q_heads_;
  int64_t max_rows_;
  bool measure_captured_mass_;
  OffloadProfile profile_;
  size_t pass_segments_ = 0;
  std::vector<std::unique_ptr<PassShared>> shared_;
  std::vector<HostCopy2D> downloads_;   // run together (one wait) at FlushDownloads
  std::vector<HostState> merges_;
  DeviceBuffer select_scratch_;
  std::vector<SelectPagesParams> selects_[kSelectPhases];   // queued by QueueSelect
  DeviceBuffer batch_select_scratch_;        // the queued selections' scratch, one region each
  // Page-locked (Backend::AllocateHost): a settle moves a whole prompt's KV through them, one
  // layer at a time, and pageable memory halves the device-to-host rate.
  DeviceBuffer evict_k_, evict_v_;
  std::vector<float> evict_maw_;   // two slots' worth when ReadEvicted overlaps
};

// Receives recomputed K/V of one layer (what rebuilds entries a lost CPU node held),
// head-major: k, v [num_kv_heads, tokens, head_dim] of the KV dtype (tokens = the offloaded
// entries per (layer, kv head)).
using RebuiltLayerSink =
    std::function<absl::Status(int64_t layer, const void* k, const void* v, int64_t tokens)>;
// Recomputes K/V of the first `tokens` offloaded positions of a sequence and calls sink once per
// layer, in layer order.
using RecomputeKv = std::function<absl::Status(int64_t tokens, const RebuiltLayerSink& sink)>;

// Where a tier that splits its entries between paths keeps them, and why (ExactTier: host pages
// streamed each step, CPU nodes attending densely, layer inputs recomputed into K/V; its
// planner's shares and modelled step times, exact_planner.h). Reported in a request's summary.
struct TierSplit {
  double fetch_share = 0, node_share = 0, recompute_share = 0;
  double modelled_step_s = 0, modelled_fetch_only_s = 0;
  bool recompute_pays = false;
  std::string recompute_reason;
  int64_t host_entries = 0, node_entries = 0;   // per (layer, kv head), now
};

// The memory a tier's KV takes now, by where it lives (bytes): page summaries on the device,
// pinned host pages, and the CPU nodes' pools (as the nodes charge it: whole blocks in their
// storage dtype, kv_store::BlockFormat::ShardBytes).
struct TierFootprint {
  size_t device = 0;
  size_t host = 0;
  size_t nodes = 0;
};

// What a tier's fork (OffloadTier::Fork) is given for the sequence it will belong to.
struct TierFork {
  std::string session_id;   // the name of the fork's stored copy (its session on CPU nodes)
  int64_t expected_tokens = 0;   // offloaded entries the new sequence is expected to reach
  RecomputeKv recompute;    // rebuilds what a lost node held, from the new sequence's tokens
};

class OffloadTier {
 public:
  virtual ~OffloadTier() = default;

  // Entries offloaded per (layer, kv head).
  virtual int64_t offloaded_tokens() const = 0;
  // Whether the window keeps the moving-average attention weights of its entries for this tier
  // (they travel with evicted blocks and drive MAW selection).
  virtual bool wants_maw() const = 0;
  // Work one query row brings outside the device: bytes of offloaded K and V the CPU nodes
  // scan for it over all layers (measured at the last attend, or estimated); 0 when the tier
  // attends on the device. Rows with such work are worth overlapping with other rows' device
  // work.
  virtual double off_device_work() const = 0;

  // Once per pass before the first layer; `stream` is the segment's index in the pass.
  virtual absl::Status BeginPass(TierContext& context, size_t stream) = 0;
  // Layer inputs (ExactTier's recompute, KVPR): a tier that keeps activations instead of K/V
  // for some entries says so here, and the runner then hands it, in every pass and for every
  // layer in order, the attention-RMSNorm output x̂ of the sequence's rows (TakeLayerInputs,
  // after the layer's RmsNorm, before its PrepareAttend): xn [rows, hidden] f32 on the device
  // (contiguous), the rows at positions first_pos, first_pos + 1, ...; whether or not the tier
  // holds entries yet (the rows' entries leave the window later). The runner does not look at
  // the mode; the base tier asks for nothing.
  virtual bool wants_layer_inputs() const { return false; }
  virtual absl::Status TakeLayerInputs(TierContext& /*context*/, int64_t /*layer*/,
                                       const float* /*xn*/, int64_t /*rows*/,
                                       int64_t /*first_pos*/) {
    return absl::OkStatus();
  }
  // Queues on the device, and in context.QueueDownload, what StartAttend of `rows` needs on the
  // host. Nothing leaves the worker yet (an error here needs no cancel).
  virtual absl::Status PrepareAttend(TierContext& context, const AttendRows& rows) = 0;
  // Starts the attention of `rows` over the offloaded KV of rows.layer (the context's downloads
  // have run). On success exactly one FinishAttend or CancelAttend with the same rows must
  // follow before the next PrepareAttend.
  virtual absl::Status StartAttend(TierContext& context, const AttendRows& rows) = 0;
  // Merges the tier's partial state of `rows` into rows.window.o / lse (device), at once or by
  // context.QueueMerge (done at FlushMerges); the window's attention must have been queued.
  // Returns true when part of it is missing (a CPU node did not answer in time: the step is
  // degraded but valid, the missing part counts as empty).
  virtual absl::StatusOr<bool> FinishAttend(TierContext& context, const AttendRows& rows) = 0;
  // Ends a started attend without merging (after an error elsewhere in the pass): waits for
  // what runs off the device so that nothing outlives the pass.
  virtual void CancelAttend(TierContext& context, const AttendRows& rows) = 0;

  // Layer-ahead work (RunnerOptions::speculate_pages): a tier whose PrepareAttend queues device
  // work that a guess of the queries can do (page selection) says so, and the runner then,
  // after StartAttend of layer l, calls Speculate with `next`: layer l+1's rows whose
  // window.q is a guess of that layer's queries (device, rows of window.q_row_stride floats).
  // The tier queues that work now on the device (selections by context.QueueSelect, which the
  // runner flushes at once) and PrepareAttend of layer l+1 in the same pass uses its result
  // instead of the true queries'; the host reads nothing before then. Work of a pass that ends
  // first is dropped at the next BeginPass. Tiers that do not speculate keep the defaults.
  virtual bool speculates() const { return false; }
  virtual absl::Status Speculate(TierContext& /*context*/, const AttendRows& /*next*/) {
    return absl::OkStatus();
  }

  // Takes `blocks` leaving `window` (every layer), before the window releases them.
  virtual absl::Status Append(TierContext& context, WindowCache& window,
                              const std::vector<EvictedBlock>& blocks) = 0;
  // Most tokens the next Append should carry to stay cheap, for callers that may split or
  // defer it (ModelRunner::SettleSlice): kAnyTokens, or fewer; 0 = none now (a later step).
  // A pages tier whose low-rank keys calibrate names what fills their staging exactly, and 0
  // while their bases are being made in the background (an Append would wait for them, and
  // its copies would compete with that work for the cores); it installs finished bases here.
  static constexpr int64_t kAnyTokens = std::numeric_limits<int64_t>::max();
  virtual absl::StatusOr<int64_t> AppendLimit() { return kAnyTokens; }

  // Room for `tokens` offloaded entries per (layer, kv head): RESOURCE_EXHAUSTED otherwise.
  virtual absl::Status Reserve(int64_t tokens) = 0;
  // Between steps (never while an attend is in flight): placement re-plans, migrations.
  virtual absl::Status Maintain() = 0;
  // Whether part of the tier's KV was lost with a CPU node (its attends are degraded) and can
  // be rebuilt by Rebuild(); the base tier never loses any.
  virtual bool needs_rebuild() const { return false; }
  // Between passes (the runner's buffers, logits included, may be overwritten: it may run a
  // forward pass of its own): re-creates the lost part. An error leaves it lost (degraded) and
  // may be retried later; it does not fail the sequence. True when it recomputed something.
  virtual absl::StatusOr<bool> Rebuild() { return false; }
  virtual absl::Status Close() = 0;
  // A tier for another sequence that holds the same offloaded entries (a fork of a cached
  // prefix: several requests continue one document). Shares the storage where the tier can (CPU
  // nodes: copy-on-write blocks) and copies it otherwise; this tier is unchanged. Between passes
  // only. UNIMPLEMENTED where the tier cannot fork (the caller then does without);
  // FAILED_PRECONDITION in a state that cannot be forked now (a migration or rebuild pending).
  virtual absl::StatusOr<std::unique_ptr<OffloadTier>> Fork(const TierFork& /*fork*/) const {
    return absl::UnimplementedError("this offload tier cannot be forked");
  }
  // Whether Fork is implemented (asked before any room is made for a fork).
  virtual bool can_fork() const { return false; }
  // The page summaries of a tier that selects by pages (the engine reserves and counts them);
  // null otherwise.
  virtual PageIndex* page_index() { return nullptr; }
  // The budget of a tier that selects by pages (offload/page_selection.h): the engine sets it
  // from each turn's request, between passes; null for tiers that do not select pages (the
  // selection rule is the tier's own: the runner never looks at it).
  virtual PagePolicy* page_policy() { return nullptr; }
  const PagePolicy* page_policy() const { return const_cast<OffloadTier*>(this)->page_policy(); }
  // The tier's own device memory (NodeTier's page summaries; footprint().device) moves with
  // its sequence's window when the sequence is parked (Sequence::Park): ParkDevice copies it
  // into `pool` (pinned host memory) and frees it, UnparkDevice allocates and copies it back;
  // either leaves the tier as it was when it fails (RESOURCE_EXHAUSTED for memory). Tiers with
  // nothing on the device keep the defaults.
  virtual absl::Status ParkDevice(ParkingPool& /*pool*/) { return absl::OkStatus(); }
  virtual absl::Status UnparkDevice() { return absl::OkStatus(); }
  virtual size_t ParkBytes() const { return 0; }        // what ParkDevice copies now
  virtual size_t parked_bytes() const { return 0; }     // pool bytes held while parked
  virtual size_t resident_bytes() const { return 0; }   // device bytes once unparked
  // Mean selected/held share per layer over the tier's life; empty when it attends everything.
  virtual std::vector<double> MeanSelectedShare() const = 0;
  // Where its KV is now (TierFootprint): what the engine counts and what eviction frees.
  virtual TierFootprint footprint() const = 0;
  // A tier that splits its entries between paths says how (TierSplit); others give nothing.
  virtual std::optional<TierSplit> split() const { return std::nullopt; }
  // A tier that serves only while a prompt is prefilled (PrefillSpillTier: the part that left
  // the device attended from host pages) gives back the tier that stays once the prompt is in;
  // the sequence then holds that one. Null from a tier that stays as it is.
  virtual std::unique_ptr<OffloadTier> ReleaseAfterPrefill() { return nullptr; }
};

}  // namespace tandem::gpu_worker
