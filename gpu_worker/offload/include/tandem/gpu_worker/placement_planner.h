// Placement planner: which CPU attention node holds each (layer, kv-head) shard of one session.
//
// Cost model (FlexAttn §4.3.1, Eq. 10-11, with a per-call overhead and per-node scan rates):
// every decode step the worker sends layer l's query to every node that owns a shard of l and
// waits for all of them, so
//
//   time(l, n) = attend_overhead_seconds[n]·[n owns a shard of l]
//                + Σ_{shards s of l on n} scan_bytes[s] / scan_bytes_per_second[n]
//   step       = Σ_l max_n time(l, n)
//
// subject to Σ_{all shards on n} memory_bytes ≤ capacity_bytes[n] (memory is global per node,
// across layers) and nothing on a node with accepting == false. A shard is one kv head with its
// whole GQA group of query heads; it is never split.
//
// The search is a longest-processing-time greedy refined by local search (single moves and
// swaps within a layer; when memory binds, a move combined with a move or swap in another layer
// that makes room for it), as the FlexAttn paper (§6.7, its "KV-aware greedy") and DESIGN.md
// ("Placement and scaling") suggest, plus a few restarts and random perturbations while the
// time budget lasts.
//
// Pure functions of their arguments: no I/O, no global state, safe to call from any thread.
// Same input → same output (ties are broken by index, perturbations use a fixed seed) as long as
// the search ends before time_budget; it does for Llama-3-8B's 256 shards on 16 nodes (1-2 ms).
// A search cut short by the budget (e.g. 640 shards on 64 nodes) returns the best placement found
// by then, which is always feasible. Measured in placement_planner_test.
//
// Sizes: up to kMaxPlacementNodes nodes, kMaxPlacementShards shards and 2^20 (layer, node) cells;
// larger inputs are INVALID_ARGUMENT.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::gpu_worker {

inline constexpr size_t kMaxPlacementNodes = 4096;
inline constexpr size_t kMaxPlacementShards = size_t{1} << 20;

struct PlacementNode {
  // Measured on the node (Stats). <= 0 = unknown: the mean of the known (> 0) rates of all
  // nodes is used, or 1e10 when none is known.
  double scan_bytes_per_second = 0;
  double attend_overhead_seconds = 0;  // fixed cost of one Attend call on this node
  uint64_t capacity_bytes = 0;         // bytes this session may hold there (free + held there)
  bool accepting = true;               // false: draining / leaving: every shard must leave it
};

struct PlacementShard {
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  // Bytes the node reads per Attend for this shard (selected entries × head_dim × 2 × dtype
  // bytes).
  double scan_bytes = 0;
  uint64_t memory_bytes = 0;  // projected bytes it holds on a node
  int current_node = -1;      // index into nodes; -1 = not placed yet
};

struct PlacementOptions {
  // The search stops after this much wall-clock time (the first greedy start always completes,
  // in O(shards × nodes) plus a few ejections when memory is nearly full).
  std::chrono::microseconds time_budget{3000};
  // Replan keeps the current placement unless the modelled step improves by this fraction;
  // +infinity: only the forced moves.
  double min_relative_gain = 0.05;
  // Replan: the optional moves (shards leaving an accepting node they fit on) total at most this
  // many memory_bytes. Forced moves (unplaced shards, shards on non-accepting nodes or on nodes
  // over capacity) always happen and do not count against it.
  uint64_t max_moved_bytes = std::numeric_limits<uint64_t>::max();
  // Replan: optional moves are adopted only when the modelled gain is at least min_gain_seconds
  // per step (gains below it are measurement noise: rates and selections vary step to step),
  // and, when move_bytes_per_second > 0, only when they repay their copy within the session:
  //   gain × remaining_steps ≥ optional moved memory_bytes / move_bytes_per_second.
  // A copy runs beside decoding but takes the nodes' memory bandwidth and the link meanwhile.
  double min_gain_seconds = 0;
  double remaining_steps = 0;
  double move_bytes_per_second = 0;
};

struct PlacementPlan {
  std::vector<int> node_of;  // [shards.size()], index into nodes
  double step_seconds = 0;   // modelled step time (Σ over layers of the slowest node)
  uint64_t moved_bytes = 0;  // Σ memory_bytes of shards with current_node >= 0 and node_of != it
  int moved_shards = 0;      // how many shards those are
  int search_steps = 0;      // local-search moves / swaps applied
  bool changed = false;      // node_of differs from current_node for some shard
};

