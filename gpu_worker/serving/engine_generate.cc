// Engine: the life of one generation (Begin, Step, End; Generate for a single request).
// Engine::Create, sessions, memory accounting and Evaluate are in engine.cc.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/kv_recompute.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/logprobs.h"
#include "tandem/gpu_worker/memory_plan.h"
#include "tandem/gpu_worker/request_validation.h"
#include "tandem/gpu_worker/tier_traits.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Steps at least this long are logged at debug level with their anatomy (what waits behind a
// long inter-token gap: a prompt chunk, a settle slice, the page index's part of it).
constexpr double kSlowStepSeconds = 0.1;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

}  // namespace

absl::StatusOr<GenerateSummary> Engine::Generate(const GenerateRequest& request,
                                                 const GenerateCallbacks& callbacks) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Generation> g,
                          Begin(request, callbacks, Generation::Clock::now()));
  while (!g->finished() && !g->CancelledBy(Generation::Clock::now())) {
    // A failed step records its failure in g; End reports it.
    (void)Step({{g.get(), std::min(g->remaining(), max_step_tokens())}});
  }
  absl::StatusOr<GenerateSummary> summary = End(*g);
  // The synchronous path has no scheduler to settle a kept session between turns: it settles
  // here, after the reply is complete, so its wider window does not hold device memory.
  // One unbounded pass moves every pending block (a failing session is closed as lost).
  if (sessions_->running().empty()) SettleIdleSessions(std::numeric_limits<int64_t>::max());
  return summary;
}

bool Engine::IdleSettlePending() const {
  for (const auto& [id, seq] : sessions_->all()) {
    if (!sessions_->busy(id) && seq->window.settling()) return true;
  }
  return false;
}

void Engine::SettleIdle() {
  SettleIdleSessions(runner_->options().settle_budget_per_step());
}

int64_t Engine::SettleIdleSessions(int64_t budget) {
  const auto& all = sessions_->all();
  for (auto it = all.begin(); it != all.end() && budget > 0;) {
    Sequence& seq = *it->second;
    if (sessions_->busy(it->first) || !seq.window.settling()) {
      ++it;
      continue;
    }
    absl::StatusOr<int64_t> moved = runner_->SettleSlice(seq, budget);
    if (moved.ok()) {
      budget -= *moved;
      ++it;
      continue;
    }
    const std::string id = it++->first;
    CloseLostSession(id, absl::StrCat("its prompt's move to the KV tier between turns failed: ",
                                      moved.status().ToString()));
  }
  return budget;
}

bool Generation::CancelledBy(Clock::time_point now) const {
  if (request.deadline.has_value() && now >= *request.deadline) return true;
  return callbacks.cancelled && callbacks.cancelled();
}

absl::StatusOr<Engine::SequenceSpec> Engine::SpecFor(const GenerateRequest& request) const {
  SequenceSpec spec;
  spec.page_policy = options_.default_page_policy;
  if (request.select_tokens.has_value()) spec.page_policy.select_tokens = *request.select_tokens;
  if (request.dense_layers.has_value()) spec.page_policy.dense_layers = *request.dense_layers;
  if (request.centroid_share.has_value()) {
    spec.page_policy.centroid_share = *request.centroid_share;
  }
  if (request.page_low_rank.has_value()) spec.page_policy.low_rank = *request.page_low_rank;
  TANDEM_RETURN_IF_ERROR(ValidatePagePolicy(spec.page_policy));
  // A request that sets beta but no selection asks for MAW (beta means nothing to pages).
  spec.selection = request.selection.value_or(
      request.beta.has_value() ? SelectionRule::kMaw : options_.default_selection);
  if (spec.selection == SelectionRule::kPages) TANDEM_RETURN_IF_ERROR(CheckPagesUsable());
  spec.mode = request.mode.value_or(options_.default_mode);
  spec.beta = request.beta.value_or(options_.default_beta);
  spec.window = request.window.value_or(options_.default_window);
  spec.sink = request.sink.value_or(options_.default_sink);
  if (spec.window < options_.block_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("window must be >= the block size (",
                                                   options_.block_tokens, " tokens), got ",
                                                   spec.window));
  }
  if (spec.sink > max_context_) {
    return absl::InvalidArgumentError(absl::StrCat("sink must be in 0..", max_context_));
  }
  return spec;
}

