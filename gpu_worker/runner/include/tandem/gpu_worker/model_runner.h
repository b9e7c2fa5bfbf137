// ModelRunner: the Llama forward pass over the backend, with the KV beyond each sequence's
// device window in an offload tier (offload_tier.h).
//
// Forward() feeds tokens of one sequence at its next positions in chunks of at most max_chunk
// tokens (chunked prefill, HeadInfer §2: activation memory is bounded by the chunk, whatever the
// prompt length). Step() feeds several sequences in one pass (continuous batching: decode
// tokens and prefill chunks of sequences in any mode; every weight is read once for all of
// them). A pass is a list of segments (sequence, tokens) whose rows are stacked; per layer:
//   head:  x̂ = RMSNorm(x); [q|k|v] = x̂·Wqkvᵀ; RoPE(q, k); k, v -> each sequence's window slots;
//          each tier starts its attention over the offloaded KV (CPU nodes: q goes out; the
//          downloads of every segment's q and page ids run together, one wait per layer);
//          (O, LSE) = window attention per segment (causal by position; MAW when the tier
//          wants it) is queued on the device
//   tail:  each tier merges its partial state into (O, LSE) (the exact LSE merge; the CPU
//          nodes' states of adjacent segments are uploaded and merged as one);
//          x += O·Woᵀ; x += down(SwiGLU(RMSNorm(x)·Wgate_upᵀ))
// then the final norm and lm_head, and the eviction of window blocks beyond the window to the
// sequence's tier.
//
// Ping-pong (DESIGN "One decode step, one layer"; NEO): when two or more segments have work
// off the device (OffloadTier::off_device_work: CPU nodes) and it outweighs what a split adds
// (RunnerOptions::split_min_scan_share), the pass is split into two micro-batches, balanced by
// that work, that alternate per layer:
//   head(A,0) head(B,0) | tail(A,l) head(A,l+1) tail(B,l) head(B,l+1) | ...
// so the device computes one micro-batch while the CPU nodes attend for the other, and a
// layer costs about max(device, CPU) instead of their sum. Each micro-batch is a contiguous row
// range of the pass's activations (no extra memory); the results equal the unsplit pass.
//
// Not thread-safe: the engine's executor thread owns the runner, its backend and sequences.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/pass_breaks.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {

class DeviceLayerClock;

