// The Scheduler on stories260k (issue 12): concurrent requests of every mode share steps (their
// tokens interleave, the run takes fewer than half the forward passes of the requests one after
// another) and each gets exactly what it gets alone; a short prompt overtakes a long prefill;
// cancellation and deadlines end a request between steps and free its session; a request that
// does not fit the memory left waits for others instead of failing, and one that can never fit
// fails. The cpu backend in CI, the cuda one with label gpu.
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/page_index.h"
#include "tandem/gpu_worker/scheduler.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {
namespace {

using Clock = std::chrono::steady_clock;

// What one submitted request produced, filled on the scheduler thread.
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::StatusOr<GenerateSummary> summary = absl::UnknownError("not run");
};

class SchedulerTest : public ::testing::Test {
 protected:
  void Make(int64_t prefill_chunk = 64, size_t summary_cap = 0, size_t kv_cap = 0,
            bool prefill_breaks = true, int64_t prefill_aging_steps = 4,
            double max_decode_gap_ms = 0) {
    EngineOptions options;
    options.model_dir = testing::ModelDir("stories260k").string();
    options.backend = testing::TestBackendName();
    options.nodes.embedded.pool_bytes = 64ull << 20;
    options.default_window = 16;
    options.default_sink = 4;
    options.prefill_chunk = prefill_chunk;
    options.offload_page_tokens = 16;
    options.page_summary_bytes = summary_cap;
    options.kv_cache_bytes = kv_cap;
    options.prefill_breaks = prefill_breaks;
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    SchedulerOptions scheduling;
    scheduling.prefill_aging_steps = prefill_aging_steps;
    scheduling.max_decode_gap_ms = max_decode_gap_ms;
    auto scheduler = Scheduler::Create(std::move(*engine), scheduling);
    ASSERT_TRUE(scheduler.ok()) << scheduler.status();
    scheduler_ = std::move(*scheduler);
  }

  // Submits `request`; token events are logged as (tag, index) in submission-independent order.
  std::shared_ptr<Outcome> Submit(
      GenerateRequest request, int tag, std::function<bool()> cancelled = nullptr,
      std::function<void(const PrefillProgress&)> on_prefill = nullptr) {
    auto outcome = std::make_shared<Outcome>();
    GenerateCallbacks callbacks;
    callbacks.on_token = [this, tag](const TokenEvent& e) {
      std::lock_guard<std::mutex> lock(log_mu_);
      log_.push_back({tag, e.index});
      return true;
    };
    callbacks.cancelled = std::move(cancelled);
    callbacks.on_prefill = std::move(on_prefill);
    const absl::Status submitted = scheduler_->Submit(
        std::move(request), std::move(callbacks), [outcome](absl::StatusOr<GenerateSummary> s) {
          std::lock_guard<std::mutex> lock(outcome->mu);
          outcome->summary = std::move(s);
          outcome->done = true;
          outcome->cv.notify_all();
        });
    EXPECT_TRUE(submitted.ok()) << submitted;
    return outcome;
  }

  // Holds the scheduler thread in a control job until the returned promise is set: requests
  // submitted meanwhile are admitted in one iteration, so what shares a step does not depend on
  // how long the test thread is descheduled between two Submits on a loaded machine.
  std::promise<void> HoldScheduler() {
    std::promise<void> release;
    auto released = std::make_shared<std::shared_future<void>>(release.get_future().share());
    auto held = std::make_shared<std::promise<void>>();
    std::future<void> holding = held->get_future();
    if (!scheduler_->Post([released, held](Engine&) {
          held->set_value();
          released->wait();
        })) {
      ADD_FAILURE() << "the scheduler took no job";
      return release;
    }
    holding.wait();
    return release;
  }

  static absl::StatusOr<GenerateSummary> Wait(Outcome& outcome) {
    std::unique_lock<std::mutex> lock(outcome.mu);
    outcome.cv.wait_for(lock, std::chrono::seconds(120), [&] { return outcome.done; });
    return outcome.done ? outcome.summary : absl::DeadlineExceededError("test timed out");
  }