bool Engine::PrefillWorthWaitingFor(const GenerateRequest& request) const {
  if (!options_.prefix_cache || !request.session_id.empty() || sessions_->running().empty()) {
    return false;
  }
  std::vector<int32_t> prompt;
  if (!request.prompt_ids.empty()) {
    prompt = request.prompt_ids;
  } else if (request.prompt_text_ids.has_value()) {
    prompt = *request.prompt_text_ids;
    AddPromptBos(*tokenizer_, &prompt);   // as Begin feeds it
  } else {
    return false;   // tokenized by Begin: not known yet
  }
  if (prompt.size() < 2) return false;
  const absl::StatusOr<SequenceSpec> spec = SpecFor(request);
  if (!spec.ok()) return false;   // Begin says why
  const CacheScope scope = PrefixCacheScope(request, *spec);
  // The longest prefix there is to reuse now (a cached session, or a fork of a session in use):
  // looked up (the prompt hashed) only for a running prefill that might be worth waiting for.
  // Called per waiting request per scheduler iteration, so the common case (no such prefill)
  // costs a comparison of ids per running request.
  std::optional<int64_t> reusable;
  const size_t limit = prompt.size() - 1;
  for (const auto& [id, g] : sessions_->running()) {
    if (g->cache_key != scope.cache || !g->prefilling() || g->seq == nullptr ||
        !g->failure.ok()) {
      continue;
    }
    if (g->seq->offload != nullptr && !g->seq->offload->can_fork()) continue;   // no fork later
    // What it will hold once its prompt is in: the tokens fed, then the rest of its feed.
    const std::vector<int32_t>& held = g->seq->tokens;
    size_t common = CommonPrefixLength(held, prompt, limit);
    if (common == held.size()) {
      common += CommonPrefixLength(std::span<const int32_t>(g->feed).subspan(g->fed),
                                   std::span<const int32_t>(prompt).subspan(common),
                                   limit - common);
    }
    // Worth it when its prompt, once in, gives this one at least a block more than what is
    // there to reuse now: its fed part (a fork of it now; not while its window is widened for
    // the prefill, which cannot be forked), or a cached session.
    const int64_t fed_part = g->seq->window.widened() ? 0 : std::min(common, held.size());
    const int64_t gain = static_cast<int64_t>(common) - fed_part;
    if (static_cast<int64_t>(common) < options_.prefix_cache_min_tokens ||
        gain < options_.block_tokens) {
      continue;
    }
    if (!reusable.has_value()) {
      const std::optional<PrefixCache::Hit> hit =
          kv_cache_->prefix().Match(scope.cache, prompt, options_.prefix_cache_min_tokens);
      const std::optional<PrefixCache::Hit> in_use = InUsePrefix(scope, prompt);
      reusable = std::max(hit.has_value() ? hit->common : 0,
                          in_use.has_value() ? in_use->common : 0);
    }
    if (static_cast<int64_t>(common) - std::max(*reusable, fed_part) >= options_.block_tokens) {
      return true;
    }
  }
  return false;
}

