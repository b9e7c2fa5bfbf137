#include "tandem/gpu_worker/exact_step_clock.h"

namespace tandem::gpu_worker {
namespace {

double Seconds(ExactStepClock::Clock::time_point from, ExactStepClock::Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

ExactStepTimes& ExactStepTimes::operator+=(const ExactStepTimes& o) {
  node_busy_s += o.node_busy_s;
  fetch_excess_s += o.fetch_excess_s;
  tail_s += o.tail_s;
  span_s += o.span_s;
  steps += o.steps;
  return *this;
}

ExactStepTimes ExactStepTimes::PerStep() const {
  if (steps <= 0) return {};
  const double n = static_cast<double>(steps);
  return {node_busy_s / n, fetch_excess_s / n, tail_s / n, span_s / n, 1};
}

void ExactStepClock::Start(int64_t layer, Clock::time_point now) {
  if (layer == 0) {
    step_ = {};
  } else if (state_ == State::kDeviceDone && layer_ == layer - 1) {
    step_.tail_s += Seconds(device_done_, now);
  } else {
    return Drop();
  }
  layer_ = layer;
  start_ = now;
  state_ = State::kStarted;
}

void ExactStepClock::NodesDone(int64_t layer, Clock::time_point now) {
  if (state_ != State::kStarted || layer_ != layer) return Drop();
  step_.node_busy_s += Seconds(start_, now);
  nodes_done_ = now;
  state_ = State::kNodesDone;
}

void ExactStepClock::DeviceDone(int64_t layer, Clock::time_point now) {
  if (state_ != State::kNodesDone || layer_ != layer) return Drop();
  step_.fetch_excess_s += Seconds(nodes_done_, now);
  device_done_ = now;
  state_ = State::kDeviceDone;
  if (layer + 1 < num_layers_) return;
  // The last layer: the tail was summed over L - 1 layers.
  if (num_layers_ > 1) {
    step_.tail_s *= static_cast<double>(num_layers_) / static_cast<double>(num_layers_ - 1);
  }
  step_.span_s = step_.node_busy_s + step_.fetch_excess_s + step_.tail_s;
  step_.steps = 1;
  pending_ += step_;
  total_ += step_;
  state_ = State::kIdle;
}

ExactStepTimes ExactStepClock::Take() {
  const ExactStepTimes taken = pending_;
  pending_ = {};
  return taken;
}

}  // namespace tandem::gpu_worker
