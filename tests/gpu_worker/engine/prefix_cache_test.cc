// Automatic prefix caching: the index (PrefixCache: block-hash chains, scopes, LRU) and the
// engine on stories260k (a one-shot request's KV reused by a later prompt that starts with the
// same tokens, in gpu, hybrid and offload mode, giving the tokens of a cold run; isolation
// between principals and salts; eviction under the session limit and the device KV budget).
#include "tandem/gpu_worker/prefix_cache.h"

#include <future>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/scheduler.h"

namespace tandem::gpu_worker {
namespace {

std::vector<int32_t> Ids(int64_t n, int32_t salt) { return testing::SyntheticPrompt(n, salt); }

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(PrefixCacheIndex, LongestCommonPrefixWithinTheScope) {
  PrefixCache cache(16);
  const std::vector<int32_t> doc = Ids(100, 1);
  cache.Insert("a", "alice", std::vector<int32_t>(doc.begin(), doc.begin() + 40));
  cache.Insert("b", "alice", Concat(doc, Ids(10, 7)));   // the document, then another question
  cache.Insert("c", "bob", doc);
  // The document plus a new question: b shares the whole document (100 ids), a only 40.
  const std::vector<int32_t> prompt = Concat(doc, Ids(20, 9));
  auto hit = cache.Match("alice", prompt, 16);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->session_id, "b");
  EXPECT_EQ(hit->common, 100 + (Ids(10, 7)[0] == Ids(20, 9)[0] ? 1 : 0));
  // Another scope never matches, whatever it holds.
  hit = cache.Match("bob", prompt, 16);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->session_id, "c");
  EXPECT_FALSE(cache.Match("carol", prompt, 1).has_value());
  // Below the minimum: no hit.
  EXPECT_FALSE(cache.Match("alice", Ids(10, 1), 16).has_value());
  // At least one prompt token is left to feed.
  hit = cache.Match("bob", doc, 16);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->common, 99);
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_EQ(cache.cached_tokens(), 40 + 110 + 100);
}

TEST(PrefixCacheIndex, IdsDecideNotBlockBoundaries) {
  PrefixCache cache(16);
  std::vector<int32_t> held = Ids(50, 3);
  cache.Insert("s", "", held);
  // Differs inside the second block: the common prefix stops there, not at a block boundary.
  std::vector<int32_t> prompt = held;
  prompt[20] += 1;
  auto hit = cache.Match("", prompt, 1);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->common, 20);
  // Differs in the first id: nothing shared.
  prompt = held;
  prompt[0] = 2;
  EXPECT_FALSE(cache.Match("", prompt, 1).has_value());
}

TEST(PrefixCacheIndex, LeastRecentlyUsedOrderAndTake) {
  PrefixCache cache(4);
  cache.Insert("x", "", Ids(8, 1));
  cache.Insert("y", "", Ids(8, 2));
  EXPECT_EQ(cache.LeastRecentlyUsed(), "x");
  cache.Insert("x", "", Ids(9, 1));   // re-inserted after its next turn: most recent
  EXPECT_EQ(cache.LeastRecentlyUsed(), "y");
  EXPECT_TRUE(cache.Take("y"));
  EXPECT_FALSE(cache.Take("y"));
  EXPECT_EQ(cache.LeastRecentlyUsed(), "x");
  EXPECT_EQ(cache.cached_tokens(), 9);
  EXPECT_TRUE(cache.Take("x"));
  EXPECT_FALSE(cache.LeastRecentlyUsed().has_value());
  EXPECT_EQ(cache.cached_tokens(), 0);
}