absl::StatusOr<std::unique_ptr<Generation>> Engine::Begin(GenerateRequest request,
                                                          GenerateCallbacks callbacks,
                                                          Generation::Clock::time_point arrival) {
  // --- Validation: everything is checked before any state changes.
  TANDEM_RETURN_IF_ERROR(ValidateGenerateRequest(request, 0));
  TANDEM_ASSIGN_OR_RETURN(const SequenceSpec spec, SpecFor(request));
  const AttentionMode mode = spec.mode;
  const int64_t window = spec.window;
  const int64_t sink = spec.sink;
  const SelectionRule selection = spec.selection;
  const PagePolicy page_policy = spec.page_policy;
  if (!request.session_id.empty() && SessionBusy(request.session_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("session '", request.session_id, "' is in use by another request"));
  }

  Sequence* existing = request.session_id.empty() ? nullptr : sessions_->Find(request.session_id);
  bool continuing = existing != nullptr;
  if (!continuing && !request.session_id.empty()) {
    if (std::optional<std::string> lost = sessions_->lost().Take(request.session_id)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session '", request.session_id, "' was closed by the worker after its last turn (",
          *lost, "); its context is gone: send the whole conversation again (a new request "
          "with this id starts a new session)"));
    }
  }
  if (continuing) {
    const Sequence& s = *existing;
    const TierTraits traits = TraitsOf(s);
    if (request.mode.has_value() && *request.mode != s.mode) {
      return absl::InvalidArgumentError("a continued session keeps its attention mode");
    }
    if (traits.windowed &&
        ((request.window.has_value() && *request.window != s.window.options().window) ||
         (request.sink.has_value() && *request.sink != s.window.options().sink))) {
      return absl::InvalidArgumentError("a continued session keeps its window and sink");
    }
    if (traits.selects && request.selection.has_value() &&
        *request.selection != SelectionOf(s)) {
      return absl::InvalidArgumentError("a continued session keeps its selection");
    }
  }
  std::vector<int32_t> prompt = request.prompt_ids;
  if (prompt.empty()) {
    if (request.prompt_text_ids.has_value()) {
      prompt = *request.prompt_text_ids;   // tokenized off this thread (PromptEncoder)
      if (!continuing) AddPromptBos(*tokenizer_, &prompt);
    } else {
      const int64_t in_session =
          continuing ? static_cast<int64_t>(existing->tokens.size()) : 0;
      TANDEM_RETURN_IF_ERROR(
          CheckPromptTextFits(request.prompt_text, max_context_ - in_session, max_token_bytes_));
      TANDEM_ASSIGN_OR_RETURN(prompt, Tokenize(request.prompt_text, /*add_bos=*/!continuing));
    }
    if (prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  }
  TANDEM_RETURN_IF_ERROR(ValidateIds(prompt));
  // Automatic prefix cache: a one-shot request continues the cached session sharing the
  // longest prefix with its prompt (truncated to it) and feeds only the rest.
  std::string cache_key;
  int64_t cached = 0;
  bool forked = false;
  if (options_.prefix_cache && request.session_id.empty()) {
    const CacheScope scope = PrefixCacheScope(request, spec);
    cache_key = scope.cache;
    const int64_t planned =
        std::min<int64_t>(max_context_, static_cast<int64_t>(prompt.size()) + request.max_tokens);
    if (Sequence* hit = ReuseCachedPrefix(scope, prompt, planned, &cached, &forked)) {
      existing = hit;
      continuing = true;
      prompt.erase(prompt.begin(), prompt.begin() + cached);
    }
  }
  // If this request is refused below, a cached session taken above goes back to the cache and a
  // fork made for it is closed (its parent is still cached).
  auto recache = absl::MakeCleanup([&] {
    if (cached == 0) return;
    if (forked) {
      (void)sessions_->Close(existing->id);
    } else {
      kv_cache_->Insert(existing->id, cache_key, existing->tokens);
    }
  });
  const int64_t already = continuing ? static_cast<int64_t>(existing->tokens.size()) +
                                           (existing->pending_token ? 1 : 0)
                                     : 0;
  if (already + static_cast<int64_t>(prompt.size()) >= max_context_) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prompt (", prompt.size(), " tokens", continuing ? " after " : "",
                     continuing ? absl::StrCat(already, " in the session") : "",
                     ") leaves no room in the model's context of ", max_context_, " tokens"));
  }
  if (!continuing) TANDEM_RETURN_IF_ERROR(kv_cache_->MakeSessionRoom(options_.max_sessions));

  // --- The session, with the memory it needs by the end of this request reserved: device
  // window (gpu mode), page summaries and CPU-node room are checked before anything runs.
  // A cached session keeps its id; another one-shot request gets a new one.
  std::string id = continuing ? existing->id : request.session_id;
  if (id.empty()) id = sessions_->NewAnonymousId();
  const int64_t planned = std::min<int64_t>(
      max_context_, already + static_cast<int64_t>(prompt.size()) + request.max_tokens);
  auto offloaded_by_end = [&](int64_t w, int64_t k) { return std::max<int64_t>(0, planned - w - k); };
  Sequence* seq = nullptr;
  if (continuing) {
    seq = existing;
    const TierTraits traits = TraitsOf(*seq);
    TANDEM_RETURN_IF_ERROR(kv_cache_->WithEviction([&]() -> absl::Status {
      if (!traits.windowed) {   // the window holds every position: it grows in place
        WindowOptions grown = seq->window.options();
        grown.max_context = std::max(
            grown.max_context, SequenceWindowOptions(options_, max_context_, traits, 0, 0, planned)
                                   .max_context);
        const size_t bytes = WindowCache::BytesFor(seq->window.geometry(), grown);
        TANDEM_RETURN_IF_ERROR(CheckDeviceKv(
            bytes > seq->window.device_bytes() ? bytes - seq->window.device_bytes() : 0));
        TANDEM_RETURN_IF_ERROR(seq->window.Grow(grown.max_context));
      }
      if (traits.page_summaries) {
        if (request.select_tokens.has_value() || request.dense_layers.has_value() ||
            request.centroid_share.has_value() || request.page_low_rank.has_value()) {
          if (PagePolicy* policy = seq->offload->page_policy()) *policy = page_policy;
        }
        TANDEM_RETURN_IF_ERROR(ReservePages(
            *seq, offloaded_by_end(seq->window.options().window, seq->window.options().sink)));
      }
      return seq->ReserveOffloaded(
          offloaded_by_end(seq->window.options().window, seq->window.options().sink));
    }));
    RebuildLostKv(*seq);   // a new turn starts with the shards a lost CPU node held
  } else {
    const size_t need =
        WindowCache::BytesFor(window_geometry(), WindowOptionsFor(spec, planned)) +
        PageSummaryBytesFor(TraitsOf(mode, selection), window_geometry(), options_.page_tokens,
                            offloaded_by_end(window, sink), options_.page_low_rank);
    std::unique_ptr<Sequence> fresh;
    TANDEM_RETURN_IF_ERROR(kv_cache_->WithEviction([&]() -> absl::Status {
      TANDEM_RETURN_IF_ERROR(CheckDeviceKv(need));
      TANDEM_ASSIGN_OR_RETURN(fresh, NewSequence(id, spec, planned, offloaded_by_end(window, sink)));
      return absl::OkStatus();
    }));
    seq = &sessions_->Add(std::move(fresh));
    // A kept session is a pinned prefix of its scope: one-shot requests fork it.
    if (options_.prefix_cache && !request.session_id.empty()) {
      sessions_->Keep(id, PrefixCacheScope(request, spec).own);
    }
  }
  std::move(recache).Cancel();

  const uint64_t seed =
      request.sampling.seed.has_value() ? *request.sampling.seed : std::random_device{}();
  const bool keep = !request.session_id.empty();
  auto g = std::make_unique<Generation>(std::move(request), std::move(callbacks), arrival,
                                        *tokenizer_);
  g->seq = seq;
  g->session_id = id;
  g->keep_session = keep;
  g->continues_session = continuing;
  g->prompt_tokens = static_cast<int64_t>(prompt.size());
  g->cache_key = std::move(cache_key);
  g->cached_tokens = cached;
  if (seq->pending_token.has_value()) g->feed.push_back(*seq->pending_token);
  g->feed.insert(g->feed.end(), prompt.begin(), prompt.end());
  seq->pending_token.reset();
  if (continuing && TraitsOf(*seq).selects) {
    seq->reselect_pending = true;
    seq->reselect_beta = g->request.beta;
  }
  // Device prefill: the window widens for this prompt; blocks a previous turn's prompt has not
  // settled yet stay in it (WindowCache::Widen) and leave, oldest first, after this prompt.
  WidenForPrefill(*seq, static_cast<int64_t>(g->feed.size()));
  g->rng.seed(seed);
  g->degraded_before = seq->degraded_steps;
  g->last_token = arrival;
  sessions_->SetRunning(id, g.get());
  return g;
}