  // Position in the token log of the first / last token of `tag`.
  size_t FirstOf(int tag) const {
    for (size_t i = 0; i < log_.size(); ++i) if (log_[i].first == tag) return i;
    return log_.size();
  }
  size_t LastOf(int tag) const {
    for (size_t i = log_.size(); i-- > 0;) if (log_[i].first == tag) return i;
    return log_.size();
  }


  size_t OpenSessions() {
    absl::StatusOr<size_t> n =
        scheduler_->Run([](Engine& e) -> absl::StatusOr<size_t> { return e.open_sessions(); });
    return n.ok() ? *n : size_t{999};
  }

  std::unique_ptr<Scheduler> scheduler_;
  std::mutex log_mu_;
  std::vector<std::pair<int, int64_t>> log_;
};

TEST_F(SchedulerTest, ConcurrentRequestsOfEveryModeShareStepsAndMatchTheirSoloRuns) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  Make();
  // 60-token prompts with a 16-token window: hybrid and offload requests hold most of their KV
  // off the device and attend over it every step.
  std::vector<GenerateRequest> requests;
  const AttentionMode modes[] = {AttentionMode::kGpu, AttentionMode::kHybrid,
                                 AttentionMode::kOffload, AttentionMode::kHybrid};
  for (int i = 0; i < 4; ++i) {
    GenerateRequest r;
    r.prompt_ids = testing::SyntheticPrompt(60, i);
    r.max_tokens = 32;
    r.ignore_eos = true;
    r.mode = modes[i];
    if (i == 3) r.selection = SelectionRule::kPages;
    requests.push_back(r);
  }
  std::vector<std::vector<int32_t>> solo;
  const Clock::time_point solo_start = Clock::now();
  for (int i = 0; i < 4; ++i) {
    auto outcome = Submit(requests[i], 100 + i);
    auto summary = Wait(*outcome);
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->completion_tokens, 32);
    solo.push_back(summary->token_ids);
  }
  const double solo_s = std::chrono::duration<double>(Clock::now() - solo_start).count();
  const uint64_t solo_steps = scheduler_->stats().steps;

  log_.clear();
  const Clock::time_point start = Clock::now();
  std::vector<std::shared_ptr<Outcome>> outcomes;
  std::promise<void> release = HoldScheduler();
  for (int i = 0; i < 4; ++i) outcomes.push_back(Submit(requests[i], i));
  release.set_value();
  for (int i = 0; i < 4; ++i) {
    auto summary = Wait(*outcomes[i]);
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->token_ids, solo[i]) << "request " << i << " differs from its solo run";
    EXPECT_EQ(summary->mode, modes[i]);
    if (modes[i] != AttentionMode::kGpu) {
      EXPECT_GT(summary->cpu_kv_entries, 0) << i;
    }
  }
  const double batched_s = std::chrono::duration<double>(Clock::now() - start).count();
  const uint64_t batched_steps = scheduler_->stats().steps - solo_steps;
  // Interleaved: every request had a token before every other one's last.
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) {
      if (a != b) {
        EXPECT_LT(FirstOf(a), LastOf(b)) << a << " ran after " << b;
      }
    }
  }
  // Less time than one after another: in forward passes, the unit of the device's time, which
  // unlike wall time does not depend on what else runs on the test machine.
  EXPECT_LT(batched_steps, solo_steps / 2) << "batched " << batched_steps << ", solo "
                                            << solo_steps;
  std::printf("4 requests: %llu steps in %.3f s batched, %llu steps in %.3f s one by one\n",
              static_cast<unsigned long long>(batched_steps), batched_s,
              static_cast<unsigned long long>(solo_steps), solo_s);
  EXPECT_EQ(OpenSessions(), 0u);
}

