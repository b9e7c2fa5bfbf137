#include "tandem/gpu_worker/scheduler.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "tandem/gpu_worker/prefill_shares.h"

namespace tandem::gpu_worker {
namespace {

// Steps with fewer prompt tokens time the cap's fixed part (StepTimeCap), and a capped step may
// still feed this many (or step_tokens if smaller): the fixed part dominates smaller steps.
constexpr int64_t kMinTimedPromptTokens = 64;

}  // namespace

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(std::unique_ptr<Engine> engine,
                                                             const SchedulerOptions& options) {
  if (engine == nullptr) return absl::InvalidArgumentError("scheduler without an engine");
  SchedulerOptions o = options;
  const int64_t chunk = engine->max_step_tokens();
  if (o.step_tokens == 0) o.step_tokens = chunk;
  if (o.step_tokens < 1 || o.step_tokens > chunk) {
    return absl::InvalidArgumentError(absl::StrCat("step_tokens must be in 1..", chunk,
                                                   " (the prefill chunk), got ", o.step_tokens));
  }
  if (o.max_batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_batch must be >= 1, got ", o.max_batch));
  }
  // Every running generation feeds at least one token per step.
  o.max_batch = std::min(o.max_batch, o.step_tokens);
  if (o.max_waiting < 0) return absl::InvalidArgumentError("max_waiting must be >= 0");
  if (o.prefill_aging_steps < 1) {
    return absl::InvalidArgumentError("prefill_aging_steps must be >= 1");
  }
  if (!(o.max_step_ms >= 0.0 && o.max_step_ms <= 3.6e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_step_ms must be in 0..3600000 (0 = no cap), got ", o.max_step_ms));
  }
  if (!(o.max_decode_gap_ms >= 0.0 && o.max_decode_gap_ms <= 3.6e6)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_decode_gap_ms must be in 0..3600000 (0 = decode rows ride along), got ",
        o.max_decode_gap_ms));
  }
  if (o.max_decode_gap_ms > 0 && !engine->options().prefill_breaks) {
    return absl::InvalidArgumentError(
        "max_decode_gap_ms needs prefill breaks (EngineOptions::prefill_breaks)");
  }
  return std::unique_ptr<Scheduler>(new Scheduler(std::move(engine), o));
}

Scheduler::Scheduler(std::unique_ptr<Engine> engine, const SchedulerOptions& options)
    : engine_(std::move(engine)),
      options_(options),
      step_cap_(options.max_step_ms,
                std::min<int64_t>(kMinTimedPromptTokens, options.step_tokens)) {
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() {
  Stop();
  if (thread_.joinable()) thread_.join();
}

absl::Status Scheduler::Submit(GenerateRequest request, GenerateCallbacks callbacks, Done done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the worker is shutting down");
    if (static_cast<int64_t>(submitted_.size()) + stats_.waiting >= options_.max_waiting) {
      absl::Status refused = absl::ResourceExhaustedError(
          absl::StrCat(options_.max_waiting, " requests are already waiting; retry later"));
      CountFailure(refused);
      return refused;
    }
    submitted_.push_back(
        {std::move(request), std::move(callbacks), std::move(done), Generation::Clock::now()});
  }
  cv_.notify_one();
  return absl::OkStatus();
}