TEST(PrefixCacheIndex, BlockKeysNameTheWholePrefix) {
  const std::vector<int32_t> a = Ids(48, 1);
  std::vector<int32_t> b = a;
  b[3] += 1;   // first block differs: every later key differs too
  const auto ka = PrefixCache::BlockKeys(a, 16), kb = PrefixCache::BlockKeys(b, 16);
  ASSERT_EQ(ka.size(), 3u);
  ASSERT_EQ(kb.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(ka[i], kb[i]);
  EXPECT_EQ(PrefixCache::BlockKeys(std::vector<int32_t>(a.begin(), a.begin() + 40), 16),
            std::vector<uint64_t>(ka.begin(), ka.begin() + 2));
}

class EnginePrefixCache : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("stories260k");
    TANDEM_SKIP_WITHOUT_BACKEND();
  }

  static EngineOptions Options(bool cache) {
    EngineOptions options;
    options.model_dir = testing::ModelDir("stories260k").string();
    options.backend = testing::TestBackendName();
    options.nodes.embedded.pool_bytes = 64ull << 20;
    options.prefill_chunk = 32;
    // A bounded window holds the last 64 tokens: a prompt may diverge from a cached session
    // only where that session's tokens are still on the device (WindowCache::Truncate).
    options.default_window = 64;
    options.default_sink = 4;
    options.prefix_cache = cache;
    // Cached sessions are closed when the device needs their room, on every backend (the cuda
    // backend parks them in host memory by default); the parking test sets a pool.
    options.prefix_cache_host_bytes = 0;
    return options;
  }

  static std::unique_ptr<Engine> Make(const EngineOptions& options) {
    auto engine = Engine::Create(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }

  static GenerateRequest Request(std::vector<int32_t> ids, AttentionMode mode, int64_t tokens) {
    GenerateRequest r;
    r.prompt_ids = std::move(ids);
    r.max_tokens = tokens;
    r.ignore_eos = true;
    r.mode = mode;
    if (mode == AttentionMode::kHybrid) r.beta = 0.0f;   // exact: every offloaded entry
    return r;
  }
};

// The second request resends the first one's prompt with a different ending: it reuses the
// prompt's KV (truncating the first request's generated tokens away) and gives the tokens a
// cold run gives. Then a chat-style third request resends the second's prompt and answer
// plus a new turn: every token held is reused.
TEST_F(EnginePrefixCache, AResentPromptReusesItsKvAndMatchesAColdRun) {
  for (AttentionMode mode : {AttentionMode::kGpu, AttentionMode::kHybrid, AttentionMode::kOffload}) {
    SCOPED_TRACE(std::string(AttentionModeName(mode)));
    auto cached = Make(Options(true));
    auto cold = Make(Options(false));
    ASSERT_NE(cached, nullptr);
    ASSERT_NE(cold, nullptr);
    const std::vector<int32_t> doc = Ids(150, 5);

    auto first = cached->Generate(Request(Concat(doc, Ids(12, 1)), mode, 20));
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->cached_tokens, 0);
    EXPECT_EQ(first->prompt_tokens, 162);
    EXPECT_EQ(cached->kv_cache().cached_sessions(), 1u);

    const std::vector<int32_t> second_prompt = Concat(doc, Ids(30, 2));
    auto second = cached->Generate(Request(second_prompt, mode, 24));
    ASSERT_TRUE(second.ok()) << second.status();
    auto second_cold = cold->Generate(Request(second_prompt, mode, 24));
    ASSERT_TRUE(second_cold.ok()) << second_cold.status();
    EXPECT_EQ(second->cached_tokens, 150 + (Ids(12, 1)[0] == Ids(30, 2)[0] ? 1 : 0));
    EXPECT_EQ(second->prompt_tokens, 180);
    EXPECT_EQ(second_cold->cached_tokens, 0);
    EXPECT_EQ(second->token_ids, second_cold->token_ids);

    // Chat: the history (prompt + answer) and a new turn.
    const std::vector<int32_t> third_prompt =
        Concat(Concat(second_prompt, second->token_ids), Ids(10, 3));
    auto third = cached->Generate(Request(third_prompt, mode, 16));
    ASSERT_TRUE(third.ok()) << third.status();
    auto third_cold = cold->Generate(Request(third_prompt, mode, 16));
    ASSERT_TRUE(third_cold.ok()) << third_cold.status();
    // All the second request fed: its prompt and its answer but the last token (sampled, not
    // fed; the third prompt feeds it).
    EXPECT_EQ(third->cached_tokens, 180 + 24 - 1);
    EXPECT_EQ(third->token_ids, third_cold->token_ids);
    EXPECT_EQ(cold->open_sessions(), 0u);
  }
}

// Runs generations begun together to their ends, one engine step at a time (each step decodes
// one token of every decoding generation and prefills the others within the step's budget).
std::vector<absl::StatusOr<GenerateSummary>> RunTogether(
    Engine& engine, std::vector<std::unique_ptr<Generation>>& generations) {
  for (;;) {
    std::vector<Engine::StepItem> items;
    int64_t budget = engine.max_step_tokens();
    for (auto& g : generations) {
      if (g->finished() || budget <= 0) continue;
      const int64_t n = g->prefilling() ? std::min(budget, g->remaining()) : 1;
      items.push_back({g.get(), n});
      budget -= n;
    }
    if (items.empty()) break;
    (void)engine.Step(items);   // failures are recorded in the generations
  }
  std::vector<absl::StatusOr<GenerateSummary>> summaries;
  for (auto& g : generations) summaries.push_back(engine.End(*g));
  return summaries;
}

