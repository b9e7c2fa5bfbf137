// PassBreaks: other work between two layers of a long pass (issue 29 item 3).
//
// A prefill chunk at a long prefix keeps the device busy for tens to hundreds of milliseconds;
// a request that arrives meanwhile would wait for all of it before its own pass starts. A pass
// given breaks (ModelRunner::Step) keeps the host about one layer ahead of the device and, at
// each layer boundary, asks Due(); when it says yes, the pass parks its state (the residual
// stream of its rows, its positions and window slots), lets Interlude() run other passes to
// their end, and goes on with its next layer where it stopped. The interrupted pass's results
// are those of the same pass without breaks: its layers run in the same order on the same
// inputs; only other sequences' passes run between them.
//
// Only a pass whose attention stays on the device takes breaks (no segment with offloaded
// entries or a tier that keeps layer inputs, one micro-batch, no log-prob targets, no device
// marks): the CPU nodes' in-flight attends and the tiers' per-pass state are not parked.
#pragma once

namespace tandem::gpu_worker {

class PassBreaks {
 public:
  virtual ~PassBreaks() = default;
  // At a layer boundary, once the device has finished all but the last layer queued: whether
  // other work waits that Interlude would run now. Called once per layer; keep it cheap.
  virtual bool Due() = 0;
  // Runs the waiting work on the pass's thread. It may run ModelRunner passes (Step, Forward,
  // SettleSlice) of other sequences, never of the interrupted pass's sequences. Its errors are
  // its own (the interrupted pass goes on).
  virtual void Interlude() = 0;
};

}  // namespace tandem::gpu_worker