bool Scheduler::Post(std::function<void(Engine&)> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

std::deque<std::function<void(Engine&)>> Scheduler::TakeWork(bool* stop) {
  std::unique_lock<std::mutex> lock(mu_);
  // Also awake while a kept session settles with nothing running (the engine is this thread's:
  // the predicate runs here).
  cv_.wait(lock, [this] {
    return stopping_ || !jobs_.empty() || !submitted_.empty() || !running_.empty() ||
           !waiting_.empty() || engine_->IdleSettlePending();
  });
  *stop = stopping_;
  for (Pending& p : submitted_) waiting_.push_back(std::move(p));
  submitted_.clear();
  std::deque<std::function<void(Engine&)>> jobs;
  jobs.swap(jobs_);
  return jobs;
}

void Scheduler::Loop() {
  for (;;) {
    bool stop = false;
    std::deque<std::function<void(Engine&)>> jobs = TakeWork(&stop);
    for (auto& job : jobs) job(*engine_);
    if (!jobs.empty()) admission_blocked_ = false;  // a job may have closed a session
    EndFinished();
    Admit();
    if (!running_.empty()) StepOnce();
    EndFinished();
    if (running_.empty() && engine_->IdleSettlePending()) SettleIdleSlice();
    Publish();
    if (stop && jobs.empty() && waiting_.empty() && running_.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (jobs_.empty() && submitted_.empty()) return;
    }
  }
}

void Scheduler::SettleIdleSlice() {
  const size_t kv_before = admission_blocked_ ? engine_->DeviceKvBytes() : 0;
  engine_->SettleIdle();
  // A settled window shrinks to the configured one: a refused request may fit now.
  if (admission_blocked_ && engine_->DeviceKvBytes() < kv_before) admission_blocked_ = false;
}

void Scheduler::EndFinished() {
  const Generation::Clock::time_point now = Generation::Clock::now();
  for (auto it = running_.begin(); it != running_.end();) {
    Generation& g = *it->generation;
    if (it->in_pass || (!g.finished() && !g.CancelledBy(now))) {
      ++it;
      continue;
    }
    absl::StatusOr<GenerateSummary> summary = engine_->End(g);
    CountEnd(summary);
    it->done(std::move(summary));
    it = running_.erase(it);
    admission_blocked_ = false;  // its memory is free
  }
  // Requests that went away (or ran out of time) before they started.
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    const bool expired = it->request.deadline.has_value() && now >= *it->request.deadline;
    const bool cancelled = it->callbacks.cancelled && it->callbacks.cancelled();
    if (!expired && !cancelled) {
      ++it;
      continue;
    }
    absl::Status status =
        expired ? absl::DeadlineExceededError("the request's deadline passed while it waited")
                : absl::CancelledError("cancelled before it ran");
    CountFailure(status);
    it->done(std::move(status));
    it = waiting_.erase(it);
    admission_blocked_ = false;  // the head of the queue may have changed
  }
}

void Scheduler::Admit() {
  // A refusal for memory stands until something ends: retrying each step would re-validate and
  // re-tokenize the waiting prompt on the step's critical path for nothing.
  if (admission_blocked_) return;
  for (auto it = waiting_.begin();
       it != waiting_.end() && static_cast<int64_t>(running_.size()) < options_.max_batch;) {
    // A turn of a session that is mid-generation waits for it (requests of other sessions may
    // go ahead: nothing they hold is shared).
    if (!it->request.session_id.empty() && engine_->SessionBusy(it->request.session_id)) {
      ++it;
      continue;
    }
    // A reader of a document another request is prefilling right now waits for that prefill
    // and then forks it (Engine::PrefillWorthWaitingFor), instead of prefilling it beside it.
    if (engine_->PrefillWorthWaitingFor(it->request)) {
      ++it;
      continue;
    }
    absl::StatusOr<std::unique_ptr<Generation>> g =
        engine_->Begin(it->request, it->callbacks, it->arrival);
    if (!g.ok() && g.status().code() == absl::StatusCode::kResourceExhausted && !running_.empty()) {
      admission_blocked_ = true;  // it fits once others end; first come, first served:
      break;                      // nobody overtakes it
    }
    if (!g.ok()) {
      CountFailure(g.status());
      it->done(g.status());
    } else {
      const uint64_t degraded = (*g)->seq != nullptr ? (*g)->seq->degraded_steps : 0;
      running_.push_back({*std::move(g), std::move(it->done), next_order_++, 0, 0, degraded});
    }
    it = waiting_.erase(it);
  }
}

int64_t Scheduler::PromptBudget(int64_t decode_rows) const {
  return step_cap_.Cap(options_.step_tokens - decode_rows);
}

