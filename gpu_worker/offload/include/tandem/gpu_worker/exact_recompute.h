// ExactRecompute: the recompute path (KVPR, ../shared/papers/kvpr-partial-kv-recompute.md) of an
// ExactTier. For its share of a sequence's offloaded entries the tier keeps, instead of K and V,
// the layer inputs x̂ (the attention-RMSNorm output of each layer) and at every step recomputes
//   K = RoPE(x̂ · Wkᵀ + bk) at the entries' positions,  V = x̂ · Wvᵀ + bv
// on the device from the K/V rows of the layer's qkv weight, attends the query rows over them and
// merges the partial state by LSE, like a fetched page.
//
// Storage (host, per layer): pages of page_tokens rows [page_tokens, hidden] of the activation
// dtype — bf16 for bf16 weights (MatMul rounds its input to the weight dtype anyway, so the
// stored rows give the same products; half the bytes of f32), f32 otherwise — followed by the
// entries' positions [page_tokens] i32 (the same in every layer), page-locked
// (Backend::AllocateHost) so that a page crosses PCIe asynchronously.
//
// Rows arrive before their entries leave the window: the runner hands the tier x̂ of every row
// of every pass (OffloadTier::TakeLayerInputs); Take() keeps them as pending by position until
// Keep() moves the recompute share's into the pages or Drop() forgets those that went elsewhere.
// Pending rows take hidden·act_bytes per layer and entry of the device window: host memory like
// the window's KV (for MHA, where recompute pays, the same bytes as its K+V).
//
// Per step and layer (Attend), per page: upload [tokens, hidden] and the positions, convert to
// f32 (Embed as a gather of the page's own rows), MatMul with the K/V rows of Wqkv, RoPE on K,
// scatter into a staging K/V [kv_heads, page_tokens, head_dim] of the window dtype (WriteKv: the
// conversion the window applied to the same values), window attention, LSE merge.
//
// Uploads run on the backend's upload stream as the KvStreamer's pages do (HeadInfer's
// ping-pong), on upload slots kFirstSlot and kFirstSlot + 1 (the streamer, made by TierContext
// with 2 slots, uses 0 and 1): BeginPass plans the pass's pages in the order the layers attend
// them — (layer, page) — and queues the first two; each page's compute waits for its upload on
// the device, and releasing its slot queues the page two ahead, possibly of the next layer, so
// the next layer's first pages cross PCIe while this layer's GEMMs and the rest of the layer
// run. The host never waits for the device here (a synchronous copy waited for everything
// queued before it, and the tier's fetched pages and node merges queued only after it).
//
// Models whose RoPE frequencies depend on the sequence length (dynamic NTK, longrope) are not
// supported (Create: FAILED_PRECONDITION): a K rotated later would not be the K the window held.
//
// Not thread-safe: the engine's executor thread owns it with its tier.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/staged_attention.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {

class ExactRecompute {
 public:
  // `window`: the sequence's window geometry (the dtype of the staged K/V); pages of
  // `page_tokens` entries; query rows per attend up to `max_rows`. `model` outlives this.
  static absl::StatusOr<std::unique_ptr<ExactRecompute>> Create(Backend& backend,
                                                                const DeviceModel& model,
                                                                const WindowGeometry& window,
                                                                int64_t page_tokens,
                                                                int64_t max_rows);

  // The dtype rows are stored in for weights of `weight_dtype` (bf16 and FP8 -> bf16, else f32).
  static DType ActivationDType(DType weight_dtype);