TEST_F(SchedulerTest, AShortPromptOvertakesALongPrefill) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  Make(/*prefill_chunk=*/16);
  GenerateRequest long_request;
  long_request.prompt_ids = testing::SyntheticPrompt(400, 7);   // 25 steps of prefill
  long_request.max_tokens = 4;
  long_request.mode = AttentionMode::kGpu;
  GenerateRequest short_request;
  short_request.prompt_ids = testing::SyntheticPrompt(6, 9);
  short_request.max_tokens = 4;
  short_request.mode = AttentionMode::kGpu;
  std::promise<void> release = HoldScheduler();
  auto long_outcome = Submit(long_request, 0);
  auto short_outcome = Submit(short_request, 1);
  release.set_value();
  ASSERT_TRUE(Wait(*short_outcome).ok());
  ASSERT_TRUE(Wait(*long_outcome).ok());
  // The short request finished while the long one was still in prefill.
  EXPECT_LT(LastOf(1), FirstOf(0));
}

// EngineOptions::prefill_breaks: L (400 tokens), A and B (10 each) arrive together; steps of 16
// tokens, a prefill passed over once goes first. Step 1 completes A alone (a step that
// completes a prompt carries no chunk of a longer one); in step 2 L and B have aged and L, the
// older, takes the whole budget beside A's decode row, leaving B out. With breaks, step 2
// pauses at its first layer boundary for an interlude that completes B, so B's first token
// comes before A's second; without, B waits for step 3. Every request's tokens are its solo
// run's either way.
class SchedulerBreaksTest : public SchedulerTest,
                            public ::testing::WithParamInterface<bool> {};

TEST_P(SchedulerBreaksTest, AShortPromptLeftOutOfAStepRunsBetweenItsLayers) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  const bool breaks = GetParam();
  Make(/*prefill_chunk=*/16, 0, 0, breaks, /*prefill_aging_steps=*/1);
  std::vector<GenerateRequest> requests(3);
  const int64_t prompts[] = {400, 10, 10};
  for (int i = 0; i < 3; ++i) {
    requests[i].prompt_ids = testing::SyntheticPrompt(prompts[i], 20 + i);
    requests[i].max_tokens = 6;
    requests[i].ignore_eos = true;
    requests[i].mode = AttentionMode::kGpu;
  }
  std::vector<std::vector<int32_t>> solo;
  for (int i = 0; i < 3; ++i) {
    auto summary = Wait(*Submit(requests[i], 100 + i));
    ASSERT_TRUE(summary.ok()) << summary.status();
    solo.push_back(summary->token_ids);
  }
  const uint64_t interludes_before = scheduler_->stats().interludes;
  log_.clear();
  std::vector<std::shared_ptr<Outcome>> outcomes;
  std::promise<void> release = HoldScheduler();
  for (int i = 0; i < 3; ++i) outcomes.push_back(Submit(requests[i], i));
  release.set_value();
  for (int i = 0; i < 3; ++i) {
    auto summary = Wait(*outcomes[i]);
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->token_ids, solo[i]) << "request " << i << " differs from its solo run";
  }
  size_t a_second = log_.size();
  for (size_t i = 0; i < log_.size(); ++i) {
    if (log_[i] == std::pair<int, int64_t>{1, 1}) a_second = i;
  }
  ASSERT_LT(a_second, log_.size());
  const uint64_t interludes = scheduler_->stats().interludes - interludes_before;
  if (breaks) {
    EXPECT_LT(FirstOf(2), a_second) << "B did not run inside step 2";
    EXPECT_GE(interludes, 1u);
  } else {
    EXPECT_GT(FirstOf(2), a_second) << "B ran in step 2 without breaks";
    EXPECT_EQ(interludes, 0u);
  }
  EXPECT_EQ(OpenSessions(), 0u);
}

INSTANTIATE_TEST_SUITE_P(WithAndWithout, SchedulerBreaksTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("Breaks") : std::string("NoBreaks");
                         });

// max_decode_gap_ms with prefill breaks: A (10 tokens, 16 to generate) decodes while L (400
// tokens, 64-token steps: 7 of them) is prefilled. Riding along (gap 0), A gets one token per
// step and is still decoding when L's first token comes. With a gap of a microsecond, L's steps
// leave A out and every layer boundary of theirs is an interlude with A's next token, so A is
// done before L's prompt is in. Tokens equal the solo runs either way.
class SchedulerDecodeGapTest : public SchedulerTest,
                               public ::testing::WithParamInterface<double> {};