struct RunnerOptions {
  int64_t max_chunk = 512;   // tokens per forward chunk (prefill activation bound)
  float maw_alpha = 0.1f;    // MAW moving-average factor α: maw = (1-α)·maw + α·a
  // Accuracy diagnostics (benchmarks): after each paged Attend, attend again over every
  // offloaded entry and record the share of the offloaded softmax mass the chosen pages
  // captured (Sequence::captured_mass). Doubles the nodes' work; off in serving.
  bool measure_captured_mass = false;
  // 2: split batches with off-device attention of two or more segments into two alternating
  // micro-batches (ping-pong) where it pays; 1: always one pass over the whole batch.
  int micro_batches = 2;
  // When the split pays: it adds about one more read of the weights on the device (each
  // micro-batch runs every GEMM) and hides up to the CPU nodes' time, so a pass is split when
  // its off-device scan bytes (OffloadTier::off_device_work) reach split_min_scan_share × the
  // model's weight bytes, the device-to-CPU scan rate ratio. < 0: by backend: cuda 1/64 (an
  // H100's ~3.3 TB/s against ~50 GB/s of a host's CPU scan); cpu: never (its "device" computes
  // on the cores that CPU nodes on this host attend with, so nothing overlaps). 0: always.
  double split_min_scan_share = -1.0;
  // And at least this many off-device scan bytes per pass: the split adds a synchronisation
  // with the device per layer and micro-batch (~10 µs each; 16 MB are ~0.3 ms of CPU scan, 32
  // layers' worth), which a tiny model's CPU work does not repay.
  double split_min_scan_bytes = 16e6;
  // The settle after a device prefill (WindowCache::settling): at most this many tokens of a
  // prompt's blocks move to the tier per step (SettleSlice; the engine shares it among its
  // settling sequences), so that no step waits for a whole prompt's settle. Measured on the
  // H100 host (Llama-3-8B geometry, 32K): 0.86 s for 32K tokens with pages selection, 2.55 s
  // with MAW, i.e. ~0.1 s / ~0.3 s added to a step at 4096. 1024 since the H200 served row
  // (BENCHMARKS "Settle appends at memory speed"): a 1024 slice costs about one decode step,
  // 2048 about two. 0 = settle a whole prompt at once.
  int64_t settle_tokens_per_step = 1024;
  // Layer-ahead page selection (DESIGN "Overlapping the CPU part"): after layer l's tiers have
  // started, the runner guesses layer l+1's queries from layer l's input, q̂ = RoPE(RMSNorm(x_l)
  // · W_q(l+1)) (InfiniGen: the residual stream changes little across one layer), and tiers
  // that select pages (OffloadTier::speculates) choose layer l+1's pages with it on the device
  // while the host waits for layer l's CPU nodes; layer l+1 then downloads only its true q.
  // Takes the selection off the step's serial path at the price of pages chosen by a guess
  // (BENCHMARKS "Layer-ahead selection"). Adds [max_chunk, hidden + H_q·D] f32 activations.
  bool speculate_pages = false;
  // Benchmarks: time each layer of one-micro-batch passes with CPU-node attends on the device
  // (Backend::MarkDevice; RunnerProfile's device_* fields). Four event records per layer.
  bool device_marks = false;
  // Passes may take breaks (Step's PassBreaks, pass_breaks.h): a parked copy of the residual
  // stream, [max_chunk, hidden] f32, is allocated for them.
  bool pass_breaks = false;
  // settle_tokens_per_step as a SettleSlice budget (0: no bound).
  int64_t settle_budget_per_step() const {
    return settle_tokens_per_step > 0 ? settle_tokens_per_step
                                      : std::numeric_limits<int64_t>::max();
  }
};

struct ForwardOptions {
  // Optional [n] next-token targets: logprobs[i] = log p(targets[i] | tokens[..i]); a target
  // of -1 is skipped (logprobs[i] = 0). Needs logprobs.
  const int32_t* targets = nullptr;
  float* logprobs = nullptr;   // host, [n]
  // Called after each chunk with (tokens processed so far, n).
  std::function<void(int64_t, int64_t)> on_chunk;
};

// Where the host thread spent the passes' time, summed over passes (a benchmark's breakdown of
// a step). The offloaded-attention parts (OffloadProfile: q download, page selection, the wait
// for CPU nodes, merge upload) are summed over layers and sequences. pass_s is the host's time
// in Step/Forward (the device may still run afterwards); with ping-pong, cpu_wait_s is the
// part of it the CPU nodes were not hidden behind device work.
struct RunnerProfile : OffloadProfile {
  double pass_s = 0.0;
  uint64_t passes = 0;
  uint64_t split_passes = 0;   // passes run as two micro-batches
  // PassBreaks: interludes run inside passes, and their time (not in the passes' pass_s).
  uint64_t pass_breaks = 0;
  double interlude_s = 0.0;
  // RunnerOptions::device_marks, summed over the layers timed (DeviceLayerClock): the device's
  // time from q leaving for the nodes until the window attention and the next layer's selection
  // had run; how much later than the host the device reached the nodes' answer (busy with
  // those); the merge, tail and next head on the device, from the answer to q's download, and
  // the host's time launching them.
  double device_speculate_s = 0.0;
  double device_answer_stall_s = 0.0;
  double device_tail_head_s = 0.0;
  double host_tail_head_launch_s = 0.0;
  uint64_t device_marked_layers = 0;
};

class ModelRunner {
 public:
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(Backend& backend,
                                                             const DeviceModel& model,
                                                             const RunnerOptions& options);
  ~ModelRunner();

