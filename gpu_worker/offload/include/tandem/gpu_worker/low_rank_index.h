// LowRankIndex: every offloaded key of a sequence, as coordinates in a rank-R basis of its
// (layer, kv head)'s early keys, kept in device memory for PageScore::kLowRank (Loki's
// observation that keys live near a low-rank subspace; DESIGN "Selection").
//
// Per layer, on the device:
//   coords  [num_kv_heads, capacity_tokens, rank] int8 and scales [num_kv_heads, capacity_tokens]
//           f32 (backend.h's ProjectKeys): row i of head g is offloaded entry i of that
//           (layer, kv head), in the order the CPU nodes number them (page p = rows p·P..).
//   basis   [num_kv_heads, head_dim, rank] f32: the top `rank` eigenvectors of Σ k·kᵀ over the
//           first calib_tokens offloaded keys of the head (post-RoPE, uncentred), made once.
//   staging [num_kv_heads, staging_capacity, head_dim] of the KV dtype: those first keys, copied
//           as they leave the window, until the basis exists (then projected and freed); room
//           for min(calib_tokens, the reserved tokens), grown with the reservation.
// So a layer is `ready` (every offloaded key has coordinates) once its basis is installed;
// before that the caller scores pages another way. Memory per offloaded token and kv head:
// rank + 4 bytes (0.5·D + 4 at the default rank D/2: 68 bytes for D = 128, 1/7.5 of bf16 K+V).
//
// The basis is made off the step: a layer's staging fills (state kDue), Advance() queues the
// KeyGram of every due layer at once, downloads them with one wait and hands the D×D
// eigendecompositions of all (layer, kv head) pairs to a background job (kSolving; ~5 ms each
// at D = 128, 256 of them for a Llama-3-8B session: threads over the pairs); a later Advance()
// installs the bases the job made (upload, projection of the staged keys, staging freed). An
// Append of keys beyond the staging to a layer without its basis waits for it instead.
//
// Not thread-safe: the engine's executor thread owns it with its PageIndex (the background job
// touches only its own copies of the Gram matrices).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/parking_pool.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {

struct LowRankOptions {
  // Special rank: half the head dimension (the default; measured in BENCHMARKS "Accuracy as the
  // context grows").
  static constexpr int64_t kHalfHeadDim = -1;
  int64_t rank = 0;             // coordinates per key, 1..head_dim; 0 = no low-rank keys
  int64_t calib_tokens = 4096;  // offloaded keys per (layer, kv head) that give its basis

  bool enabled() const { return rank != 0; }
  // The rank for a head dimension (kHalfHeadDim resolved).
  int64_t RankFor(int64_t head_dim) const {
    return rank == kHalfHeadDim ? std::max<int64_t>(1, head_dim / 2) : rank;
  }
};

// INVALID_ARGUMENT naming the option when `options` cannot serve keys of head_dim (a rank
// outside -1..head_dim, calib_tokens < 1).
absl::Status ValidateLowRankOptions(const LowRankOptions& options, int64_t head_dim);

class LowRankIndex {
 public:
  // INVALID_ARGUMENT for a rank outside 1..head_dim, calib_tokens < 1 or a KV dtype other than
  // f32/bf16; RESOURCE_EXHAUSTED as Reserve.
  static absl::StatusOr<LowRankIndex> Create(Backend& backend, const WindowGeometry& geometry,
                                             const LowRankOptions& options, int64_t reserve_tokens);

  LowRankIndex(LowRankIndex&&) = default;
  LowRankIndex& operator=(LowRankIndex&&) = default;
  ~LowRankIndex();   // waits for a background job still running (it owns what it reads)

  // Device bytes for `tokens` offloaded entries per (layer, kv head): coordinates, scales,
  // basis, and the staging (counted as held: it is while the first keys arrive).
  static size_t BytesFor(const WindowGeometry& geometry, const LowRankOptions& options,
                         int64_t tokens);

  // Ensures room for `tokens` coordinate rows per (layer, kv head) (grows geometrically and
  // copies the rows written). RESOURCE_EXHAUSTED (with the bytes asked) leaves it unchanged.
  absl::Status Reserve(int64_t tokens);

  // The keys in slots [first_slot, first_slot + count) of `layer`'s k_cache
  // [num_kv_heads, capacity, head_dim] (the index's dtype), as that layer's next `count`
  // offloaded entries: staged while the basis is not made (the layer is due once the staging
  // fills), projected once it is. Keys beyond a full staging wait for the layer's basis (made
  // here when Advance has not started it).
  absl::Status Append(int64_t layer, const void* k_cache, int64_t capacity, int64_t first_slot,
                      int64_t count);
  // Installs the bases the background job has made (with `wait`: waits for it), then starts
  // the bases of the layers due (one KeyGram each, one download, one job for all). Cheap when
  // nothing is due or finished: call it once per step or after a batch of appends.
  absl::Status Advance(bool wait = false);
  // Whether some layer's basis is due or being made.
  bool calibrating() const;
  // Whether a background job is making bases (Advance installs them once it is done).
  bool solving() const { return job_.has_value(); }
  // Keys an Append may still stage before a layer's staging fills (its basis falls due), the
  // most over the layers still staging; 0 when none stages. An Append of more waits for the
  // basis (it must project the rest): callers that can split their appends stop here.
  int64_t tokens_until_due() const;

