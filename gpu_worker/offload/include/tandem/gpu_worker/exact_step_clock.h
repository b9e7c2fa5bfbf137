// ExactStepClock: where an exact sequence's decode steps spend their time, per path, on the
// host's clock (issue 16: the planner's rates corrected by measured steps, and the breakdown
// tandem-bench reports).
//
// Within a layer the two paths run at once and the layer ends when both are done; between
// layers neither path can start the next layer's attention before the device has the layer's
// output (q of layer l+1 needs every part of layer l). The tier marks, per layer:
//
//   Start(l)       the nodes get q of layer l: the runner downloaded q once the device had
//                  finished layer l-1, its fetched pages included
//   NodesDone(l)   the nodes' reply is in (FinishAttend, after the fetched pages' attends were
//                  queued on the device)
//   DeviceDone(l)  right after: a wait for the device's queue returned, i.e. the layer's
//                  fetched pages (and recomputed ones) were attended
//
// and the clock sums, over a step's layers:
//
//   node_busy     NodesDone(l) - Start(l)        the nodes' attend, round trip included
//   fetch_excess  DeviceDone(l) - NodesDone(l)   the fetched pages finishing after the nodes
//   tail          Start(l+1) - DeviceDone(l)     merges, the layer's GEMMs, the next q: the
//                                                nodes idle (PCIe keeps prefetching the next
//                                                layer's first pages)
//   span          node_busy + fetch_excess + tail: the step's layers
//
// The last layer's tail runs into the logits and the next step: a step's tail is the sum over
// layers 0..L-2 scaled by L / (L-1) (the other sums cover all L layers).
//
// Not thread-safe: the tier's thread owns it.
#pragma once

#include <chrono>
#include <cstdint>

namespace tandem::gpu_worker {

// Seconds summed over steps (each step's over its layers), and the steps summed.
struct ExactStepTimes {
  double node_busy_s = 0, fetch_excess_s = 0, tail_s = 0, span_s = 0;
  int64_t steps = 0;

  ExactStepTimes& operator+=(const ExactStepTimes& o);
  // Per step (zeros when no step was timed).
  ExactStepTimes PerStep() const;
};

class ExactStepClock {
 public:
  using Clock = std::chrono::steady_clock;

  explicit ExactStepClock(int64_t num_layers) : num_layers_(num_layers) {}

  // A mark at `now` (the tier passes Clock::now(); tests pass their own times). Start of layer
  // 0 begins a step (an unfinished one is dropped); marks out of order drop the step.
  void Start(int64_t layer, Clock::time_point now);
  void NodesDone(int64_t layer, Clock::time_point now);
  void DeviceDone(int64_t layer, Clock::time_point now);
  // Ends the step without its marks (a failed or cancelled pass).
  void Abandon() { state_ = State::kIdle; }

  // Completed steps since the last Take (scaled as above), then forgets them.
  ExactStepTimes Take();
  // Every completed step of the clock's life (not reset by Take).
  const ExactStepTimes& total() const { return total_; }

 private:
  enum class State { kIdle, kStarted, kNodesDone, kDeviceDone };
  void Drop() { state_ = State::kIdle; }

  int64_t num_layers_;
  State state_ = State::kIdle;
  int64_t layer_ = -1;
  Clock::time_point start_, nodes_done_, device_done_;
  ExactStepTimes step_;     // the step in progress (raw sums)
  ExactStepTimes pending_;  // completed since Take
  ExactStepTimes total_;
};

}  // namespace tandem::gpu_worker
