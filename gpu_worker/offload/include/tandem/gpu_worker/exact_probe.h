// Start-up measurements of the rates ExactPlanner (exact_planner.h) splits by, and the book that
// keeps them corrected online.
//
//   ProbeDeviceRates: PCIe host -> device (a page-locked buffer over the upload stream, as the
//     streamer copies pages), device attention (WindowAttention over one device-resident page
//     of K/V) and the recompute GEMM (MatMul of activations by a [2·H_kv·D, hidden] weight), each
//     timed between Synchronize calls, best of a few runs after a warm-up.
//   ProbeNodeRates: a probe session on every accepting CPU node (one kv head per node, one
//     layer) holding node_bytes of K/V each; the nodes attend densely over it at once and the
//     aggregate rate is the bytes over the slowest node's wall time (round trip included).
//     Given the backend, it then times the two paths AT ONCE, as exact mode runs them: the
//     PCIe DMA and the nodes' scans read the same host DRAM (on the H100 host: 16 cores,
//     memcpy 75-105 GB/s, PCIe 55 GB/s), so each is slower while the other runs and a split
//     planned from the rates alone leaves the slower-than-modelled path last. Two timed runs
//     (best of `repeats` each, after a warm-up):
//       nodes under PCIe load  uploads queued for ~3x the nodes' time alone, then one attend:
//                              the attend's wall time gives the nodes' rate together;
//       PCIe under node load   one attend started, then uploads of ~half the nodes' time
//                              alone, waited for: their wall time gives PCIe's rate together.
//     The rates together become pcie_bytes_per_second / node_bytes_per_second (never above
//     the rates alone, which are kept in the *_alone fields).
//
// ExactRateBook: the rates every exact tier of an engine plans with. Tiers feed it the node
// rates their sessions measure (RemoteKv's moving averages of Attend replies) between steps;
// the book keeps an exponential moving average. Not thread-safe: the engine's executor thread
// owns it (with the tiers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/exact_planner.h"
#include "tandem/gpu_worker/exact_step_clock.h"
#include "tandem/gpu_worker/node_pool.h"

