// ModelRunner: the Llama forward pass over the backend, with hybrid and offload attention.
//
// Forward() feeds tokens of one sequence at its next positions in chunks of at most max_chunk
// tokens (chunked prefill, HeadInfer §2: activation memory is bounded by the chunk, whatever the
// prompt length). Decode() feeds one token to each of several sequences in one pass (a batch:
// every weight is read once for all of them). A pass is a list of segments (sequence, tokens)
// whose rows are stacked; per layer:
//   x̂ = RMSNorm(x); [q|k|v] = x̂·Wqkvᵀ; RoPE(q, k); k, v -> each sequence's window slots
//   hybrid: q -> CPU nodes (Attend over the offloaded, selected entries) in the background;
//   with selection = pages the device first scores the layer's page summaries against q and
//   the chosen page ids travel with q (PageIndex::Select)
//   (O, LSE) = window attention per segment (causal by position; MAW update in hybrid mode)
//   hybrid: merge the CPU partial state into (O, LSE) (the exact LSE merge)
//   offload: attend over the host pages streamed in by the KvStreamer, merge the same way
//   x += O·Woᵀ; x += down(SwiGLU(RMSNorm(x)·Wgate_upᵀ))
// then the final norm and lm_head, and the eviction of window blocks beyond the window to the
// CPU nodes (hybrid, with their MAW; their page summaries first under selection = pages) or to
// host memory (offload).
//
// Not thread-safe: the engine's executor thread owns the runner, its backend and sequences.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/kv_streamer.h"
#include "tandem/gpu_worker/page_selection.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {

struct RunnerOptions {
  int64_t max_chunk = 512;   // tokens per forward chunk (prefill activation bound)
  float maw_alpha = 0.1f;    // MAW moving-average factor α: maw = (1-α)·maw + α·a
  // Accuracy diagnostics (benchmarks): after each paged Attend, attend again over every
  // offloaded entry and record the share of the offloaded softmax mass the chosen pages
  // captured (Sequence::captured_mass). Doubles the nodes' work; off in serving.
  bool measure_captured_mass = false;
};

struct ForwardOptions {
  // Optional [n] next-token targets: logprobs[i] = log p(targets[i] | tokens[..i]); a target
  // of -1 is skipped (logprobs[i] = 0). Needs logprobs.
  const int32_t* targets = nullptr;
  float* logprobs = nullptr;   // host, [n]
  // Called after each chunk with (tokens processed so far, n).
  std::function<void(int64_t, int64_t)> on_chunk;
};

// Where the host thread spent a pass's attention time, summed over layers and passes (for the
// benchmark's breakdown of a decode step). q_download waits for the device to finish the work
// queued before the attention (the copy of q synchronises); cpu_wait is time blocked on CPU
// nodes after the device's window attention was queued; merge_upload copies the CPU partial
// states back and queues the merge.
struct RunnerProfile {
  double q_download_s = 0.0;
  double cpu_wait_s = 0.0;
  double merge_upload_s = 0.0;
  // selection = pages: the page-selection kernels and the download of the chosen page ids
  // (after q's download, before the CPU nodes can start).
  double select_s = 0.0;
  uint64_t passes = 0;
};

class ModelRunner {
 public:
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(Backend& backend,
                                                             const DeviceModel& model,
                                                             const RunnerOptions& options);

  // Feeds ids[0..n) (each in [0, vocab); the caller validates) through the model. Afterwards
  // last_logits() holds the logits of the last token. Errors leave the sequence unusable
  // (the engine closes it).
  absl::Status Forward(Sequence& sequence, const int32_t* ids, int64_t n,
                       const ForwardOptions& options = {});

