// Synthetic contexts for tandem-bench: sequences that hold `context` positions of random KV in
// each attention mode's layout, made without a prefill (a 512K-token prefill of an 8B model
// would cost minutes of GPU time, and decode speed does not depend on the values).
//
//   gpu      every position in the device window (kUnlimited)
//   offload  sink + recent window on the device, the rest in host pages (a HostTier)
//   hybrid   sink + recent window on the device, the rest appended to the CPU nodes through
//            RemoteKv::Append (the real transport; a NodeTier), with MAW drawn so that a chosen share of
//            the offloaded entries passes the node's salience threshold β / n_gpu; with
//            selection = pages, page summaries of random keys on the device instead
//   exact    sink + recent window on the device, the rest split as the ExactPlanner says
//            between host pages, the CPU nodes (a pages session: dense attends) and, with
//            exact_recompute, random layer inputs recomputed into K/V (an ExactTier)
//
// The window's K/V are RandomFill'ed on the device; offloaded K/V come from a pool of random
// bf16 rows reused at varying offsets (random, not zeros: METHOD.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/device_model.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/low_rank_index.h"
#include "tandem/gpu_worker/model_config.h"
#include "tandem/gpu_worker/node_pool.h"
#include "tandem/gpu_worker/remote_kv.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::bench {

struct SyntheticContextOptions {
  int64_t context = 0;          // positions held before decoding starts
  int64_t extra_positions = 0;  // room for the tokens decoded afterwards
  int64_t window = 4096;        // offload / hybrid: recent tokens on the device
  int64_t sink = 4;
  int64_t block = 64;           // tokens per evicted block (window and CPU node blocks)
  int64_t max_chunk = 512;      // the runner's max_chunk (window ring sizing)
  int64_t page_tokens = 16384;  // offload: tokens per host page
  double share = 0.1;           // hybrid: share of offloaded entries selected, in (0, 1]
  // hybrid: per-shard shares, [layers * kv_heads] (layer-major), each in (0, 1]; empty = `share`
  // for every shard. HGCA's selection keeps <1% to 30% depending on the head.
  std::vector<double> head_shares;
  gpu_worker::PlacementPolicy placement = gpu_worker::PlacementPolicy::kBalanced;
  bool pool_node_rates = true;   // RemoteKvOptions::pool_rates_by_threads
  uint32_t shm_spin_us = 10;     // RemoteKvOptions::shm_spin_us (the worker waiting for answers)
  float beta = 1.0f;            // hybrid: the session's β
  int64_t append_tokens = 8192; // hybrid: tokens per RemoteKv::Append call
  // hybrid: kPages sessions get page summaries on the device (PageIndex, of random keys with
  // summary_page_tokens-token pages) and no selected copy on the nodes.
  gpu_worker::SelectionRule selection = gpu_worker::SelectionRule::kMaw;
  gpu_worker::PagePolicy page_policy;
  int64_t summary_page_tokens = 16;
  gpu_worker::LowRankOptions low_rank;   // kPages: the summaries' low-rank key coordinates
  uint64_t seed = 1;
  // exact: the rates the split is planned with (ExactPlanner; required), and >= 0 a forced
  // share of the offloaded entries in host pages (the rest on the CPU nodes, dense).
  gpu_worker::ExactRateBook* exact_rates = nullptr;
  double exact_fetch_share = -1;
  // exact: let the plan recompute part of the entries from layer inputs (KVPR) where its
  // verdict says it pays; those entries get random layer inputs (rows of the model's
  // activation dtype) instead of K/V. Needs `model` (its weights recompute K/V).
  bool exact_recompute = false;
  double exact_recompute_share = -1;  // >= 0 with exact_fetch_share: forced (exact_planner.h)
  const gpu_worker::DeviceModel* model = nullptr;
};

// INVALID_ARGUMENT for inconsistent options; the errors of the window, the host pages and the
// CPU nodes (RESOURCE_EXHAUSTED when memory runs out). pool is needed for hybrid only.
absl::StatusOr<std::unique_ptr<gpu_worker::Sequence>> MakeSyntheticSequence(
    gpu_worker::Backend& backend, const gpu_worker::ModelConfig& config,
    gpu_worker::NodePool* pool, gpu_worker::AttentionMode mode, const std::string& id,
    const SyntheticContextOptions& options);

}  // namespace tandem::bench