TEST_P(SchedulerDecodeGapTest, DecodingRequestsGetInterludesOnceTheirGapIsReached) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  const double gap_ms = GetParam();
  Make(/*prefill_chunk=*/64, 0, 0, /*prefill_breaks=*/true, 4, gap_ms);
  GenerateRequest decoding, long_request;
  decoding.prompt_ids = testing::SyntheticPrompt(10, 31);
  decoding.max_tokens = 16;
  decoding.ignore_eos = true;
  decoding.mode = AttentionMode::kGpu;
  long_request.prompt_ids = testing::SyntheticPrompt(400, 32);
  long_request.max_tokens = 2;
  long_request.ignore_eos = true;
  long_request.mode = AttentionMode::kGpu;
  auto decoding_solo = Wait(*Submit(decoding, 100));
  auto long_solo = Wait(*Submit(long_request, 101));
  ASSERT_TRUE(decoding_solo.ok() && long_solo.ok());
  log_.clear();
  std::promise<void> release = HoldScheduler();
  auto a = Submit(decoding, 0);
  auto l = Submit(long_request, 1);
  release.set_value();
  auto a_summary = Wait(*a);
  auto l_summary = Wait(*l);
  ASSERT_TRUE(a_summary.ok() && l_summary.ok());
  EXPECT_EQ(a_summary->token_ids, decoding_solo->token_ids);
  EXPECT_EQ(l_summary->token_ids, long_solo->token_ids);
  if (gap_ms > 0) {
    EXPECT_LT(LastOf(0), FirstOf(1)) << "A waited for L's steps";
  } else {
    EXPECT_GT(LastOf(0), FirstOf(1)) << "A got more than one token per step";
  }
}

INSTANTIATE_TEST_SUITE_P(RideAlongOrApart, SchedulerDecodeGapTest, ::testing::Values(0.0, 0.001),
                         [](const ::testing::TestParamInfo<double>& info) {
                           return info.param > 0 ? std::string("Apart") : std::string("RideAlong");
                         });

TEST_F(SchedulerTest, DecodeGapsNeedPrefillBreaks) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  EngineOptions options;
  options.model_dir = testing::ModelDir("stories260k").string();
  options.backend = testing::TestBackendName();
  options.prefill_breaks = false;
  auto engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  SchedulerOptions scheduling;
  scheduling.max_decode_gap_ms = 20;
  auto scheduler = Scheduler::Create(std::move(*engine), scheduling);
  ASSERT_FALSE(scheduler.ok());
  EXPECT_EQ(scheduler.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(scheduler.status().message().find("prefill_breaks"), std::string::npos);
}

TEST_F(SchedulerTest, CancellationAndDeadlinesEndRequestsAndFreeTheirSessions) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  Make();
  // The client of request 0 goes away after its 10th token.
  auto gone = [this] {
    std::lock_guard<std::mutex> lock(log_mu_);
    int tokens = 0;
    for (const auto& [tag, index] : log_) tokens += tag == 0;
    return tokens >= 10;
  };
  GenerateRequest endless;
  endless.prompt_ids = testing::SyntheticPrompt(40, 3);
  endless.max_tokens = 400;
  endless.ignore_eos = true;
  endless.mode = AttentionMode::kHybrid;
  endless.session_id = "kept";
  auto cancelled = Submit(endless, 0, gone);
  GenerateRequest late = endless;
  late.session_id.clear();
  late.deadline = Clock::now() + std::chrono::milliseconds(20);
  auto expired = Submit(late, 1);
  auto summary = Wait(*expired);
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(summary.status().code(), absl::StatusCode::kDeadlineExceeded) << summary.status();
  summary = Wait(*cancelled);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(summary->completion_tokens, 10);
  // The cancelled turn was in decode: its kept session stays, consistent, and continues.
  EXPECT_EQ(OpenSessions(), 1u);
  GenerateRequest next;
  next.session_id = "kept";
  next.prompt_ids = {42, 43};
  next.max_tokens = 3;
  summary = Wait(*Submit(next, 2));
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->completion_tokens, 3);
  EXPECT_TRUE(scheduler_->Run([](Engine& e) { return e.CloseSession("kept"); }).ok());
  EXPECT_EQ(OpenSessions(), 0u);
}