void Scheduler::StepOnce(bool interlude) {
  std::vector<Engine::StepItem> items;
  std::vector<Running*> carried, prefills;
  for (Running& r : running_) {
    // One that failed between steps (a fork's settle of it: Engine::ForkSession) waits for
    // EndFinished; a step must not carry it. Nor one in the step an interlude paused.
    if (r.generation->finished() || r.in_pass) continue;
    if (r.generation->prefilling()) {
      prefills.push_back(&r);
    } else {
      items.push_back({r.generation.get(), 1});
      carried.push_back(&r);
    }
  }
  const bool with_breaks = !interlude && engine_->options().prefill_breaks;
  // max_decode_gap_ms: a step that feeds prompt tokens and will take breaks leaves the decode
  // rows to its interludes.
  if (with_breaks && options_.max_decode_gap_ms > 0 && !prefills.empty()) {
    std::vector<Engine::StepItem> prompts;
    for (Running* r : prefills) prompts.push_back({r->generation.get(), 1});
    if (engine_->StepCanBreak(prompts)) {
      items.clear();
      carried.clear();
    }
  }
  const int64_t decode_rows = static_cast<int64_t>(items.size());
  int64_t budget = PromptBudget(decode_rows);
  const int64_t prompt_budget = budget;
  if (interlude) {   // only prompts that finish here: a longer one waits for the paused step
    std::erase_if(prefills,
                  [&](const Running* r) { return r->generation->remaining() > prompt_budget; });
    if (prefills.empty() && !DecodeGapReached()) return;
  }
  std::vector<PrefillCandidate> candidates;
  candidates.reserve(prefills.size());
  for (const Running* r : prefills) {
    candidates.push_back({r->generation->remaining(), r->skipped_steps, r->order});
  }
  const std::vector<int64_t> shares =
      PrefillShares(candidates, budget, options_.prefill_aging_steps);
  for (size_t i = 0; i < prefills.size(); ++i) {
    Running* r = prefills[i];
    if (shares[i] == 0) {
      ++r->skipped_steps;
      continue;
    }
    items.push_back({r->generation.get(), shares[i]});
    carried.push_back(r);
    budget -= shares[i];
    r->skipped_steps = 0;
  }
  if (items.empty()) return;
  // A step that feeds a prompt takes breaks when the engine has them (not an interlude's).
  PassBreaks* breaks = nullptr;
  if (with_breaks && budget < prompt_budget) {
    breaks = &breaks_;
    for (Running* r : carried) r->in_pass = true;
  }
  // A failure is recorded in each generation of the step; EndFinished reports it.
  const size_t kv_before = admission_blocked_ ? engine_->DeviceKvBytes() : 0;
  const std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  const double interludes_before = interlude_seconds_;
  (void)engine_->Step(items, breaks);
  for (Running* r : carried) r->in_pass = false;
  // The step's own time: not the interludes it paused for.
  step_cap_.Observe(
      prompt_budget - budget,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() -
          (interlude_seconds_ - interludes_before));
  // A device prefill's window shrinks once its settle is over (a slice per step after the first
  // token): a refused request may fit now.
  if (admission_blocked_ && engine_->DeviceKvBytes() < kv_before) admission_blocked_ = false;
  CountStep();
  ++local_stats_.steps;
  if (interlude) ++local_stats_.interludes;
  local_stats_.step_tokens += static_cast<uint64_t>(decode_rows + prompt_budget - budget);
}

