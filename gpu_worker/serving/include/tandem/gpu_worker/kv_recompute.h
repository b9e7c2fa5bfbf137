// Recomputing a hybrid sequence's offloaded K/V on the device from its token ids: what rebuilds
// the shards a lost CPU node held (remote_kv.h, "Failure model"; issue 14).
//
// The whole offloaded range is recomputed at once: a gpu-mode prefill of positions
// [0, sink + tokens) of the sequence's tokens into a temporary device window, whose K/V of
// positions [sink, sink + tokens) go to the sink layer by layer. The K/V are those of exact
// attention (the sequence's own were computed with its selected CPU part), so layers above the
// first may differ from the lost ones within the hybrid approximation; entries keep their
// positions' order, so page numbers (and the page index's summaries) still name the same
// positions. Not thread-safe: the engine's executor thread, between passes (it overwrites the
// runner's buffers, logits included).
//
// Exact sequences' node entries are a subset of the offloaded positions (exact_rebuild.h):
// RecomputeKvAt runs the prefill up to the last of them and keeps only them. Their K/V are those
// the sequence computed (exact attention both times), within float rounding.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "tandem/gpu_worker/exact_rebuild.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/remote_kv.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {

// Device bytes the temporary window of a recompute of `tokens` entries takes.
size_t RecomputeWindowBytes(const Sequence& seq, int64_t tokens, int64_t max_chunk);

// Runs the prefill and calls sink(layer, k, v, tokens) per layer with
//   k, v: [num_kv_heads, tokens, head_dim] of the window dtype (host; valid during the call).
// INVALID_ARGUMENT when the sequence has fewer than sink + tokens tokens; RESOURCE_EXHAUSTED
// when the temporary window does not fit the device; the sink's error.
absl::Status RecomputeOffloadedKv(ModelRunner& runner, Sequence& seq, int64_t tokens,
                                  int64_t max_chunk, const RebuiltLayerSink& sink);

// Device bytes the temporary window of a recompute of positions [0, positions) takes.
size_t RecomputeWindowBytesAt(const Sequence& seq, int64_t positions, int64_t max_chunk);

// The positions [0, n) `request` runs the prefill over (exact_rebuild.h: up to the end of the
// last run, and every token fed when it repairs). INVALID_ARGUMENT for unordered, overlapping
// or empty runs without a repair, or positions beyond the sequence's tokens.
absl::StatusOr<int64_t> RecomputePositions(const Sequence& seq, const RecomputeAtRequest& request);

// The prefill of RecomputePositions, then, when request.repair_from >= 0, the rewrite of the
// K/V of positions [repair_from, tokens fed) in seq.window (FAILED_PRECONDITION when some of
// them left it) and of their layer inputs pending in seq.offload (the prefill hands them to it:
// OffloadTier::TakeLayerInputs), then sink(layer, k, v, Σ count) per layer with the K/V of the
// runs' positions in the runs' order (none for empty runs). Errors as RecomputeOffloadedKv's.
absl::Status RecomputeKvAt(ModelRunner& runner, Sequence& seq, const RecomputeAtRequest& request,
                           int64_t max_chunk, const RebuiltLayerSink& sink);

}  // namespace tandem::gpu_worker

namespace tandem::gpu_worker {

// The recompute a NodeTier of `seq` rebuilds lost shards with (NodeTier::set_recompute): checks
// the temporary window's device bytes with `check_device` (RESOURCE_EXHAUSTED: try later), then
// RecomputeOffloadedKv. `runner` and `seq` must outlive the tier.
RecomputeKv MakeRecomputeKv(ModelRunner& runner, Sequence& seq, int64_t max_chunk,
                            std::function<absl::Status(size_t bytes)> check_device);

// The recompute an ExactTier of `seq` rebuilds its lost node entries with
// (ExactTier::set_recompute): checks the temporary window's device bytes with `check_device`,
// then RecomputeKvAt. `runner` and `seq` must outlive the tier.
RecomputeAt MakeRecomputeAt(ModelRunner& runner, Sequence& seq, int64_t max_chunk,
                            std::function<absl::Status(size_t bytes)> check_device);

// Between passes: rebuilds what `seq`'s tier lost with a CPU node, if anything (a failure is
// logged; the sequence stays degraded and a later call retries). Returns whether it rebuilt or
// failed trying (a prefill may have run): callers rebuild one sequence per step so that a node lost
// under many sessions does not stall every stream at once.
bool RebuildLostKv(Sequence& seq);

}  // namespace tandem::gpu_worker
