// ExactPlanner: how `exact` mode splits a sequence's offloaded KV (everything beyond the device
// window) between the paths that attend it exactly, so that one decode step takes the least time:
//
//   fetch      pinned host pages cross PCIe and the device attends over them (HeadInfer/FlexGen)
//   nodes      the CPU attention nodes attend densely (β = 0, every entry) where the KV lives
//   recompute  the layer inputs (activations) cross PCIe instead of K/V and the device recomputes
//              K = RoPE(x·Wk), V = x·Wv (KVPR); it pays only when an activation row is smaller
//              than the K+V row it replaces and the GEMM keeps up
//
// All paths run at the same time within a layer and their partial states merge by LSE, so the
// time of a layer is the slowest resource's. Per step (all L layers, N offloaded entries per
// (layer, kv head); shares f, n, r of the entries with f + n + r = 1):
//
//   PCIe    (f·K + r·X) / pcie
//   device  (f + r)·K / device_attend + r·F / gemm
//   nodes   n·K / Σ node rates + L·node_overhead   (0 when n = 0)
//   step    max of the three
// with K = L·N·2·H_kv·D·kv_bytes (K+V bytes), X = L·N·hidden·act_bytes (activation bytes) and
// F = L·N·2·hidden·2·H_kv·D (recompute GEMM flops).
//
// The node term spreads n·K over the nodes in proportion to their rates (the placement planner
// balances the shards; the fractional balance is the bound it approaches). Minimising the max
// is a linear programme in (f, r, T); PlanExactSplit solves it exactly by enumerating the
// vertices of its feasible polytope (3 variables, at most 8 constraints: ≤ 56 candidate vertices,
// each a 3x3 solve) once with nodes and once without them (the node overhead is a fixed cost of
// using them at all), and keeps the lower T. With recompute off it reduces to the closed form of
// two rates: f = (K/nodes + L·overhead) / (K/pcie' + K/nodes) with pcie' = min(pcie,
// device_attend), clamped to [0, 1] — where the falling and the rising time lines cross.
//
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tandem::gpu_worker {

// Rates of the paths (bytes or flops per second; 0 = path unavailable).
//
// PCIe uploads and the nodes' scans read the same host DRAM (on one host: the DMA engine and the
// node's cores share its bandwidth), so each path is slower while the other runs. The split is
// planned with the rates of the two paths running AT ONCE (pcie_bytes_per_second,
// node_bytes_per_second: ProbeNodeRates' concurrent probe, the nodes' rate then corrected by
// the sessions' measured attends); the rates of each path alone (the *_alone fields; 0 = not
// measured, taken equal) give the fetch-only step and the combined limit K / (pcie + nodes)
// the issue states its target against.
struct ExactPathRates {
  double pcie_bytes_per_second = 0;           // host -> device of pinned pages, nodes scanning
  double device_attend_bytes_per_second = 0;  // device attention over KV on the device (probe)
  double gemm_flops_per_second = 0;           // device MatMul, f32 x kv-dtype weights (probe)
  double node_bytes_per_second = 0;           // Σ over accepting nodes, PCIe streaming
  double node_overhead_seconds = 0;           // one Attend round trip (per layer and step)
  size_t nodes = 0;                           // accepting nodes
  double pcie_alone_bytes_per_second = 0;     // PCIe with the nodes idle (0: as above)
  double node_alone_bytes_per_second = 0;     // the nodes with PCIe idle (0: as above)

  double pcie_alone() const {
    return pcie_alone_bytes_per_second > 0 ? pcie_alone_bytes_per_second : pcie_bytes_per_second;
  }
  double node_alone() const {
    return node_alone_bytes_per_second > 0 ? node_alone_bytes_per_second : node_bytes_per_second;
  }
};

// What one step attends, per token.
struct ExactGeometry {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t hidden_size = 0;
  size_t kv_bytes = 2;          // bytes of one K or V element (the window dtype)
  size_t activation_bytes = 2;  // bytes of one stored activation element

  // K+V bytes of one token of one layer, and its activation row.
  double kv_row_bytes() const { return 2.0 * num_kv_heads * head_dim * kv_bytes; }
  double activation_row_bytes() const { return 1.0 * hidden_size * activation_bytes; }
};

struct ExactPlan {
  double fetch_share = 0;      // of the offloaded entries: host pages over PCIe
  double node_share = 0;       // on the CPU nodes
  double recompute_share = 0;  // activations over PCIe, K/V recomputed on the device
  // Modelled seconds per decode step for `tokens` offloaded entries (all layers).
  double pcie_seconds = 0, device_seconds = 0, node_seconds = 0, step_seconds = 0;
  // The same step with every entry fetched (offload mode: PCIe alone) and the combined
  // bandwidth limit K / (pcie' + Σ nodes) of the rates alone, the target.
  double fetch_only_seconds = 0;
  double combined_limit_seconds = 0;
  // Recompute: whether it lowers the step (solved with and without it), and why, in words
  // (the row sizes and the modelled gain or loss).
  bool recompute_pays = false;
  double recompute_gain = 0;  // 1 - step(with recompute) / step(without), >= 0
  std::string recompute_reason;
  int64_t tokens = 0;
};

struct ExactPlanOptions {
  // Let the plan use recompute when it pays (false: r = 0; the verdict is still computed).
  bool allow_recompute = false;
  // >= 0: force the fetch share (the rest on the nodes; recompute 0 unless forced too), for
  // tests and benchmarks.
  double force_fetch_share = -1;
  // >= 0 (with force_fetch_share): force the recompute share too (clamped to 1 - fetch).
  double force_recompute_share = -1;
};

// The split for `tokens` offloaded entries per (layer, kv head). Shares sum to 1; with no
// nodes (rates.nodes == 0 or node_bytes_per_second <= 0) the node share is 0; with no usable
// PCIe rate, everything goes to the nodes.
ExactPlan PlanExactSplit(const ExactPathRates& rates, const ExactGeometry& geometry, int64_t tokens,
                         const ExactPlanOptions& options = {});

// One line: shares per path, modelled times, the recompute verdict.
std::string FormatExactPlan(const ExactPlan& plan);
std::string FormatExactRates(const ExactPathRates& rates);

}  // namespace tandem::gpu_worker