// Several questions over one document. A later question forks the cached session that holds
// the document instead of truncating it: readers running at the same time all reuse it, and the
// first reader's session keeps its own tokens (its next turn reuses every one of them). The CPU
// nodes share the forked blocks; the window and page summaries are copied. Every answer equals
// a cold run's.
TEST_F(EnginePrefixCache, QuestionsOverOneDocumentForkItsCachedPrefix) {
  struct Case {
    AttentionMode mode;
    bool pages;
  };
  for (const Case c : {Case{AttentionMode::kGpu, false}, Case{AttentionMode::kHybrid, false},
                       Case{AttentionMode::kHybrid, true}, Case{AttentionMode::kOffload, false}}) {
    SCOPED_TRACE(std::string(AttentionModeName(c.mode)) + (c.pages ? " pages" : ""));
    auto cached = Make(Options(true));
    auto cold = Make(Options(false));
    ASSERT_NE(cached, nullptr);
    ASSERT_NE(cold, nullptr);
    auto request = [&](std::vector<int32_t> ids, int64_t tokens) {
      GenerateRequest r = Request(std::move(ids), c.mode, tokens);
      if (c.pages) {   // a budget that covers every page: exact, as beta 0 is
        r.beta.reset();
        r.selection = SelectionRule::kPages;
        r.select_tokens = 4096;
      }
      return r;
    };
    const std::vector<int32_t> doc = Ids(150, 6);
    const std::vector<int32_t> first_prompt = Concat(doc, Ids(12, 1));
    auto first = cached->Generate(request(first_prompt, 20));
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_EQ(cached->kv_cache().cached_sessions(), 1u);

    // Two readers at once, each with its own question: both fork the first one's session.
    const std::vector<std::vector<int32_t>> questions = {Concat(doc, Ids(30, 2)),
                                                         Concat(doc, Ids(20, 3))};
    std::vector<std::unique_ptr<Generation>> readers;
    for (const auto& prompt : questions) {
      auto g = cached->Begin(request(prompt, 16), {}, Generation::Clock::now());
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_GE((*g)->cached_tokens, 150);
      readers.push_back(std::move(*g));
    }
    EXPECT_EQ(cached->kv_cache().cached_sessions(), 1u) << "the document's session stays cached";
    EXPECT_EQ(cached->open_sessions(), 2u);
    auto answers = RunTogether(*cached, readers);
    for (size_t i = 0; i < questions.size(); ++i) {
      ASSERT_TRUE(answers[i].ok()) << answers[i].status();
      auto reference = cold->Generate(request(questions[i], 16));
      ASSERT_TRUE(reference.ok()) << reference.status();
      EXPECT_EQ(answers[i]->token_ids, reference->token_ids) << "reader " << i;
      EXPECT_EQ(answers[i]->degraded_steps, 0u);
    }
    EXPECT_EQ(cached->kv_cache().cached_sessions(), 3u);
    EXPECT_EQ(cached->open_sessions(), 0u);

    // The first reader's next turn: its whole history is still cached.
    const std::vector<int32_t> next_turn =
        Concat(Concat(first_prompt, first->token_ids), Ids(8, 4));
    auto turn = cached->Generate(request(next_turn, 12));
    ASSERT_TRUE(turn.ok()) << turn.status();
    EXPECT_EQ(turn->cached_tokens, 162 + 20 - 1);
    auto turn_cold = cold->Generate(request(next_turn, 12));
    ASSERT_TRUE(turn_cold.ok()) << turn_cold.status();
    EXPECT_EQ(turn->token_ids, turn_cold->token_ids);
  }
}