  // Whether every offloaded key of `layer` has coordinates (its basis is installed).
  bool ready(int64_t layer) const { return layers_[layer].state == State::kMade; }
  // The layer's keys for SelectPagesParams::low_rank (FAILED_PRECONDITION unless ready).
  absl::StatusOr<LowRankKeys> Keys(int64_t layer, int64_t page_tokens, float softmax_scale) const;

  // A copy on the device with room for `reserve_tokens` rows or the rows written.
  absl::StatusOr<LowRankIndex> Fork(int64_t reserve_tokens) const;

  // Parking (as PageIndex::Park): the rows written, the bases and the staged keys go to a space
  // of `pool`; the device buffers are freed until Unpark().
  absl::Status Park(ParkingPool& pool);
  absl::Status Unpark();
  bool parked() const { return parked_.held(); }
  size_t parked_bytes() const { return parked_.held_bytes(); }
  size_t ParkBytes() const;
  size_t resident_bytes() const;  // device bytes with every buffer held
  size_t device_bytes() const { return parked() ? 0 : resident_bytes(); }

  int64_t rank() const { return rank_; }
  int64_t calib_tokens() const { return calib_tokens_; }
  int64_t tokens(int64_t layer) const { return layers_[layer].tokens; }
  int64_t capacity_tokens() const { return capacity_tokens_; }
  // Device pointers of a layer (tests): null while not allocated.
  const int8_t* coords(int64_t layer) const { return layers_[layer].coords.as<int8_t>(); }
  const float* scales(int64_t layer) const { return layers_[layer].scales.as<float>(); }
  const float* basis(int64_t layer) const { return layers_[layer].basis.as<float>(); }

 private:
  // A layer's calibration: keys staged, staging full (basis due), basis being made by the
  // background job, basis installed (keys projected as they come).
  enum class State { kStaging, kDue, kSolving, kMade };
  struct Layer {
    DeviceBuffer coords;   // [num_kv_heads, capacity_tokens, rank] int8
    DeviceBuffer scales;   // [num_kv_heads, capacity_tokens] f32
    DeviceBuffer basis;    // [num_kv_heads, head_dim, rank] f32, once made
    DeviceBuffer staging;  // [num_kv_heads, staging_capacity, head_dim], until the basis is made
    int64_t staging_capacity = 0;   // keys per head the staging holds (<= calib_tokens)
    int64_t tokens = 0;    // offloaded entries appended (staged or projected)
    State state = State::kStaging;
    bool basis_made() const { return state == State::kMade; }
  };
  // The eigendecompositions of one Advance's due layers, running on a background thread:
  // bases [layers.size(), num_kv_heads, head_dim, rank] f32 in `layers` order.
  struct BasisJob {
    std::vector<int64_t> layers;
    std::future<absl::StatusOr<std::vector<float>>> bases;
    std::chrono::steady_clock::time_point started;   // (the debug log's timing)
  };
  // One strided device tensor of a layer for copies: `rows` rows of `row_bytes` used bytes,
  // `pitch` bytes apart in `buffer`.
  struct Part {
    DeviceBuffer Layer::*buffer;
    size_t pitch = 0;
    size_t row_bytes = 0;
    size_t rows = 0;
  };
  LowRankIndex() = default;
  std::vector<Part> PartsOf(const Layer& layer) const;
  size_t BufferBytes(DeviceBuffer Layer::*buffer, int64_t capacity_tokens) const;
  size_t KeyBytes() const { return geometry_.head_dim * DTypeBytes(geometry_.dtype); }
  // Stages `count` keys from slot first_slot (count <= calib_tokens - tokens).
  absl::Status Stage(Layer& layer, const void* k_cache, int64_t capacity, int64_t first_slot,
                     int64_t count);
  // Queues the KeyGram of every due layer, downloads them and starts job_ (none running).
  absl::Status StartBases();
  // Installs job_'s bases (waiting for them): each layer's basis uploaded, its staged keys
  // projected, its staging freed. Nothing to do without a job.
  absl::Status InstallBases();
  absl::Status Project(Layer& layer, const void* k, int64_t capacity, int64_t first_slot,
                       int64_t count);

  Backend* backend_ = nullptr;
  WindowGeometry geometry_;
  int64_t rank_ = 0;
  int64_t calib_tokens_ = 0;
  int64_t capacity_tokens_ = 0;
  std::vector<Layer> layers_;
  std::optional<BasisJob> job_;
  ParkingSpace parked_;
};

}  // namespace tandem::gpu_worker