  // Keeps x̂ of `rows` rows of `layer` (device, [rows, hidden] f32, contiguous) at positions
  // first_pos, first_pos + 1, ... as pending (overwrites rows of the same positions).
  absl::Status Take(int64_t layer, const float* xn, int64_t rows, int64_t first_pos);
  // Whether every position in [first_pos, first_pos + count) has pending rows.
  bool HasPending(int64_t first_pos, int64_t count) const;
  // Moves the pending rows of [first_pos, first_pos + count) into the pages (every layer);
  // FAILED_PRECONDITION when one is missing (check HasPending first).
  absl::Status Keep(int64_t first_pos, int64_t count);
  // Forgets the pending rows of [first_pos, first_pos + count) (their entries went elsewhere).
  void Drop(int64_t first_pos, int64_t count);
  // Keeps `n` entries given directly (tandem-bench's synthetic contexts): rows [n, hidden] of
  // the activation dtype (host), the same for every layer, at positions first_pos, ...
  absl::Status AppendRows(const void* rows, int64_t n, int64_t first_pos);

  // Plans one forward pass over every kept page of every layer and queues the first two
  // uploads. A pass whose Attend calls do not follow the plan (a failed pass, or no BeginPass)
  // re-plans from the layer it attends; uploads already queued still run, in order.
  absl::Status BeginPass();
  // Recomputes K/V of every kept entry of `layer`, attends `base`'s query rows (q, q_pos,
  // num_tokens, heads, scale) over them and merges into base.o / base.lse (device, holding a
  // partial state already). Queued on the backend stream, behind the pages' uploads.
  absl::Status Attend(int64_t layer, const WindowAttentionParams& base);

  // The upload slots this path uses: kFirstSlot, kFirstSlot + 1.
  static constexpr int kFirstSlot = 2;

  int64_t tokens() const { return static_cast<int64_t>(positions_.size()); }
  int64_t pending() const { return static_cast<int64_t>(pending_.size()); }
  size_t host_bytes() const { return host_bytes_; }
  // Host bytes of one entry's rows over all layers.
  size_t row_bytes_all_layers() const { return layers_count_ * row_bytes_; }

 private:
  ExactRecompute(Backend& backend, const DeviceModel& model, const WindowGeometry& window,
                 int64_t page_tokens, int64_t max_rows);
  // Appends one entry at `position`: its row of layer l at rows + l · layer_stride.
  absl::Status AppendEntry(const char* rows, size_t layer_stride, int64_t position);
  // The pass's pages from `layer` on, the first two uploads queued.
  absl::Status Plan(int64_t layer);
  // Queues the upload of items_[index] (rows and positions) into its staging pair.
  absl::Status Issue(size_t index);
  int64_t PageEntries(size_t page) const {
    return std::min<int64_t>(page_tokens_, tokens() - static_cast<int64_t>(page) * page_tokens_);
  }

  Backend& backend_;
  const DeviceModel& model_;
  WindowGeometry window_;
  int64_t page_tokens_, max_rows_;
  int64_t hidden_, layers_count_;
  DType act_dtype_;
  size_t row_bytes_;                              // hidden · act dtype bytes
  std::map<int64_t, std::vector<char>> pending_;  // position -> [layers, hidden] act dtype
  // [layer][page] host: rows [page_tokens, hidden], then positions [page_tokens] i32.
  std::vector<std::vector<DeviceBuffer>> pages_;
  std::vector<int32_t> positions_;  // of the kept entries, in page order
  size_t host_bytes_ = 0;
  std::vector<float> download_;  // one Take's rows, f32
  // Device staging: two pages' rows and positions in flight (one per upload slot); one page
  // as f32, its K|V rows, K and V of the window dtype.
  DeviceBuffer rows_[2], positions_dev_[2];
  DeviceBuffer x_, kv_, k_, v_;
  DeviceBuffer iota_;  // [page_tokens] i32 0, 1, ...: a page's own rows and slots
  // The pass's plan: (layer, page) in attend order; items_[next_] is attended next.
  struct Item {
    int64_t layer;
    size_t page;
  };
  std::vector<Item> items_;
  size_t next_ = 0;
  std::optional<StagedAttention> attend_;   // over the recomputed K/V of one page
};

}  // namespace tandem::gpu_worker