absl::Status Engine::Step(const std::vector<StepItem>& items, PassBreaks* breaks) {
  const Clock::time_point start = Clock::now();
  std::vector<ModelRunner::BatchEntry> entries;
  int64_t total = 0;
  for (const StepItem& item : items) {
    Generation& g = *item.generation;
    if (g.finished() || item.tokens < 1 || item.tokens > g.remaining()) {
      return absl::InvalidArgumentError(absl::StrCat("step item of ", item.tokens,
                                                     " tokens for a generation with ",
                                                     g.remaining(), " to feed"));
    }
    entries.push_back({g.seq, g.feed.data() + g.fed, item.tokens});
    total += item.tokens;
  }
  if (total > max_step_tokens()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a step of ", total, " tokens; at most ", max_step_tokens()));
  }
  if (absl::Status s = runner_->Step(entries, breaks); !s.ok()) {
    for (const StepItem& item : items) item.generation->failure = s;
    return s;
  }
  const Clock::time_point passed = Clock::now();
  const int64_t vocab = model_->config.vocab_size;
  absl::Status first_failure;
  for (size_t b = 0; b < items.size(); ++b) {
    Generation& g = *items[b].generation;
    g.fed += items[b].tokens;
    if (g.prefilling() && g.callbacks.on_prefill) {
      const double elapsed = Seconds(g.arrival, Clock::now());
      g.callbacks.on_prefill({static_cast<int64_t>(g.feed.size()), g.fed, elapsed});
    }
    if (g.remaining() > 0) continue;
    if (absl::Status s = token_output_->Emit(g, runner_->batch_logits() + b * vocab); !s.ok()) {
      g.failure = s;
      if (first_failure.ok()) first_failure = s;
      continue;
    }
    if (!g.finished()) g.seq->MaintainOffloaded();   // between steps: migrations, re-plans
  }
  // Device prefill: once the first token is out, the host copy of a partly fitting prompt is
  // dropped, and the blocks a narrowed window still holds (WindowCache::settling) go to the
  // tier, at most settle_tokens_per_step tokens per step over all sessions: this step's first,
  // then idle ones (a kept session between turns). Until then its window attends over them.
  for (const StepItem& item : items) {
    Generation& g = *item.generation;
    if (g.seq == nullptr || !g.first_token_sampled || g.seq->window.widened()) continue;
    g.seq->EndPrefillSpill();
  }
  int64_t settle_budget = runner_->options().settle_budget_per_step();
  int64_t prompt_tokens = 0;   // the chunks of prompts (a decode row feeds one token)
  for (const StepItem& item : items) prompt_tokens += item.tokens > 1 ? item.tokens : 0;
  if (options_.settle_shares_prefill_budget && options_.settle_tokens_per_step > 0) {
    settle_budget = std::max<int64_t>(1, settle_budget - prompt_tokens);   // 1: a block
  }
  const Clock::time_point settle_start = Clock::now();
  const RunnerProfile before_settle = runner_->profile();
  int64_t settled = 0;
  for (const StepItem& item : items) {
    Generation& g = *item.generation;
    if (settle_budget <= 0) break;
    if (g.seq == nullptr || !g.failure.ok() || !g.seq->window.settling()) continue;
    // A one-shot request that just finished: End discards its KV, a slice would be wasted.
    if (g.finished() && !g.keep_session) continue;
    absl::StatusOr<int64_t> moved = runner_->SettleSlice(*g.seq, settle_budget);
    if (!moved.ok()) {   // End closes the session (its state is no longer consistent)
      g.failure = moved.status();
      if (first_failure.ok()) first_failure = g.failure;
      continue;
    }
    settle_budget -= *moved;
    settled += *moved;
  }
  const int64_t idle_budget = settle_budget;
  settled += idle_budget - SettleIdleSessions(settle_budget);
  const Clock::time_point settle_end = Clock::now();
  const bool slow = Seconds(start, settle_end) >= kSlowStepSeconds ||
                    Seconds(last_step_end_, start) >= kSlowStepSeconds;
  if (slow && spdlog::should_log(spdlog::level::debug)) {
    const RunnerProfile& after = runner_->profile();
    spdlog::debug(
        "slow step: {:.1f} ms ({:.1f} ms after the last); {} rows, {} prompt tokens; pass {:.1f} "
        "ms, emit {:.1f} ms, settle {} tokens {:.1f} ms (page index {:.1f}, read {:.1f}, append "
        "{:.1f})",
        1e3 * Seconds(start, settle_end), 1e3 * Seconds(last_step_end_, start), items.size(),
        prompt_tokens,
        1e3 * Seconds(start, passed), 1e3 * Seconds(passed, settle_start), settled,
        1e3 * Seconds(settle_start, settle_end),
        1e3 * (after.evict_index_s - before_settle.evict_index_s),
        1e3 * (after.evict_read_s - before_settle.evict_read_s),
        1e3 * (after.evict_append_s - before_settle.evict_append_s));
  }
  last_step_end_ = settle_end;
  // After sampling (a rebuild runs a forward pass of its own): shards lost with a CPU node,
  // one sequence per step.
  for (const StepItem& item : items) {
    if (item.generation->seq != nullptr && RebuildLostKv(*item.generation->seq)) break;
  }
  return first_failure;
}