  // One pass over several sequences (continuous batching): entry b feeds ids[0..n) of
  // *seq at its next positions: a decode token (n = 1) or a prefill chunk. Distinct sequences,
  // Σ n <= max_chunk. Afterwards batch_logits() holds [entries.size(), vocab] on the device:
  // row b the logits after entry b's last token.
  struct BatchEntry {
    Sequence* seq = nullptr;
    const int32_t* ids = nullptr;
    int64_t n = 0;
  };
  absl::Status Step(const std::vector<BatchEntry>& entries);
  // One decode step: ids[b] is fed to *seqs[b] (Step with n = 1 each).
  absl::Status Decode(const std::vector<Sequence*>& seqs, const int32_t* ids);
  const float* batch_logits() const { return logits_.as<float>(); }

  const float* last_logits() const { return last_logits_; }   // device, [vocab]
  absl::StatusOr<std::vector<float>> LastLogitsToHost();

  const RunnerProfile& profile() const { return profile_; }
  void ResetProfile() { profile_ = {}; }

  Backend& backend() { return backend_; }
  const DeviceModel& model() const { return model_; }
  const RunnerOptions& options() const { return options_; }

 private:
  ModelRunner(Backend& backend, const DeviceModel& model, const RunnerOptions& options)
      : backend_(backend), model_(model), options_(options) {}
  // Tokens of one sequence in a pass; its rows are [row0, row0 + n) of the activations.
  struct Segment {
    Sequence* seq = nullptr;
    const int32_t* ids = nullptr;
    int64_t n = 0;
    int64_t row0 = 0;
  };
  // One pass over `segments` (Σ n <= max_chunk). targets/logprobs only with one segment.
  absl::Status ForwardPass(const std::vector<Segment>& segments, const int32_t* targets,
                           float* logprobs);
  absl::Status Attention(const std::vector<Segment>& segments, int64_t layer);
  WindowAttentionParams WindowParams(const Segment& segment, int64_t layer) const;
  absl::Status Evict(Sequence& sequence);
  // selection = pages: picks the pages of segment `index` for `layer` on the device and
  // downloads their ids; nullptr when the layer attends over every page (dense layer, or a
  // budget that covers the whole offloaded KV). Valid until the next pass.
  absl::StatusOr<const PageSelection*> ChoosePages(const Segment& segment, size_t index,
                                                   int64_t layer);
  // RunnerOptions::measure_captured_mass: selected_lse [n, H_q] of the pages just attended.
  absl::Status MeasureCapturedMass(const Segment& segment, int64_t layer, bool paged,
                                   const float* selected_lse);
  // Scores of one SelectPages call stay below this (a prefill chunk over a long context is
  // split into several calls).
  static constexpr size_t kMaxSelectScratchBytes = size_t{256} << 20;
  absl::Status EnsureStreamer(const std::vector<Segment>& segments);

  Backend& backend_;
  const DeviceModel& model_;
  RunnerOptions options_;

  // Activations of one chunk (device).
  DeviceBuffer x_, xn_, qkv_, attn_, lse_, gate_up_, ffn_, cpu_o_, cpu_lse_;
  DeviceBuffer ids_, positions_, slots_, targets_, logprobs_;
  DeviceBuffer logits_;       // [max_chunk, vocab] once a pass needs more than one row
  DeviceBuffer last_rows_;    // [max_chunk, hidden]: each segment's last row of x, gathered
  int64_t logits_rows_ = 0;
  const float* last_logits_ = nullptr;
  std::unique_ptr<KvStreamer> streamer_;   // created by the first offload pass
  RunnerProfile profile_;
  // Host staging.
  std::vector<int32_t> ids_host_, positions_host_, slots_host_;
  std::vector<float> q_host_, o_host_, lse_host_;
  std::vector<char> evict_k_, evict_v_;
  std::vector<float> evict_maw_;
  // selection = pages: chosen ids on the device [rows, H_kv, per_head], the scores' scratch, and
  // per segment of the pass the host copy of its ids and the PageSelection naming them.
  DeviceBuffer selected_pages_, select_scratch_;
  std::vector<std::vector<int32_t>> page_ids_host_;
  std::vector<PageSelection> page_selection_;
  std::vector<float> dense_o_host_, dense_lse_host_;   // measure_captured_mass
};

}  // namespace tandem::gpu_worker