// Readers of one document arriving together: while the first one's prompt is being prefilled,
// the others are worth holding back (PrefillWorthWaitingFor; not readers of another document or
// scope); once it is in, a reader forks the running session and prefills only its question.
// The answers equal cold runs.
TEST_F(EnginePrefixCache, ReadersArrivingTogetherShareOnePrefill) {
  for (AttentionMode mode : {AttentionMode::kGpu, AttentionMode::kHybrid}) {
    SCOPED_TRACE(std::string(AttentionModeName(mode)));
    // A prompt settles into the nodes a block per step: the first reader is still settling
    // when the second forks it.
    EngineOptions slow_settle = Options(true);
    slow_settle.settle_tokens_per_step = 16;
    auto cached = Make(slow_settle);
    slow_settle.prefix_cache = false;
    auto cold = Make(slow_settle);
    ASSERT_NE(cached, nullptr);
    ASSERT_NE(cold, nullptr);
    const std::vector<int32_t> doc = Ids(150, 9);
    const GenerateRequest first = Request(Concat(doc, Ids(12, 1)), mode, 12);
    const GenerateRequest second = Request(Concat(doc, Ids(20, 2)), mode, 12);
    std::vector<std::unique_ptr<Generation>> readers;
    auto a = cached->Begin(first, {}, Generation::Clock::now());
    ASSERT_TRUE(a.ok()) << a.status();
    readers.push_back(std::move(*a));
    Generation& reader_a = *readers[0];

    EXPECT_TRUE(cached->PrefillWorthWaitingFor(second));
    EXPECT_FALSE(cached->PrefillWorthWaitingFor(Request(Concat(Ids(150, 10), Ids(20, 2)), mode, 4)))
        << "another document";
    GenerateRequest salted = second;
    salted.cache_salt = "another tenant";
    EXPECT_FALSE(cached->PrefillWorthWaitingFor(salted)) << "another scope";
    GenerateRequest session_turn = second;
    session_turn.session_id = "kept";
    EXPECT_FALSE(cached->PrefillWorthWaitingFor(session_turn)) << "an explicit session";
    EXPECT_FALSE(cached->PrefillWorthWaitingFor(Request({doc[0]}, mode, 4))) << "one token";

    // The first reader's prompt goes in (a chunk per step) and its first token comes out.
    int64_t steps = 0;
    while (reader_a.prefilling() && !reader_a.finished()) {
      ASSERT_TRUE(cached
                      ->Step({{&reader_a,
                               std::min(cached->max_step_tokens(), reader_a.remaining())}})
                      .ok());
      ASSERT_LT(++steps, 100);
      // Worth waiting while a block or more of the document is still to come (or, in hybrid
      // mode, while its window is widened for the prefill: it cannot be forked before).
      if (reader_a.prefilling() && (reader_a.seq->tokens.size() + 16 <= doc.size() ||
                                    reader_a.seq->window.widened())) {
        EXPECT_TRUE(cached->PrefillWorthWaitingFor(second)) << reader_a.seq->tokens.size();
      }
    }
    EXPECT_FALSE(cached->PrefillWorthWaitingFor(second)) << "its prompt is in: fork it now";

    const bool was_settling = reader_a.seq->window.settling();
    auto b = cached->Begin(second, {}, Generation::Clock::now());
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_GE((*b)->cached_tokens, 150) << "forked from the running reader";
    // A parent settling its prompt into the nodes finishes first: the fork shares those entries.
    EXPECT_FALSE(reader_a.seq->window.settling()) << "was settling: " << was_settling;
    if (mode == AttentionMode::kHybrid) {
      EXPECT_TRUE(was_settling);
      EXPECT_EQ(readers[0]->seq->offloaded_entries(), (*b)->seq->offloaded_entries());
    }
    EXPECT_EQ(cached->kv_cache().cached_sessions(), 0u);
    readers.push_back(std::move(*b));
    auto answers = RunTogether(*cached, readers);
    for (const auto& [i, request] : {std::pair{0, first}, std::pair{1, second}}) {
      ASSERT_TRUE(answers[i].ok()) << answers[i].status();
      auto reference = cold->Generate(request);
      ASSERT_TRUE(reference.ok()) << reference.status();
      EXPECT_EQ(answers[i]->token_ids, reference->token_ids) << "reader " << i;
    }
    EXPECT_EQ(cached->kv_cache().cached_sessions(), 2u);
  }
}