bool Engine::StepCanBreak(const std::vector<StepItem>& items) const {
  std::vector<Sequence*> sequences;
  for (const StepItem& item : items) {
    if (item.generation->seq == nullptr) return false;
    sequences.push_back(item.generation->seq);
  }
  return runner_->CanBreak(sequences);
}

absl::Status Engine::RestoreUntouchedSession(Generation& g) {
  Sequence& seq = *g.seq;
  // Nothing was sampled: the feed is [pending token] + prompt, or the prompt alone.
  if (g.feed.size() > static_cast<size_t>(g.prompt_tokens)) seq.pending_token = g.feed[0];
  // Undo what Begin prepared for this prompt: the widened window (back to the configured one,
  // or to the settle of the last prompt that was under way) and the prefill spill.
  seq.prefill_end = seq.window.next_position();
  seq.EndPrefillSpill();
  return seq.window.Narrow();
}

absl::StatusOr<GenerateSummary> Engine::End(Generation& g) {
  sessions_->ClearRunning(g.session_id);
  const Clock::time_point now = Clock::now();
  absl::Status failure = g.failure;
  if (failure.ok() && !g.reason.has_value()) {   // stopped between steps
    if (g.request.deadline.has_value() && now >= *g.request.deadline) {
      failure = absl::DeadlineExceededError(absl::StrCat(
          "the request's deadline passed after ", g.summary.completion_tokens, " tokens"));
    } else {
      g.reason = FinishReason::kCancelled;
    }
  }
  // A session whose prompt was not fed whole (stopped in prefill) or whose pass failed holds a
  // state no client asked for: it is closed even when kept. A continued turn stopped before
  // any of its feed entered the model left it as the last turn did: it stays.
  bool untouched = g.continues_session && g.fed == 0 && g.failure.ok();
  if (untouched) untouched = RestoreUntouchedSession(g).ok();   // failed: closed as lost
  const bool consistent =
      (g.failure.ok() && g.remaining() <= 1 && g.first_token_sampled) || untouched;
  GenerateSummary summary = std::move(g.summary);
  summary.session_id = g.keep_session ? g.session_id : "";
  summary.prompt_tokens = g.prompt_tokens + g.cached_tokens;
  summary.cached_tokens = g.cached_tokens;
  summary.mode = g.seq->mode;
  summary.total_s = Seconds(g.arrival, now);
  summary.finish_reason = g.reason.value_or(FinishReason::kCancelled);
  if (!g.latencies.empty()) {
    double sum = 0.0;
    for (double l : g.latencies) sum += l;
    summary.mean_token_latency_s = sum / g.latencies.size();
    summary.p50_token_latency_s = Percentile(g.latencies, 0.5);
    summary.p99_token_latency_s = Percentile(g.latencies, 0.99);
  }
  // A kept session still settling goes on settling between turns: in other requests' steps,
  // or a slice at a time from the scheduler while nothing runs (SettleIdle); not here, where
  // the reply would wait for it.
  summary.degraded_steps = g.seq->degraded_steps - g.degraded_before;
  summary.degraded = summary.degraded_steps > 0;
  summary.device_kv_entries = g.seq->device_entries();
  summary.cpu_kv_entries = g.seq->offloaded_entries();
  if (g.seq->offload != nullptr) summary.exact_split = g.seq->offload->split();
  if (g.keep_session && !consistent && g.continues_session) {
    // The client holds a conversation the worker no longer has: its next turn is told so.
    CloseLostSession(g.session_id,
                     !g.failure.ok()
                         ? absl::StrCat("a turn failed: ", g.failure.ToString())
                         : std::string("a turn was stopped (cancelled or past its deadline) "
                                       "before its prompt was read whole"));
    g.seq = nullptr;
  } else if (!g.keep_session && consistent && !g.cache_key.empty() &&
             static_cast<int64_t>(g.seq->tokens.size()) >= options_.prefix_cache_min_tokens) {
    // A one-shot request that ended in a state a later prompt can continue: cached
    // (prefix_cache.h). Its last sampled token is not fed: a prompt that repeats it feeds it.
    kv_cache_->Insert(g.session_id, g.cache_key, g.seq->tokens);
    summary.session_id.clear();
    g.seq = nullptr;
  } else if (!g.keep_session || !consistent) {
    // A one-shot request, or a new session whose first turn did not complete: the client has
    // nothing to continue, and the summary names no kept session.
    if (sessions_->contains(g.session_id)) (void)sessions_->Close(g.session_id);
    summary.session_id.clear();
    g.seq = nullptr;
  } else if (!untouched && g.remaining() == 1 && !g.seq->pending_token.has_value()) {
    g.seq->pending_token = g.feed[g.fed];   // sampled but not fed: the next turn feeds it
  }
  if (!failure.ok()) return failure;
  return summary;
}

}  // namespace tandem::gpu_worker