TEST_F(SchedulerTest, AKeptSessionClosedAfterAStoppedTurnIsReportedOnceToItsNextTurn) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  Make(/*prefill_chunk=*/16);
  GenerateRequest first;
  first.session_id = "conv";
  first.prompt_ids = testing::SyntheticPrompt(20, 1);
  first.max_tokens = 3;
  first.ignore_eos = true;
  first.mode = AttentionMode::kHybrid;
  // A client that goes away once its prompt's first chunk is in (a request cancelled while it
  // waits never touches its session).
  auto stop_in_prefill = [this](GenerateRequest r, int tag) {
    auto prefilled = std::make_shared<bool>(false);   // set and read on the scheduler thread
    return Submit(std::move(r), tag, [prefilled] { return *prefilled; },
                  [prefilled](const PrefillProgress&) { *prefilled = true; });
  };
  // Its second turn is stopped after one 16-token chunk of a 100-token prompt: the session
  // holds part of a prompt no client sent whole, and the worker closes it.
  auto lose_it = [&] {
    auto summary = Wait(*Submit(first, 0));
    ASSERT_TRUE(summary.ok()) << summary.status();
    GenerateRequest second;
    second.session_id = "conv";
    second.prompt_ids = testing::SyntheticPrompt(100, 2);
    second.max_tokens = 3;
    summary = Wait(*stop_in_prefill(second, 1));
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->finish_reason, FinishReason::kCancelled);
    EXPECT_EQ(OpenSessions(), 0u);
  };
  ASSERT_NO_FATAL_FAILURE(lose_it());
  GenerateRequest third;
  third.session_id = "conv";
  third.prompt_ids = {5, 6};
  third.max_tokens = 2;
  // The next turn is told, instead of running without the first turn's context...
  auto told = Wait(*Submit(third, 2));
  ASSERT_FALSE(told.ok());
  EXPECT_EQ(told.status().code(), absl::StatusCode::kFailedPrecondition) << told.status();
  EXPECT_NE(told.status().message().find("'conv' was closed"), std::string::npos);
  EXPECT_NE(told.status().message().find("cancelled"), std::string::npos) << told.status();
  // ... once: the turn after that starts a new session.
  auto fresh = Wait(*Submit(third, 3));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->prompt_tokens, 2);
  EXPECT_EQ(OpenSessions(), 1u);
  EXPECT_TRUE(scheduler_->Run([](Engine& e) { return e.CloseSession("conv"); }).ok());
  // A client that closes a lost session is not told again either.
  ASSERT_NO_FATAL_FAILURE(lose_it());
  EXPECT_TRUE(scheduler_->Run([](Engine& e) { return e.CloseSession("conv"); }).ok());
  EXPECT_EQ(scheduler_->Run([](Engine& e) { return e.CloseSession("conv"); }).code(),
            absl::StatusCode::kNotFound);
  auto after_close = Wait(*Submit(third, 4));
  ASSERT_TRUE(after_close.ok()) << after_close.status();
  // A new session whose first turn is stopped had nothing to lose: its id is simply free.
  GenerateRequest stopped_new;
  stopped_new.session_id = "new";
  stopped_new.prompt_ids = testing::SyntheticPrompt(100, 3);
  stopped_new.max_tokens = 2;
  ASSERT_TRUE(Wait(*stop_in_prefill(stopped_new, 5)).ok());
  stopped_new.prompt_ids = {7};
  auto reused = Wait(*Submit(stopped_new, 6));
  ASSERT_TRUE(reused.ok()) << reused.status();
}