  // Device bytes of the runner's activations for `options` (max_chunk rows; what Create
  // allocates, from the same table), plus, with `batched`, the [max_chunk, vocab] logits and
  // [max_chunk, hidden] gathered rows a pass of several sequences (or with log-probs) grows
  // to. The memory estimator (memory_plan.h) reads it; no allocation.
  static size_t ActivationBytes(const ModelConfig& config, const RunnerOptions& options,
                                bool batched);

  // Feeds ids[0..n) (each in [0, vocab); the caller validates) through the model. Afterwards
  // last_logits() holds the logits of the last token. Errors leave the sequence unusable
  // (the engine closes it).
  absl::Status Forward(Sequence& sequence, const int32_t* ids, int64_t n,
                       const ForwardOptions& options = {});

  // One pass over several sequences (continuous batching): entry b feeds ids[0..n) of
  // *seq at its next positions: a decode token (n = 1) or a prefill chunk. Distinct sequences,
  // Σ n <= max_chunk. Afterwards batch_logits() holds [entries.size(), vocab] on the device:
  // row b the logits after entry b's last token.
  // With `breaks` (needs RunnerOptions::pass_breaks), other passes may run between its layers
  // where it qualifies (pass_breaks.h); a Step inside an interlude takes no breaks of its own.
  struct BatchEntry {
    Sequence* seq = nullptr;
    const int32_t* ids = nullptr;
    int64_t n = 0;
  };
  absl::Status Step(const std::vector<BatchEntry>& entries, PassBreaks* breaks = nullptr);
  // Whether a Step over these sequences would take breaks as they stand now: the runner has
  // pass_breaks and each sequence attends on the device alone (pass_breaks.h). A pass's own
  // evictions may still give a sequence offloaded entries (its first window overflow); that
  // pass then takes none.
  bool CanBreak(const std::vector<Sequence*>& sequences) const;
  // One decode step: ids[b] is fed to *seqs[b] (Step with n = 1 each).
  absl::Status Decode(const std::vector<Sequence*>& seqs, const int32_t* ids);
  const float* batch_logits() const { return logits_.as<float>(); }

  // Device prefill (WindowCache::Widen): a sequence whose window was widened for a prompt
  // (Sequence::prefill_end) narrows after the pass that feeds the prompt's last token; the
  // blocks beyond the configured window then still sit on the device (WindowCache::settling),
  // and its tier does not hold them yet. Until they leave, the window attends over them on the
  // device and the tier over the rest: every entry is attended once, and the sequence decodes
  // on. SettleSlice moves the oldest of them, whole blocks of at most `max_tokens` tokens (at
  // least one block), to the tier and releases them from the window (commit: the tier's Append
  // is complete before the blocks leave the window, both between passes); the last one shrinks
  // the window. Returns the tokens moved (0 when not settling, or when the tier defers: its
  // OffloadTier::AppendLimit, which may also end the slice early). SettleEvictions moves all of
  // them (benchmarks, tests; a session's end with nothing else running). A pass itself moves
  // only the blocks its new tokens need the ring slots of (WindowCache::EvictionsBeforeAppend).
  // An error leaves the blocks not yet released on the device (the tier may hold part of the
  // failed group: the engine closes the sequence).
  absl::StatusOr<int64_t> SettleSlice(Sequence& sequence, int64_t max_tokens);
  absl::Status SettleEvictions(Sequence& sequence);

  const float* last_logits() const { return last_logits_; }   // device, [vocab]
  absl::StatusOr<std::vector<float>> LastLogitsToHost();

  const RunnerProfile& profile() const { return profile_; }
  void ResetProfile();

  // What the offload tiers of this runner's passes share (offload_tier.h).
  TierContext& tier_context() { return tiers_; }
  const TierContext& tier_context() const { return tiers_; }

  // RunnerOptions::micro_batches for the following passes: 1 or 2 (INVALID_ARGUMENT otherwise).
  absl::Status SetMicroBatches(int micro_batches);

  Backend& backend() { return backend_; }
  const DeviceModel& model() const { return model_; }
  const RunnerOptions& options() const { return options_; }