// Through the scheduler: readers of one document submitted at once prefill it once.
TEST_F(EnginePrefixCache, TheSchedulerHoldsReadersForARunningPrefill) {
  auto engine = Make(Options(true));
  ASSERT_NE(engine, nullptr);
  auto scheduler = Scheduler::Create(std::move(engine), SchedulerOptions{});
  ASSERT_TRUE(scheduler.ok()) << scheduler.status();
  const std::vector<int32_t> doc = Ids(300, 11);
  std::vector<std::future<absl::StatusOr<GenerateSummary>>> outcomes;
  for (int32_t q = 0; q < 4; ++q) {
    auto done = std::make_shared<std::promise<absl::StatusOr<GenerateSummary>>>();
    outcomes.push_back(done->get_future());
    ASSERT_TRUE((*scheduler)
                    ->Submit(Request(Concat(doc, Ids(16, 30 + q)), AttentionMode::kGpu, 6), {},
                             [done](absl::StatusOr<GenerateSummary> s) {
                               done->set_value(std::move(s));
                             })
                    .ok());
  }
  int64_t prefilled = 0;
  for (auto& outcome : outcomes) {
    absl::StatusOr<GenerateSummary> s = outcome.get();
    ASSERT_TRUE(s.ok()) << s.status();
    prefilled += s->prompt_tokens - s->cached_tokens;
  }
  // The document once, and each question; a reader that came when less than a block of the
  // document was left to prefill forked what was in and prefilled that rest itself.
  EXPECT_LE(prefilled, 300 + 4 * 16 + 3 * 16);
}

// A kept session (opened with a session_id) is a pinned prefix of its scope: one-shot questions
// over its document fork it (another principal never does), and the session itself goes on
// unchanged (its next turn gives what a cold conversation gives).
TEST_F(EnginePrefixCache, AKeptSessionIsAPinnedPrefixForOneShotRequests) {
  for (AttentionMode mode : {AttentionMode::kGpu, AttentionMode::kHybrid}) {
    SCOPED_TRACE(std::string(AttentionModeName(mode)));
    auto cached = Make(Options(true));
    auto cold = Make(Options(false));
    ASSERT_NE(cached, nullptr);
    ASSERT_NE(cold, nullptr);
    const std::vector<int32_t> doc = Ids(150, 12);
    GenerateRequest open = Request(Concat(doc, Ids(4, 1)), mode, 8);
    open.session_id = "doc";
    open.principal = "alice";
    GenerateRequest turn = Request(Ids(6, 3), mode, 8);
    turn.session_id = "doc";
    turn.principal = "alice";
    ASSERT_TRUE(cached->Generate(open).ok());

    GenerateRequest question = Request(Concat(doc, Ids(20, 2)), mode, 12);
    question.principal = "alice";
    auto answer = cached->Generate(question);
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_GE(answer->cached_tokens, 150) << "forked from the kept session";
    auto reference = cold->Generate(question);
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_EQ(answer->token_ids, reference->token_ids);

    GenerateRequest other = question;
    other.principal = "bob";
    other.prompt_ids = Concat(doc, Ids(20, 4));
    auto bob = cached->Generate(other);
    ASSERT_TRUE(bob.ok()) << bob.status();
    EXPECT_EQ(bob->cached_tokens, 0) << "another principal never hits";

    auto next = cached->Generate(turn);
    ASSERT_TRUE(next.ok()) << next.status();
    ASSERT_TRUE(cold->Generate(open).ok());
    auto next_cold = cold->Generate(turn);
    ASSERT_TRUE(next_cold.ok()) << next_cold.status();
    EXPECT_EQ(next->token_ids, next_cold->token_ids) << "the kept session went on unchanged";
    EXPECT_EQ(cached->open_sessions(), 1u);
    ASSERT_TRUE(cached->CloseSession("doc").ok());
  }

  // One scope for every caller's one-shot requests: a conversation still stays its principal's.
  EngineOptions shared = Options(true);
  shared.prefix_cache_shared_scope = true;
  auto engine = Make(shared);
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> doc = Ids(150, 13);
  GenerateRequest open = Request(Concat(doc, Ids(4, 1)), AttentionMode::kGpu, 4);
  open.session_id = "alice-doc";
  open.principal = "alice";
  ASSERT_TRUE(engine->Generate(open).ok());
  GenerateRequest bob = Request(Concat(doc, Ids(20, 2)), AttentionMode::kGpu, 4);
  bob.principal = "bob";
  auto b = engine->Generate(bob);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->cached_tokens, 0) << "another principal's kept session, under the shared scope";
  GenerateRequest alice = Request(Concat(doc, Ids(20, 3)), AttentionMode::kGpu, 4);
  alice.principal = "alice";
  auto a = engine->Generate(alice);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_GE(a->cached_tokens, 150) << "its own principal's one-shot request forks it";
}