TEST_F(SchedulerTest, ARequestThatDoesNotFitWaitsForMemoryAndOneThatNeverFitsFails) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  // stories260k (5 layers x 4 kv heads x 8 dims, f32 KV): room for 20 16-token pages of
  // summaries and the default low-rank keys per (layer, kv head). Each request below offloads
  // ~190 tokens = 12 pages: one at a time.
  const WindowGeometry g{5, 4, 8, DType::kF32};
  Make(/*prefill_chunk=*/64,
       /*summary_cap=*/PageIndex::BytesFor(g, 16, 20 * 16, EngineOptions().page_low_rank));
  GenerateRequest r;
  r.prompt_ids = testing::SyntheticPrompt(10, 5);
  r.max_tokens = 200;
  r.ignore_eos = true;
  r.mode = AttentionMode::kHybrid;
  r.selection = SelectionRule::kPages;
  r.select_tokens = 32;
  auto first = Submit(r, 0);
  auto second = Submit(r, 1);
  GenerateRequest huge = r;
  huge.max_tokens = 480;   // 29 pages: more than the cap even alone
  auto first_summary = Wait(*first);
  auto second_summary = Wait(*second);
  ASSERT_TRUE(first_summary.ok()) << first_summary.status();
  ASSERT_TRUE(second_summary.ok()) << second_summary.status();
  EXPECT_EQ(second_summary->completion_tokens, 200);
  EXPECT_LT(LastOf(0), FirstOf(1)) << "the second request should have waited for the first";
  auto refused = Wait(*Submit(huge, 2));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
}

TEST_F(SchedulerTest, GpuModeRequestsBeyondTheDeviceKvBudgetWaitTheirTurn) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  // stories260k, f32 KV: 5 layers x 4 kv heads x (2 x 8 x 4 + 4) bytes = 1360 bytes per
  // position, + 4 for the slot table. A gpu-mode request of 10 + 200 tokens is sized for 256
  // positions (349,184 bytes); the budget holds one such window, not two.
  const WindowGeometry geometry{5, 4, 8, DType::kF32};
  WindowOptions wo;
  wo.window = WindowOptions::kUnlimited;
  wo.sink = 0;
  wo.block = 16;
  wo.max_chunk = 64;
  wo.max_context = 256;
  const size_t one = WindowCache::BytesFor(geometry, wo);
  ASSERT_EQ(one, 256u * 1364u);
  Make(/*prefill_chunk=*/64, /*summary_cap=*/0, /*kv_cap=*/one + one / 2);
  GenerateRequest r;
  r.prompt_ids = testing::SyntheticPrompt(10, 5);
  r.max_tokens = 200;
  r.ignore_eos = true;
  r.mode = AttentionMode::kGpu;
  auto first = Submit(r, 0);
  auto second = Submit(r, 1);
  auto first_summary = Wait(*first);
  auto second_summary = Wait(*second);
  ASSERT_TRUE(first_summary.ok()) << first_summary.status();
  ASSERT_TRUE(second_summary.ok()) << second_summary.status();
  EXPECT_LT(LastOf(0), FirstOf(1)) << "the second request should have waited for the first";
  GenerateRequest huge = r;
  huge.max_tokens = 400;   // 512 positions: more than the budget alone
  auto refused = Wait(*Submit(huge, 2));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("kv_cache_bytes"), std::string::npos);
}

TEST(SchedulerOptionsTest, BadOptionsAreRefused) {
  TANDEM_SKIP_WITHOUT_MODEL("stories260k");
  TANDEM_SKIP_WITHOUT_BACKEND();
  EngineOptions options;
  options.model_dir = testing::ModelDir("stories260k").string();
  options.backend = testing::TestBackendName();
  options.prefill_chunk = 32;
  for (SchedulerOptions bad : {SchedulerOptions{0}, SchedulerOptions{4, 10, 33},
                               SchedulerOptions{4, -1}, SchedulerOptions{4, 10, 0, 0}}) {
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ(Scheduler::Create(std::move(*engine), bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