void Scheduler::Publish() {
  local_stats_.running = static_cast<int64_t>(running_.size());
  local_stats_.waiting = static_cast<int64_t>(waiting_.size());
  if (const metrics::WorkerMetrics* m = options_.metrics) {
    m->num_requests_running->Set(static_cast<double>(local_stats_.running));
    m->num_requests_waiting->Set(static_cast<double>(local_stats_.waiting));
    // The device KV of every open sequence (windows, gpu-mode KV, page summaries), kept
    // sessions between turns included: what the admission check counts.
    const size_t bytes = engine_->DeviceKvBytes();
    m->gpu_kv_cache_used_bytes->Set(static_cast<double>(bytes));
    const size_t budget = engine_->options().kv_cache_bytes;
    if (m->gpu_kv_cache_usage != nullptr && budget > 0) {
      m->gpu_kv_cache_usage->Set(static_cast<double>(bytes) / static_cast<double>(budget));
    }
    m->prefix_cache_sessions->Set(static_cast<double>(engine_->kv_cache().cached_sessions()));
    m->prefix_cache_tokens->Set(static_cast<double>(engine_->kv_cache().prefix().cached_tokens()));
    const uint64_t evictions = engine_->kv_cache().evictions();
    if (evictions > counted_evictions_) {
      m->prefix_cache_evictions->Increment(static_cast<double>(evictions - counted_evictions_));
      counted_evictions_ = evictions;
    }
    const TierFootprint cached = engine_->kv_cache().footprint();
    m->prefix_cache_gpu_bytes->Set(static_cast<double>(cached.device));
    m->prefix_cache_host_bytes->Set(static_cast<double>(cached.host));
    m->prefix_cache_node_bytes->Set(static_cast<double>(cached.nodes));
    if (const uint64_t parks = engine_->kv_cache().parks(); parks > counted_parks_) {
      m->prefix_cache_parks->Increment(static_cast<double>(parks - counted_parks_));
      counted_parks_ = parks;
    }
    if (const uint64_t unparks = engine_->kv_cache().unparks(); unparks > counted_unparks_) {
      m->prefix_cache_unparks->Increment(static_cast<double>(unparks - counted_unparks_));
      counted_unparks_ = unparks;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = local_stats_;
}

void Scheduler::CountStep() {
  const metrics::WorkerMetrics* m = options_.metrics;
  if (m == nullptr) return;
  int64_t sampled = 0, prompts = 0;
  uint64_t degraded = 0;
  for (Running& r : running_) {
    const Generation& g = *r.generation;
    // A step samples at most one token per generation; the loop also catches up any number.
    for (; r.counted_tokens < g.summary.completion_tokens; ++r.counted_tokens, ++sampled) {
      if (r.counted_tokens == 0) {
        m->time_to_first_token->Observe(g.summary.time_to_first_token_s);
        prompts += g.prompt_tokens;
        if (g.cached_tokens > 0) {
          m->prefix_cache_hit_tokens->Increment(static_cast<double>(g.cached_tokens));
        }
      } else if (static_cast<size_t>(r.counted_tokens - 1) < g.latencies.size()) {
        m->inter_token_latency->Observe(g.latencies[r.counted_tokens - 1]);
      }
    }
    if (g.seq != nullptr && g.seq->degraded_steps > r.counted_degraded) {
      degraded += g.seq->degraded_steps - r.counted_degraded;
      r.counted_degraded = g.seq->degraded_steps;
    }
  }
  if (sampled > 0) m->generation_tokens->Increment(static_cast<double>(sampled));
  if (prompts > 0) m->prompt_tokens->Increment(static_cast<double>(prompts));
  if (degraded > 0) m->degraded_steps->Increment(static_cast<double>(degraded));
}

void Scheduler::CountEnd(const absl::StatusOr<GenerateSummary>& summary) {
  const metrics::WorkerMetrics* m = options_.metrics;
  if (m == nullptr) return;
  if (!summary.ok()) {
    CountFailure(summary.status());
    return;
  }
  m->e2e_request_latency->Observe(summary->total_s);
  m->RequestSuccess(FinishReasonName(summary->finish_reason)).Increment();
}

void Scheduler::CountFailure(const absl::Status& status) {
  if (options_.metrics == nullptr || status.ok()) return;
  options_.metrics->RequestFailure(absl::StatusCodeToString(status.code())).Increment();
}

}  // namespace tandem::gpu_worker
