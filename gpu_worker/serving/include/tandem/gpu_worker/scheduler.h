// Scheduler: the one thread that owns an Engine (and with it the backend's device context) and
// serves many generations at once by continuous batching (Orca's iteration-level scheduling,
// vLLM's / TensorRT-LLM's in-flight batching).
//
// Each iteration:
//   1. runs the control jobs posted since the last one (Tokenize, CloseSession, ...; in order);
//   2. ends generations that finished, were cancelled or passed their deadline (their session
//      memory is freed at once);
//   3. admits waiting requests first come, first served while fewer than max_batch run:
//      Engine::Begin reserves what a request needs by its end (device window, page summaries,
//      CPU-node room); a request that does not fit while others run waits at the head of the
//      queue until one ends (never an out-of-memory failure mid-run); one that cannot fit even
//      alone fails with RESOURCE_EXHAUSTED; a turn of a session in use, and a one-shot request
//      whose document a running request is prefilling (it forks that request's session once
//      the prompt is in: Engine::PrefillWorthWaitingFor), wait while others go ahead;
//   4. runs one Engine::Step over every running generation: one decode token each, plus prompt
//      tokens of prefilling generations up to step_tokens in all (chunked prefill interleaved
//      with decode), divided by PrefillShares (prefill_shares.h): the shortest remaining prompt
//      first, and a step that completes a prompt carries no chunk of a longer one, so a short
//      request's first token is not held behind a long chunk; a prefill passed over for
//      prefill_aging_steps steps goes first, so none starves. Sequences of every mode share
//      the step. With EngineOptions::prefill_breaks, a step that feeds prompt tokens takes
//      breaks (pass_breaks.h): at a layer boundary where requests have arrived, or a prompt
//      outside the step can finish in one step, an interlude admits the new requests and runs
//      one step of the generations the paused step does not carry (those prompts, shortest
//      first, and the decode rows beside them), then the paused step goes on. So a short
//      prompt waits for about one layer of a long chunk, not the whole chunk. Decoding
//      requests ride along a prefill step (free: the weights are read once, but their next
//      token waits for the whole chunk), or, with max_decode_gap_ms, stay out of it and get an
//      interlude of their own once the oldest has waited that long (each costs about a decode
//      step's weight read). Interludes take no breaks of their own.
//
// Metrics (SchedulerOptions::metrics, tandem/metrics/worker_metrics.h): after each step the
// tokens it sampled (TTFT of first tokens, inter-token latencies, prompt tokens of prefills that
// completed) and the degraded layer attends; at each end the request's e2e latency and finish
// reason, or its error code; running / waiting and the device KV of running sequences each
// iteration: on the scheduler thread, O(batch) per step. Refusals of Submit are counted on the
// caller's thread.
//
// Thread-safe: Submit / Post / Run / Stop from any thread; callbacks and `done` run on the
// scheduler's thread and must not block. Destruction stops accepting work, runs what was
// accepted to its end, then joins.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/pass_breaks.h"
#include "tandem/gpu_worker/step_time_cap.h"
#include "tandem/metrics/worker_metrics.h"

namespace tandem::gpu_worker {

struct SchedulerOptions {
  int64_t max_batch = 64;      // generations running at once (at most step_tokens)
  int64_t max_waiting = 4096;  // requests queued beyond the running ones; more: refused
  int64_t step_tokens = 0;     // tokens per step (decode + prefill); 0 = the engine's chunk
  int64_t prefill_aging_steps = 4;
  // > 0: a step's prompt tokens are capped so that it takes about this long (StepTimeCap): a
  // request arriving during a long prefill waits for at most about one such step, and decoding
  // requests keep their inter-token latency. 0: steps take step_tokens.
  double max_step_ms = 0.0;
  // > 0 (needs EngineOptions::prefill_breaks): decode rows are not carried by steps that feed
  // prompt tokens; an interlude gives them their next token once the oldest has waited this
  // long since its last (inter-token latency about this much plus a decode step during long
  // prefills, at the price of about a decode step's time per interlude). 0: they ride along.
  double max_decode_gap_ms = 0.0;
  // Where to count (null: nothing is counted). Not owned; must outlive the scheduler.
  const metrics::WorkerMetrics* metrics = nullptr;
};

struct SchedulerStats {
  int64_t running = 0;
  int64_t waiting = 0;
  uint64_t steps = 0;
  uint64_t step_tokens = 0;  // tokens fed by all steps
  uint64_t interludes = 0;   // steps run inside a paused step (EngineOptions::prefill_breaks)
};

class Scheduler {
 public:
  using Done = std::function<void(absl::StatusOr<GenerateSummary>)>;