// A tier that cannot fork (exact mode) continues the cached session in place, as before forks:
// nothing is evicted for a fork that cannot be made, and the answer equals a cold run.
TEST_F(EnginePrefixCache, ATierThatCannotForkContinuesTheCachedSessionInPlace) {
  EngineOptions options = Options(true);
  options.max_sessions = 2;
  auto cached = Make(options);
  options.prefix_cache = false;
  auto cold = Make(options);
  ASSERT_NE(cached, nullptr);
  ASSERT_NE(cold, nullptr);
  ASSERT_TRUE(cached->Generate(Request(Ids(100, 40), AttentionMode::kExact, 4)).ok());
  const std::vector<int32_t> doc = Ids(150, 14);
  ASSERT_TRUE(cached->Generate(Request(Concat(doc, Ids(12, 1)), AttentionMode::kExact, 20)).ok());
  ASSERT_EQ(cached->kv_cache().cached_sessions(), 2u);
  const GenerateRequest second = Request(Concat(doc, Ids(30, 2)), AttentionMode::kExact, 8);
  auto answer = cached->Generate(second);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_GE(answer->cached_tokens, 150);
  EXPECT_EQ(cached->kv_cache().evictions(), 0u);
  EXPECT_EQ(cached->kv_cache().cached_sessions(), 2u);
  auto reference = cold->Generate(second);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(answer->token_ids, reference->token_ids);
}

TEST_F(EnginePrefixCache, ScopesAreIsolatedByPrincipalAndSalt) {
  for (bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared scope" : "principal scope");
    EngineOptions options = Options(true);
    options.prefix_cache_shared_scope = shared;
    auto engine = Make(options);
    ASSERT_NE(engine, nullptr);
    const std::vector<int32_t> doc = Ids(120, 8);
    GenerateRequest alice = Request(Concat(doc, Ids(5, 1)), AttentionMode::kGpu, 4);
    alice.principal = "alice";
    ASSERT_TRUE(engine->Generate(alice).ok());

    GenerateRequest bob = Request(Concat(doc, Ids(5, 2)), AttentionMode::kGpu, 4);
    bob.principal = "bob";
    auto b = engine->Generate(bob);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->cached_tokens > 0, shared) << "another principal hit only in a shared scope";

    GenerateRequest salted = Request(Concat(doc, Ids(5, 3)), AttentionMode::kGpu, 4);
    salted.principal = "alice";
    salted.cache_salt = "tenant-2";
    auto s = engine->Generate(salted);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->cached_tokens, 0) << "another salt never hits";

    GenerateRequest again = Request(Concat(doc, Ids(5, 4)), AttentionMode::kGpu, 4);
    again.principal = "alice";
    auto a = engine->Generate(again);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_GE(a->cached_tokens, 120);

    // Another mode is another scope: its sessions hold another layout.
    GenerateRequest hybrid = Request(Concat(doc, Ids(5, 5)), AttentionMode::kHybrid, 4);
    hybrid.principal = "alice";
    auto h = engine->Generate(hybrid);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->cached_tokens, 0);
  }
}

// The scope holds what the tier's KV depends on (TierTraits): the window and sink of a windowed
// tier, the selection only of a selecting one. An offload request naming pages reuses an
// offload session opened with MAW (offload attends over every entry either way); one with
// another window does not (its device window holds other positions).
TEST_F(EnginePrefixCache, TheScopeHoldsOnlyWhatTheTierReads) {
  auto engine = Make(Options(true));
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> doc = Ids(120, 9);
  GenerateRequest first = Request(Concat(doc, Ids(5, 1)), AttentionMode::kOffload, 4);
  first.selection = SelectionRule::kMaw;
  ASSERT_TRUE(engine->Generate(first).ok());

  GenerateRequest pages = Request(Concat(doc, Ids(5, 2)), AttentionMode::kOffload, 4);
  pages.selection = SelectionRule::kPages;
  auto p = engine->Generate(pages);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GE(p->cached_tokens, 120) << "offload reads no selection: the same scope";

  GenerateRequest wider = Request(Concat(doc, Ids(5, 3)), AttentionMode::kOffload, 4);
  wider.window = 96;
  auto w = engine->Generate(wider);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->cached_tokens, 0) << "another window is another scope";
}