 private:
  // SettleSlice (defer: the tier's AppendLimit applies) and SettleEvictions (it does not).
  absl::StatusOr<int64_t> Settle(Sequence& sequence, int64_t max_tokens, bool defer);
  ModelRunner(Backend& backend, const DeviceModel& model, const RunnerOptions& options);

  // Tokens of one sequence in a pass; its rows are [row0, row0 + n) of the activations.
  struct Segment {
    Sequence* seq = nullptr;
    const int32_t* ids = nullptr;
    int64_t n = 0;
    int64_t row0 = 0;
    size_t entry = 0;       // its index in Step's entries (its row of batch_logits)
    bool attends = false;   // it has a tier with offloaded entries
  };
  // Segments [first, first + count) of a pass, rows [row0, row0 + rows): one micro-batch.
  struct MicroBatch {
    size_t first = 0;
    size_t count = 0;
    int64_t row0 = 0;
    int64_t rows = 0;
  };
  // The activations of a pass, max_chunk rows each (device, f32 unless said), and host staging.
  // A micro-batch uses its own row range of every buffer, so two micro-batches in flight never
  // share memory.
  struct Activations {
    DeviceBuffer x, xn;          // [rows, hidden]
    DeviceBuffer qkv;            // [rows, (H_q + 2·H_kv)·D]
    DeviceBuffer attn, part_o;   // [rows, H_q, D]: the merged state; a tier's partial state
    DeviceBuffer lse, part_lse;  // [rows, H_q]
    DeviceBuffer gate_up;        // [rows, 2·intermediate]
    DeviceBuffer ffn;            // [rows, intermediate]
    DeviceBuffer ids, positions, slots, targets;   // [rows] i32
    DeviceBuffer logprobs;       // [rows]
    // Dynamic NTK RoPE only: [rows, D/2] inverse frequencies, each row its sequence's.
    DeviceBuffer rope_inv_freq;
    // RunnerOptions::speculate_pages only: the next layer's guessed queries [rows, H_q·D] and
    // the normed input they come from [rows, hidden].
    DeviceBuffer q_guess, xn_guess;
    // RunnerOptions::pass_breaks only: a paused pass's x rows while an interlude runs.
    DeviceBuffer parked_x;
    std::vector<float> q_host, o_host, lse_host;   // host: [rows, H_q, D], .., [rows, H_q]
  };

  // Every activation buffer of Create and its f32 count for chunks of `max_chunk` rows.
  using ActivationTable = std::vector<std::pair<DeviceBuffer Activations::*, int64_t>>;
  static ActivationTable ActivationBuffers(const ModelConfig& config,
                                           const RunnerOptions& options);