  // INVALID_ARGUMENT for options out of range.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(std::unique_ptr<Engine> engine,
                                                           const SchedulerOptions& options);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a generation; when it returns OK, `done` gets the summary or the error exactly once,
  // on the scheduler thread. UNAVAILABLE after Stop(), RESOURCE_EXHAUSTED when max_waiting
  // requests already wait (`done` is then not called).
  absl::Status Submit(GenerateRequest request, GenerateCallbacks callbacks, Done done);

  // Queues a control job, run between steps. Returns false (and drops the job) after Stop().
  bool Post(std::function<void(Engine&)> job);

  // Runs `job` on the scheduler thread and waits for its result.
  template <typename Fn>
  auto Run(Fn&& job) -> decltype(job(std::declval<Engine&>())) {
    using R = decltype(job(std::declval<Engine&>()));
    auto task = std::make_shared<std::packaged_task<R(Engine&)>>(std::forward<Fn>(job));
    std::future<R> result = task->get_future();
    if (!Post([task](Engine& engine) { (*task)(engine); })) {
      std::packaged_task<R(Engine&)> fallback(
          [](Engine&) -> R { return absl::UnavailableError("the engine is shutting down"); });
      result = fallback.get_future();
      fallback(*engine_);
    }
    return result.get();
  }

  SchedulerStats stats() const;
  // Stops accepting work; what was accepted still runs. Idempotent.
  void Stop();

 private:
  struct Pending {
    GenerateRequest request;
    GenerateCallbacks callbacks;
    Done done;
    Generation::Clock::time_point arrival;
  };
  struct Running {
    std::unique_ptr<Generation> generation;
    Done done;
    uint64_t order = 0;         // admission order (FCFS ties)
    int64_t skipped_steps = 0;  // consecutive steps its prefill got no tokens
    // What the metrics have seen of it: tokens sampled, and its sequence's degraded_steps.
    int64_t counted_tokens = 0;
    uint64_t counted_degraded = 0;
    bool in_pass = false;   // carried by a step now paused for an interlude: left alone
  };
  // The breaks of the scheduler's steps: Due and Interlude below.
  class StepBreaks final : public PassBreaks {
   public:
    explicit StepBreaks(Scheduler& scheduler) : scheduler_(scheduler) {}
    bool Due() override { return scheduler_.InterludeDue(); }
    void Interlude() override { scheduler_.Interlude(); }

   private:
    Scheduler& scheduler_;
  };

  Scheduler(std::unique_ptr<Engine> engine, const SchedulerOptions& options);
  void Loop();
  // Moves newly submitted requests to waiting_; returns the control jobs to run.
  std::deque<std::function<void(Engine&)>> TakeWork(bool* stop);
  // Moves newly submitted requests to waiting_ (control jobs stay queued for the loop).
  void TakeSubmitted();
  void EndFinished();
  // With nothing running: a slice of the kept sessions' settles (Engine::SettleIdle).
  void SettleIdleSlice();
  void Admit();
  // One step over the running generations; an interlude's carries only those not in the paused
  // step, and of the prompts only those that can finish in it (it runs only if one does).
  void StepOnce(bool interlude = false);
  // The prompt tokens a step may feed besides `decode_rows` decode rows.
  int64_t PromptBudget(int64_t decode_rows) const;
  // StepBreaks (scheduler_breaks.cc): whether requests arrived, a prompt outside the paused
  // step can finish in one step, or (max_decode_gap_ms) a decoding request outside it has
  // waited that long; admitting the arrivals and running that step.
  bool InterludeDue();
  // Whether a decoding generation outside the paused step has waited max_decode_gap_ms.
  bool DecodeGapReached() const;
  void Interlude();
  void Publish();
  // Metrics (no-ops without SchedulerOptions::metrics): what the last step sampled and
  // degraded; a request's end (its summary or error); a request refused with `status`.
  void CountStep();
  void CountEnd(const absl::StatusOr<GenerateSummary>& summary);
  void CountFailure(const absl::Status& status);

  std::unique_ptr<Engine> engine_;
  SchedulerOptions options_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void(Engine&)>> jobs_;  // guarded by mu_
  std::deque<Pending> submitted_;                  // guarded by mu_
  bool stopping_ = false;                          // guarded by mu_
  SchedulerStats stats_;                           // guarded by mu_ (a copy of the thread's)

  // The scheduler thread's own state.
  std::deque<Pending> waiting_;
  std::list<Running> running_;
  uint64_t next_order_ = 0;
  bool admission_blocked_ = false;  // the queue's head was refused for memory; nothing ended since
  SchedulerStats local_stats_;
  StepTimeCap step_cap_;
  StepBreaks breaks_{*this};
  double interlude_seconds_ = 0.0;   // wall time spent in interludes, summed
  uint64_t counted_evictions_ = 0;  // KvCacheManager::evictions() already exported
  uint64_t counted_parks_ = 0;      // KvCacheManager::parks() already exported
  uint64_t counted_unparks_ = 0;    // KvCacheManager::unparks() already exported
  std::thread thread_;
};

}  // namespace tandem::gpu_worker