namespace tandem::gpu_worker {

struct ExactProbeOptions {
  size_t pcie_bytes = size_t{64} << 20;       // one upload of this size
  size_t device_kv_bytes = size_t{32} << 20;  // K+V the device attends over
  double gemm_flops = 4e9;                    // flops of one probe GEMM (rows chosen to match)
  // K+V per node; capped at a quarter of the node's free memory. Large enough that one
  // attend (~5 ms at 50 GB/s) dwarfs the round trip and the timer.
  size_t node_bytes = size_t{256} << 20;
  int repeats = 3;  // timed runs after one warm-up; the best counts
  int attend_deadline_ms = 5000;
};

// The most device bytes ProbeDeviceRates holds at once (its probes run one after the other),
// counting its page-locked buffer too when `host_is_device` (the cpu backend); the memory
// estimator's (memory_plan.h), no allocation.
size_t ProbeDeviceBytes(const ExactGeometry& geometry, DType kv_dtype, bool host_is_device,
                        const ExactProbeOptions& options = {});

// Device-side rates for a model of this geometry and KV dtype. Errors: the backend's.
absl::StatusOr<ExactPathRates> ProbeDeviceRates(Backend& backend, const ExactGeometry& geometry,
                                                DType kv_dtype,
                                                const ExactProbeOptions& options = {});

// Fills rates.nodes, node_bytes_per_second and node_overhead_seconds from a probe of the
// accepting nodes (head_dim, kv dtype of the model). No accepting node: nodes = 0, OK. With
// `pcie` (the backend whose uploads rates.pcie_bytes_per_second measured, > 0) also the two
// paths at once: node_alone_bytes_per_second / pcie_alone_bytes_per_second keep the rates
// alone and node_bytes_per_second / pcie_bytes_per_second become the rates together. Uses the
// backend's upload slot 0 and pcie_bytes of page-locked and device memory (as the PCIe probe).
// A failure of that part is logged and leaves the rates alone (the split then ignores the
// contention); the nodes' probe's own errors are returned.
absl::Status ProbeNodeRates(NodePool& pool, const ExactGeometry& geometry, DType kv_dtype,
                            ExactPathRates& rates, const ExactProbeOptions& options = {},
                            Backend* pcie = nullptr);

class ExactRateBook {
 public:
  explicit ExactRateBook(const ExactPathRates& measured)
      : rates_(measured), round_trip_seconds_(measured.node_overhead_seconds) {}
  // ProbeDeviceRates + ProbeNodeRates (with the concurrent probe), logged. The backend's or
  // the nodes' errors.
  static absl::StatusOr<std::unique_ptr<ExactRateBook>> Measure(
      Backend& backend, NodePool& pool, const ExactGeometry& geometry, DType kv_dtype,
      const ExactProbeOptions& options = {});
  const ExactPathRates& rates() const { return rates_; }
  // A measured aggregate node rate (bytes/s over all nodes a session uses): the first replaces
  // the probe's, later ones enter an EMA with weight 0.2. Ignored unless finite and > 0.
  void RecordNodeRate(double bytes_per_second);
  uint64_t node_samples() const { return node_samples_; }
  // One session's measured step (ExactStepClock, per step, both paths in use): the PCIe
  // crossed `fetched_bytes` and the nodes scanned `node_bytes` over `layers` layers. Moves,
  // by the EMA of RecordNodeRate (the first sample replaces):
  //   when the modelled scan is at least kMinRatedScanSecondsPerLayer a layer (the nodes'
  //   side of the step is their scan):
  //     node_bytes_per_second  to node_bytes / (node_busy - L · round trip) (only while that
  //                          is at least half the busy time; one step moves the rate by at most
  //                          kMaxRateStep either way), the round trip
  //                          being the overhead the book started with (the probe's): a step
  //                          shows the scan rate the probe missed (a 256 MiB probe said
  //                          78.7 GB/s; a 512K step's nodes scanned 41 GB in 806 ms, ~51 GB/s,
  //                          beside the DMA, H200 host, d84414c);
  //     node_overhead_seconds  to the round trip + tail / L (the device's part of each layer
  //                          between the nodes' reply and the next query);
  //   otherwise (a small session: fixed costs dominate)
  //     node_overhead_seconds  to (node_busy + tail) / L - node_bytes / (node rate · L), >= 0: the
  //                          per-layer time that makes the plan's node term equal the nodes'
  //                          measured side of the step (round trips, and the layers' GEMMs and
  //                          q downloads during which the nodes wait for the next q);
  //   pcie_bytes_per_second  to fetched_bytes / span, only when the fetched pages finished
  //                          after the nodes by more than kFetchBoundShare of the span (the
  //                          DMA then ran through the step; otherwise the step bounds its rate
  //                          only from below, and the rate together stays as probed), and
  //                          only when the modelled transfer is at least
  //                          kMinRatedFetchSecondsPerLayer a layer: below that the span is
  //                          launches, events and the layers' compute, and fetched / span would
  //                          read those fixed costs as a slow link (a 1000-token toy session
  //                          on an H200 drove the rate from 20 GB/s to ~0.1 and its fetch
  //                          share from 0.48 to 0.03).
  // Ignored without a span, bytes or a node rate.
  void RecordStep(const ExactStepTimes& per_step, double fetched_bytes, double node_bytes,
                  int64_t layers);
  static constexpr double kFetchBoundShare = 0.05;
  static constexpr double kMinRatedFetchSecondsPerLayer = 5e-4;
  static constexpr double kMinRatedScanSecondsPerLayer = 5e-4;
  static constexpr double kMaxRateStep = 2.0;
  uint64_t step_samples() const { return overhead_samples_; }
  uint64_t pcie_samples() const { return pcie_samples_; }

 private:
  ExactPathRates rates_;
  double round_trip_seconds_ = 0;  // the starting node overhead: one Attend's round trip
  uint64_t node_samples_ = 0;
  uint64_t overhead_samples_ = 0;
  uint64_t pcie_samples_ = 0;
};

}  // namespace tandem::gpu_worker