  // One pass over `segments` (Σ n <= max_chunk, distinct sequences). targets/logprobs only with
  // one segment. Segments may be reordered (micro-batches are contiguous).
  absl::Status ForwardPass(std::vector<Segment> segments, const int32_t* targets,
                           float* logprobs, PassBreaks* breaks = nullptr);
  // Orders `segments` into micro-batches (one, or two balanced by off-device work).
  std::vector<MicroBatch> Split(std::vector<Segment>& segments) const;
  // With `breaks`: the pass qualifies for them (TakesBreaks) and layer boundaries ask them.
  absl::Status Layers(std::vector<Segment>& segments, const std::vector<MicroBatch>& batches,
                      PassBreaks* breaks);
  // Whether a pass over `segments` in `batches` may pause between layers (pass_breaks.h), and
  // whether one sequence's attention keeps it from doing so.
  bool TakesBreaks(const std::vector<Segment>& segments,
                   const std::vector<MicroBatch>& batches) const;
  static bool AttendsOffDevice(const Sequence& seq);
  // The boundary after layer l's tail of a pass with breaks: keeps the host one layer ahead of
  // the device, and when breaks.Due(), parks the pass's `rows` rows of x and its per-row host
  // state, runs the interlude, and restores them (positions, slots and RoPE rows uploaded again).
  absl::Status LayerBoundary(int64_t layer, int64_t rows, PassBreaks& breaks);
  // Layer l of one micro-batch up to its queued window attention (the tiers' attends started),
  // and from the tiers' merge to the end of the FFN.
  absl::Status LayerHead(std::vector<Segment>& segments, const MicroBatch& mb, int64_t layer);
  absl::Status LayerTail(std::vector<Segment>& segments, const MicroBatch& mb, int64_t layer);
  // The head's projection of one micro-batch's rows: xn = RMSNorm(x) with w's norm, y = the
  // first `cols` rows of w's [q | k | v] projection (cols = (H_q + 2·H_kv)·D: all of them, or
  // H_q·D: the queries alone), the q (and k) heads normed (Qwen3) and rotated at the rows'
  // positions. Rows of y are `cols` floats apart.
  absl::Status ProjectRotated(const DeviceLayer& w, const MicroBatch& mb, const float* x,
                              float* xn, float* y, int64_t cols);
  // RunnerOptions::speculate_pages: after layer l's tiers started, the guess of layer l+1's
  // queries for the micro-batch's rows (act_.q_guess) and each speculating tier's early work
  // with it (OffloadTier::Speculate). Nothing for the last layer or without such a tier.
  absl::Status SpeculateNextLayer(std::vector<Segment>& segments, const MicroBatch& mb,
                                  int64_t layer);
  absl::Status Logits(const std::vector<Segment>& segments, int64_t n, const int32_t* targets,
                      float* logprobs);
  // For a length-dependent RoPE (dynamic NTK): uploads each segment's inverse frequencies for
  // its last position + 1 to act_.rope_inv_freq, one row per token, and sets rope_per_row_;
  // clears it when every segment fits max_position_embeddings (the shared table is right).
  absl::Status PrepareRope(const std::vector<Segment>& segments, int64_t rows);
  WindowAttentionParams WindowParams(const Segment& segment, int64_t layer) const;
  AttendRows AttendRowsOf(const Segment& segment, size_t index, int64_t layer);
  // A widened prefill's MAW (WindowCache::Widen): the main window attention of a widened
  // sequence updates no MAW; in its last pass and in passes after which blocks leave,
  // ObservesMaw() is true and one more window attention of the segment's last
  // kMawObservationRows rows (output to the tier scratch, part_o / part_lse) updates it.
  static constexpr int64_t kMawObservationRows = 32;
  static bool ObservesMaw(const Segment& segment);
  WindowAttentionParams ObservationParams(const Segment& segment, int64_t layer) const;
  // Moves `blocks` (oldest first) to the sequence's tier and releases them, in groups of at most
  // TierContext::kEvictGroupTokens; Evict moves all of PendingEvictions().
  absl::Status EvictBlocks(Sequence& sequence, const std::vector<EvictedBlock>& blocks);
  absl::Status Evict(Sequence& sequence);

  Backend& backend_;
  const DeviceModel& model_;
  RunnerOptions options_;
  TierContext tiers_;
  Activations act_;
  DeviceBuffer logits_;       // [max_chunk, vocab] once a pass needs more than one row
  DeviceBuffer last_rows_;    // [max_chunk, hidden]: each segment's last row of x, gathered
  int64_t logits_rows_ = 0;
  const float* last_logits_ = nullptr;
  RunnerProfile profile_;
  std::unique_ptr<DeviceLayerClock> layer_clock_;   // RunnerOptions::device_marks
  std::vector<int32_t> ids_host_, positions_host_, slots_host_;
  bool rope_per_row_ = false;          // this pass reads act_.rope_inv_freq
  std::vector<float> rope_inv_freq_host_;
  // Per segment of the pass: its attend of the current layer, and whether one is in flight.
  std::vector<AttendRows> attends_;
  std::vector<char> started_;
  // One micro-batch's KV writes and window attentions of a layer, issued as one batched call
  // each (kept to avoid reallocating them every layer).
  std::vector<WriteKvParams> write_kv_;
  std::vector<WindowAttentionParams> window_attention_;
  bool in_interlude_ = false;   // an interlude runs: passes take no breaks of their own
};

}  // namespace tandem::gpu_worker