// More distinct prompts than sessions or device KV allow: cached sessions are evicted, least
// recently used first, and no request fails.
TEST_F(EnginePrefixCache, EvictionMakesRoomAndNoRequestFails) {
  EngineOptions options = Options(true);
  options.max_sessions = 3;
  auto engine = Make(options);
  ASSERT_NE(engine, nullptr);
  for (int32_t i = 0; i < 8; ++i) {
    auto s = engine->Generate(Request(Ids(100, 20 + i), AttentionMode::kHybrid, 8));
    ASSERT_TRUE(s.ok()) << i << ": " << s.status();
    EXPECT_EQ(engine->open_sessions(), 0u);
    EXPECT_LE(engine->kv_cache().cached_sessions(), 3u);
  }
  EXPECT_EQ(engine->kv_cache().cached_sessions(), 3u);
  EXPECT_EQ(engine->kv_cache().evictions(), 5u);
  // The most recent survive: the last prompt hits, the first does not.
  auto last = engine->Generate(Request(Concat(Ids(100, 27), Ids(4, 1)), AttentionMode::kHybrid, 4));
  ASSERT_TRUE(last.ok());
  EXPECT_GE(last->cached_tokens, 100);
  auto first = engine->Generate(Request(Concat(Ids(100, 20), Ids(4, 1)), AttentionMode::kHybrid, 4));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->cached_tokens, 0);

  // gpu mode under a device KV budget that holds about two sessions.
  EngineOptions budgeted = Options(true);
  auto probe = Make(budgeted);
  ASSERT_NE(probe, nullptr);
  ASSERT_TRUE(probe->Generate(Request(Ids(100, 1), AttentionMode::kGpu, 8)).ok());
  budgeted.kv_cache_bytes = probe->DeviceKvBytes() * 5 / 2;
  ASSERT_GT(budgeted.kv_cache_bytes, 0u);
  auto tight = Make(budgeted);
  ASSERT_NE(tight, nullptr);
  for (int32_t i = 0; i < 6; ++i) {
    auto s = tight->Generate(Request(Ids(100, 40 + i), AttentionMode::kGpu, 8));
    ASSERT_TRUE(s.ok()) << i << ": " << s.status();
    EXPECT_LE(tight->DeviceKvBytes(), budgeted.kv_cache_bytes);
  }
  EXPECT_GE(tight->kv_cache().evictions(), 3u);

  // hybrid under a CPU node pool that holds about two cached sessions: the shortage is the
  // node's (memory_shortage.h), so cached sessions holding node memory are closed, never parked
  // (parking frees device memory only), and the room they free is seen at once (the pool's
  // Stats are refreshed before a refused open is retried): every request runs.
  EngineOptions pooled = Options(true);
  auto node_probe = Make(pooled);
  ASSERT_NE(node_probe, nullptr);
  ASSERT_TRUE(node_probe->Generate(Request(Ids(100, 60), AttentionMode::kHybrid, 8)).ok());
  ASSERT_TRUE(node_probe->nodes().Refresh().ok());
  const NodeState node = node_probe->nodes().Snapshot().at(0);
  const uint64_t one = node.capacity_bytes - node.free_bytes;   // one cached session
  ASSERT_GT(one, 0u);
  EXPECT_GT(node_probe->kv_cache().footprint().nodes, 0u);
  pooled.nodes.embedded.pool_bytes = one * 5 / 2;
  pooled.prefix_cache_host_bytes = size_t{1} << 30;
  auto small_pool = Make(pooled);
  ASSERT_NE(small_pool, nullptr);
  for (int32_t i = 0; i < 6; ++i) {
    auto s = small_pool->Generate(Request(Ids(100, 70 + i), AttentionMode::kHybrid, 8));
    ASSERT_TRUE(s.ok()) << i << ": " << s.status();
  }
  // How many fit depends on the node's charges (its selected-copy buffers grow geometrically):
  // some were closed for room, none parked, and every other one is still cached.
  EXPECT_GE(small_pool->kv_cache().evictions(), 1u);
  EXPECT_EQ(small_pool->kv_cache().parks(), 0u);
  EXPECT_EQ(small_pool->kv_cache().cached_sessions() + small_pool->kv_cache().evictions(), 6u);
}