// Nodes of one hardware class (equal class_of[n] >= 0, e.g. the same attention thread count)
// are planned as equally fast: every node of the class gets the mean of the class's known
// rates (> 0), or keeps an unknown rate when none is known. class_of[n] < 0: node n keeps its
// own rate. Rates measured from Attend replies depend on the placement itself when nodes share
// a host's memory bandwidth (a node that scans alone reads faster), so planning on them feeds
// back into the plan. No-op when the sizes differ.
void PoolRatesByClass(std::span<PlacementNode> nodes, std::span<const int> class_of);

// The modelled step time of `node_of` ([shards.size()], index into nodes; -1 = unplaced, adds
// nothing). Returns +infinity when the sizes differ or an index is out of range. Does not check
// capacity or accepting.
double StepSeconds(std::span<const PlacementNode> nodes, std::span<const PlacementShard> shards,
                   std::span<const int> node_of);

// Balanced placement from scratch (current_node only breaks ties in its favour).
// Longest-processing-time greedy: heaviest shard first, onto the accepting node that would
// finish its layer earliest and still has room (taking all shards in one order is the per-layer
// LPT when memory is plentiful, and gives the heavy shards of every layer the fast nodes when it
// is not; a shard that fits nowhere gets room by moving one other shard). Then local search
// until nothing improves, repeated from three other starts (per-layer LPT that keeps each node
// near its share of capacity, the PlanUniform rule, memory-first packing) and from random
// perturbations of the best (iterated local search) while time_budget lasts.
// The modelled step is never above PlanUniform's once the search has reached that start.
// INVALID_ARGUMENT: NaN / infinite / negative costs, current_node out of range, duplicate
// (layer, kv_head), no accepting node, sizes over the limits.
// RESOURCE_EXHAUSTED (naming the bytes needed and available) when the shards do not fit.
absl::StatusOr<PlacementPlan> PlanBalanced(std::span<const PlacementNode> nodes,
                                           std::span<const PlacementShard> shards,
                                           const PlacementOptions& options = {});

// The cost-blind baseline: shard (layer, kv_head), taken in (layer, kv_head) order, goes to the
// ((layer·H_kv + kv_head) mod A)-th accepting node (A accepting nodes, H_kv = max kv_head + 1),
// or to the next accepting node in order (cyclically) with room.
// INVALID_ARGUMENT as PlanBalanced; RESOURCE_EXHAUSTED when a shard finds no node with room.
absl::StatusOr<PlacementPlan> PlanUniform(std::span<const PlacementNode> nodes,
                                          std::span<const PlacementShard> shards);

// Re-plans a live session starting from current_node.
//  1. Forced moves: unplaced shards, shards on non-accepting nodes and (when an accepting node
//     is over capacity) its largest shards are placed greedily like LPT; if one fits nowhere,
//     one other shard is moved to make room (that move counts as forced), and failing that the
//     from-scratch PlanBalanced is returned whatever it moves.
//  2. Local search from there for half the budget; optional moves stay within max_moved_bytes,
//     free moves first, then the best step gain per byte; moves that turn out not to lower the
//     step are reverted.
//  3. The from-scratch PlanBalanced (node labels matched to the current placement where nodes
//     are interchangeable, useless moves reverted) replaces the local result when it fits
//     max_moved_bytes and is better than it by min_relative_gain.
//  4. That result is adopted only if its modelled step is at least min_relative_gain below the
//     step after the forced moves, the gain is at least min_gain_seconds and it repays the
//     optional moves' copy (see PlacementOptions); otherwise only the forced moves are returned
//     (search_steps = 0).
// Capacity holds in the result. Errors as PlanBalanced; INVALID_ARGUMENT also for a negative or
// NaN min_relative_gain, min_gain_seconds, remaining_steps or move_bytes_per_second.
absl::StatusOr<PlacementPlan> Replan(std::span<const PlacementNode> nodes,
                                     std::span<const PlacementShard> shards,
                                     const PlacementOptions& options = {});

}  // namespace tandem::gpu_worker
