// The Scheduler's side of a step's breaks (pass_breaks.h, EngineOptions::prefill_breaks): what
// makes an interlude due at a layer boundary, and what it runs.
#include <chrono>
#include <mutex>

#include "tandem/gpu_worker/scheduler.h"

namespace tandem::gpu_worker {

void Scheduler::TakeSubmitted() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Pending& p : submitted_) waiting_.push_back(std::move(p));
  submitted_.clear();
}

bool Scheduler::InterludeDue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!submitted_.empty()) return true;   // arrivals: admitted (or refused) at once
  }
  // A prompt outside the paused step that one step finishes: one admitted in an earlier
  // interlude whose share fell short, or one admitted before the step that it left out.
  int64_t decode_rows = 0;
  for (const Running& r : running_) {
    if (!r.in_pass && !r.generation->finished() && !r.generation->prefilling()) ++decode_rows;
  }
  const int64_t budget = PromptBudget(decode_rows);
  for (const Running& r : running_) {
    const Generation& g = *r.generation;
    if (!r.in_pass && !g.finished() && g.prefilling() && g.remaining() <= budget) return true;
  }
  return DecodeGapReached();
}

bool Scheduler::DecodeGapReached() const {
  if (options_.max_decode_gap_ms <= 0) return false;
  const Generation::Clock::time_point now = Generation::Clock::now();
  const auto gap = std::chrono::duration<double, std::milli>(options_.max_decode_gap_ms);
  for (const Running& r : running_) {
    const Generation& g = *r.generation;
    if (r.in_pass || g.finished() || g.prefilling()) continue;
    if (now - g.last_token >= gap) return true;
  }
  return false;
}

void Scheduler::Interlude() {
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  TakeSubmitted();
  EndFinished();   // those outside the paused step; a place in the batch may free up
  Admit();
  StepOnce(/*interlude=*/true);
  EndFinished();   // a short request that finished here answers now, not after the paused step
  interlude_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace tandem::gpu_worker