// Under a device KV budget that holds about two cached sessions, the others are parked in host
// memory instead of closed: a prompt that hits a parked one brings it back and gets the tokens
// a never-parked hit gets (and, in gpu mode, a cold run's). gpu mode parks all its KV; hybrid
// with pages its window and page summaries (its offloaded KV stays on the CPU node).
TEST_F(EnginePrefixCache, ParkedSessionsComeBackAndGiveTheSameTokens) {
  for (const bool pages : {false, true}) {
    const AttentionMode mode = pages ? AttentionMode::kHybrid : AttentionMode::kGpu;
    SCOPED_TRACE(pages ? "hybrid, pages" : "gpu");
    auto request = [&](std::vector<int32_t> ids, int64_t tokens) {
      GenerateRequest r = Request(std::move(ids), mode, tokens);
      if (pages) {
        r.selection = SelectionRule::kPages;
        r.select_tokens = 16;
        r.beta.reset();
      }
      return r;
    };
    auto probe = Make(Options(true));
    ASSERT_NE(probe, nullptr);
    ASSERT_TRUE(probe->Generate(request(Concat(Ids(100, 60), Ids(8, 1)), 8)).ok());
    const size_t one = probe->DeviceKvBytes();   // one cached session on the device
    ASSERT_GT(one, 0u);

    EngineOptions options = Options(true);
    options.kv_cache_bytes = one * 5 / 2;
    options.prefix_cache_host_bytes = size_t{1} << 30;
    auto parking = Make(options);
    auto unbounded = Make(Options(true));   // the same requests, nothing parked
    ASSERT_NE(parking, nullptr);
    ASSERT_NE(unbounded, nullptr);
    for (int32_t i = 0; i < 5; ++i) {
      auto p = parking->Generate(request(Concat(Ids(100, 60 + i), Ids(8, 1)), 8));
      ASSERT_TRUE(p.ok()) << i << ": " << p.status();
      ASSERT_TRUE(unbounded->Generate(request(Concat(Ids(100, 60 + i), Ids(8, 1)), 8)).ok());
      EXPECT_LE(parking->DeviceKvBytes(), options.kv_cache_bytes);
    }
    EXPECT_EQ(parking->kv_cache().evictions(), 0u) << "parked, not closed";
    EXPECT_EQ(parking->kv_cache().cached_sessions(), 5u);
    EXPECT_GE(parking->kv_cache().parks(), 3u);
    EXPECT_EQ(parking->kv_cache().parked_sessions(), parking->kv_cache().parks());
    EXPECT_GT(parking->kv_cache().host_bytes(), 0u);
    EXPECT_LE(parking->kv_cache().device_bytes(), options.kv_cache_bytes);

    // The first document, parked longest: back on the device, it serves the new question.
    const std::vector<int32_t> question = Concat(Ids(100, 60), Ids(12, 2));
    auto hit = parking->Generate(request(question, 12));
    ASSERT_TRUE(hit.ok()) << hit.status();
    auto reference = unbounded->Generate(request(question, 12));
    ASSERT_TRUE(reference.ok()) << reference.status();
    EXPECT_GE(hit->cached_tokens, 100);
    EXPECT_EQ(hit->cached_tokens, reference->cached_tokens);
    EXPECT_EQ(hit->token_ids, reference->token_ids);
    EXPECT_EQ(parking->kv_cache().unparks(), 1u);
    EXPECT_LE(parking->DeviceKvBytes(), options.kv_cache_bytes);
    if (!pages) {
      auto cold = Make(Options(false))->Generate(request(question, 12));
      ASSERT_TRUE(cold.ok()) << cold.status();
      EXPECT_EQ(hit->token_ids, cold->token_ids);
    }
    EXPECT_EQ(parking->kv_cache().evictions(), 0u);

    // Host room for one parked session: the least recently parked are closed for the next.
    EngineOptions one_parked = options;
    one_parked.prefix_cache_host_bytes =
        parking->kv_cache().host_bytes() / parking->kv_cache().parked_sessions() * 3 / 2;
    auto small = Make(one_parked);
    ASSERT_NE(small, nullptr);
    for (int32_t i = 0; i < 5; ++i) {
      ASSERT_TRUE(small->Generate(request(Concat(Ids(100, 60 + i), Ids(8, 1)), 8)).ok());
      EXPECT_LE(small->kv_cache().host_bytes(), *one_parked.prefix_cache_host_bytes);
    }
    EXPECT_EQ(small->kv_cache().parked_sessions(), 1u);
    EXPECT_GE(small->kv_cache().evictions(), 2u);
    // The oldest was closed: a miss, no failure.
    auto oldest = small->Generate(request(question, 12));
    ASSERT_TRUE(oldest.ok()) << oldest.status();
    EXPECT_EQ(oldest->cached_tokens, 0);
    if (!pages) {
      EXPECT_EQ(oldest->token_ids, reference->token_ids);
    }
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
