// The settle after a device prefill, a slice per step (issue 15): on stories260k, a prompt many
// windows long (300 tokens, window 16, sink 4) is prefilled with the window widened; afterwards
// its blocks beyond the window move to the tier at most settle_tokens_per_step (16 here, one
// block) per step, while the request decodes on and other requests step:
//  - WindowCache: a settling ring appends into free slots only (EvictionsBeforeAppend names the
//    blocks that must leave first) and widens with its pending blocks for a next turn;
//  - decode steps while settling give the tokens and log-probabilities of the whole settle at
//    once (settle_tokens_per_step = 0) and of gpu mode, within 1e-4, in offload, exact and
//    hybrid (MAW beta 0, pages selecting every page) mode, and after every step each entry is
//    in the window or the tier, once;
//  - the runner alone (no tokenizer: this case also runs under the sanitizers): the same
//    equality for an offload sequence decoding while SettleSlice moves a block per step;
//  - a second request's steps go on while the first settles; a kept session that ends (or
//    starts its next turn) mid-settle settles on, and its next turn is still exact; with
//    nothing running, what is left settles a slice per Engine::SettleIdle (End does not wait);
//  - a request cancelled mid-settle releases its window, tier and node session;
//  - a settle failure (the tier's Append fails) fails only that request;
//  - settle_shares_prefill_budget: a step that feeds a prompt chunk settles what the chunk
//    leaves of the budget (at least a block), the next decode-only step a whole slice.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "runner_fixture.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/logprobs.h"
#include "tandem/gpu_worker/offload_tier.h"
#include "tandem/gpu_worker/window_cache.h"

namespace tandem::gpu_worker {
namespace {

constexpr float kLogprobTolerance = 1e-4f;
constexpr int64_t kWindow = 16, kSink = 4, kChunk = 64, kPrompt = 300, kSlice = 16;


std::unique_ptr<Engine> MakeEngine(int64_t settle_tokens_per_step,
                                   bool settle_shares_prefill_budget = false) {
  EngineOptions options;
  options.model_dir = testing::ModelDir("stories260k").string();
  options.backend = testing::TestBackendName();
  options.nodes.embedded.pool_bytes = 64ull << 20;
  options.default_window = kWindow;
  options.default_sink = kSink;
  options.prefill_chunk = kChunk;
  options.offload_page_tokens = 16;
  options.exact_fetch_share = 0.5;   // exact mode: half the entries on the node, half on host
  options.settle_tokens_per_step = settle_tokens_per_step;
  options.settle_shares_prefill_budget = settle_shares_prefill_budget;
  auto engine = Engine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

struct Case {
  const char* name;
  AttentionMode mode;
  SelectionRule selection;
};

GenerateRequest Request(const Case& c, const std::vector<int32_t>& prompt, int max_tokens) {
  GenerateRequest r;
  r.prompt_ids = prompt;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.mode = c.mode;
  r.logprobs = true;
  r.top_logprobs = kMaxTopLogprobs;
  if (c.mode == AttentionMode::kHybrid) {
    r.selection = c.selection;
    if (c.selection == SelectionRule::kMaw) r.beta = 0.0f;            // every entry
    if (c.selection == SelectionRule::kPages) r.select_tokens = 4096;  // every page
  }
  return r;
}

// A generation driven through Begin / Step / End, with each token's top log-probabilities.
struct Driven {
  std::unique_ptr<Generation> g;
  std::vector<std::map<int32_t, float>> top;   // per sampled token
  int settling_steps = 0;                      // steps after which its window was settling
};

absl::StatusOr<std::unique_ptr<Driven>> Start(Engine& engine, const GenerateRequest& r) {
  auto d = std::make_unique<Driven>();
  GenerateCallbacks callbacks;
  Driven* raw = d.get();
  callbacks.on_token = [raw](const TokenEvent& e) {
    std::map<int32_t, float> top;
    for (const TokenAlternative& a : e.top_logprobs) top[a.token_id] = a.logprob;
    raw->top.push_back(std::move(top));
    return true;
  };
  auto g = engine.Begin(r, callbacks, Generation::Clock::now());
  if (!g.ok()) return g.status();
  d->g = std::move(*g);
  return d;
}

// Every entry of `seq` is in its window or its tier, once.
void ExpectEveryEntryOnce(const Sequence& seq, const std::string& what) {
  EXPECT_EQ(seq.device_entries() + seq.offloaded_entries(), seq.window.next_position()) << what;
}

// One engine step over the unfinished generations of `active`: 1 token for each decoding one,
// prefill chunks for the others within the step's budget. False when none is left.
bool StepAll(Engine& engine, const std::vector<Driven*>& active) {
  std::vector<Engine::StepItem> items;
  int64_t budget = engine.max_step_tokens();
  for (Driven* d : active) {
    Generation& g = *d->g;
    if (g.finished() || budget <= 0) continue;
    const int64_t n = g.prefilling() ? std::min(budget, g.remaining()) : 1;
    items.push_back({&g, n});
    budget -= n;
  }
  if (items.empty()) return false;
  (void)engine.Step(items);   // failures are recorded in the generations
  for (Driven* d : active) {
    Generation& g = *d->g;
    if (g.seq == nullptr || !g.failure.ok()) continue;
    if (g.first_token_sampled && g.seq->window.settling()) ++d->settling_steps;
  }
  return true;
}

void ExpectSameTokens(const Driven& got, const GenerateSummary& got_summary,
                      const GenerateSummary& want_summary, const Driven& want,
                      const std::string& what) {
  EXPECT_EQ(got_summary.token_ids, want_summary.token_ids) << what;
  ASSERT_EQ(got.top.size(), want.top.size()) << what;
  for (size_t i = 0; i < want.top.size(); ++i) {
    ASSERT_EQ(got.top[i].size(), want.top[i].size()) << what << " token " << i;
    for (const auto& [id, logprob] : want.top[i]) {
      auto it = got.top[i].find(id);
      ASSERT_NE(it, got.top[i].end()) << what << " token " << i << ": " << id << " not in top";
      EXPECT_NEAR(it->second, logprob, kLogprobTolerance) << what << " token " << i << ": " << id;
    }
  }
}

// Runs `r` alone to its end, checking after every step that each entry is held once.
absl::StatusOr<GenerateSummary> RunAlone(Engine& engine, const GenerateRequest& r, Driven* out,
                                         const std::string& what) {
  auto d = Start(engine, r);
  if (!d.ok()) return d.status();
  while (StepAll(engine, {d->get()})) {
    if ((*d)->g->failure.ok()) ExpectEveryEntryOnce(*(*d)->g->seq, what);
  }
  auto summary = engine.End(*(*d)->g);
  *out = std::move(**d);
  return summary;
}

class PromptSettle : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("stories260k");
    TANDEM_SKIP_WITHOUT_BACKEND();
  }
  static v1::StatsResponse NodeStats(Engine& e) { return e.nodes().embedded()->node().Stats(); }
};

// A small ring: a sink of 4, a window of 32 in blocks of 8, chunks of up to 20 positions.
WindowOptions RingOptions() {
  WindowOptions o;
  o.sink = 4;
  o.window = 32;
  o.block = 8;
  o.max_chunk = 20;
  o.max_context = 1024;
  return o;
}

// A settling ring: appends land on free slots only, the blocks a full ring needs leave first
// (oldest first), and a next turn's Widen keeps the pending blocks.
TEST(PromptSettleRing, AppendsIntoFreeSlotsAndWidensWithItsPendingBlocks) {
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no backend: " << why;
  const WindowOptions o = RingOptions();
  auto cache = WindowCache::Create(*backend, {1, 1, 8, DType::kF32}, o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Widen(160).ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(cache->Append(20).ok());   // 160 positions
  ASSERT_TRUE(cache->Narrow().ok());
  ASSERT_TRUE(cache->settling());
  const int64_t pending = static_cast<int64_t>(cache->PendingEvictions().size());
  EXPECT_EQ(pending, (160 - 4 - 32) / 8 + 1);   // 124 recent beyond 32: 16 blocks
  // The widened ring holds 160 + 20 recent slots (rounded to blocks): 24 more tokens fit.
  const int64_t ring = cache->capacity() - 4;
  const int64_t room = ring - (160 - 4);
  EXPECT_TRUE(cache->EvictionsBeforeAppend(room).empty());
  for (int64_t i = 0; i < room; ++i) ASSERT_TRUE(cache->Append(1).ok()) << i;
  // Full: the next token's slot is the oldest pending block's.
  const std::vector<EvictedBlock> need = cache->EvictionsBeforeAppend(1);
  ASSERT_EQ(need.size(), 1u);
  EXPECT_EQ(need[0].first_pos, 4);
  EXPECT_EQ(need[0].count, 8);
  EXPECT_EQ(cache->Append(1).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(cache->Release(need).ok());
  ASSERT_TRUE(cache->Append(1).ok());
  EXPECT_TRUE(cache->settling());
  // A next turn widens with the pending blocks; not below its recent tokens.
  const int64_t recent = cache->recent_tokens();
  EXPECT_EQ(cache->Widen(recent - 8).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(cache->Widen(recent + 40).ok());
  EXPECT_TRUE(cache->widened());
  EXPECT_EQ(cache->recent_tokens(), recent);
  EXPECT_TRUE(cache->PendingEvictions().empty());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(cache->Append(20).ok());
  ASSERT_TRUE(cache->Narrow().ok());
  const std::vector<EvictedBlock> all = cache->PendingEvictions();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.front().first_pos, 4 + 8);   // oldest first: the old turn's blocks lead
  ASSERT_TRUE(cache->Release(all).ok());
  EXPECT_FALSE(cache->relaid());
  EXPECT_EQ(cache->device_bytes(), WindowCache::BytesFor({1, 1, 8, DType::kF32}, o));
}

// TierContext::ReadEvicted hands a sink every layer's evicted K, V and MAW in layer order. A
// host-only sink runs on a thread of its own beside the next layer's read (here with no size
// floor: these groups are a few KiB), and sees the same bytes as one that runs on the caller;
// its failure stops the layers after it. Under the default floor the same small group runs on
// the caller.
TEST(PromptSettleRing, EvictionsReadBesideAHostOnlySinkEqualTheSerialReads) {
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no backend: " << why;
  const WindowOptions o = RingOptions();
  const WindowGeometry geometry{5, 2, 8, DType::kF32};
  auto cache = WindowCache::Create(*backend, geometry, o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(cache->Widen(160).ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(cache->Append(20).ok());
  ASSERT_TRUE(cache->Narrow().ok());
  const std::vector<EvictedBlock> blocks = cache->PendingEvictions();
  ASSERT_FALSE(blocks.empty());
  // Every layer's K, V [heads, capacity, 8] and MAW [heads, capacity] hold distinct values
  // (MAW with negatives, which the read clamps to 0).
  const int64_t cells = geometry.num_kv_heads * cache->capacity();
  for (int64_t l = 0; l < geometry.num_layers; ++l) {
    std::vector<float> k(cells * 8), v(cells * 8), maw(cells);
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(l * 100000 + i);
      v[i] = -k[i];
    }
    for (size_t i = 0; i < maw.size(); ++i) maw[i] = static_cast<float>(i % 7) - 2.0f;
    ASSERT_TRUE(backend->CopyToDevice(cache->k(l), k.data(), k.size() * 4).ok());
    ASSERT_TRUE(backend->CopyToDevice(cache->v(l), v.data(), v.size() * 4).ok());
    ASSERT_TRUE(backend->CopyToDevice(cache->maw(l), maw.data(), maw.size() * 4).ok());
  }
  struct Seen {
    std::vector<float> k, v, maw;
    int64_t tokens = 0, window_entries = 0;
    std::thread::id thread;
  };
  auto read = [&](TierContext::SinkUses uses, int64_t fail_at, absl::Status* status,
                  size_t overlap_min_bytes = 0) {
    TierContext context(*backend, 4, 64, false);
    std::vector<Seen> seen;
    *status = context.ReadEvicted(
        *cache, blocks,
        [&](int64_t layer, const void* k, const void* v, const float* maw, int64_t tokens,
            int64_t window_entries) -> absl::Status {
          EXPECT_EQ(layer, static_cast<int64_t>(seen.size()));
          const size_t n = geometry.num_kv_heads * tokens;
          const float* kf = static_cast<const float*>(k);
          const float* vf = static_cast<const float*>(v);
          seen.push_back({{kf, kf + n * 8}, {vf, vf + n * 8}, {maw, maw + n}, tokens,
                          window_entries, std::this_thread::get_id()});
          if (layer == fail_at) return absl::UnavailableError("node gone");
          return absl::OkStatus();
        },
        uses, overlap_min_bytes);
    return seen;
  };
  absl::Status status;
  const std::vector<Seen> serial = read(TierContext::SinkUses::kBackend, -1, &status);
  ASSERT_TRUE(status.ok()) << status;
  const std::vector<Seen> apart = read(TierContext::SinkUses::kHostOnly, -1, &status);
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(serial.size(), 5u);
  ASSERT_EQ(apart.size(), 5u);
  int64_t total = 0;
  for (const EvictedBlock& b : blocks) total += b.count;
  for (int64_t l = 0; l < 5; ++l) {
    SCOPED_TRACE(l);
    EXPECT_EQ(serial[l].tokens, total);
    EXPECT_EQ(serial[l].thread, std::this_thread::get_id());
    EXPECT_NE(apart[l].thread, std::this_thread::get_id());
    EXPECT_EQ(apart[l].k, serial[l].k);
    EXPECT_EQ(apart[l].v, serial[l].v);
    EXPECT_EQ(apart[l].maw, serial[l].maw);
    EXPECT_EQ(apart[l].tokens, serial[l].tokens);
    EXPECT_EQ(apart[l].window_entries, serial[l].window_entries);
    // The first evicted token of head 0: position 4 in slot 4 of layer l's K.
    EXPECT_EQ(serial[l].k[0], static_cast<float>(l * 100000 + blocks[0].first_slot * 8));
    EXPECT_GE(*std::min_element(serial[l].maw.begin(), serial[l].maw.end()), 0.0f);
  }
  // Under the default floor (256 KiB of K per layer) this group is read and sunk on the caller.
  const std::vector<Seen> small = read(TierContext::SinkUses::kHostOnly, -1, &status,
                                       TierContext::kOverlapMinLayerBytes);
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(small.size(), 5u);
  for (int64_t l = 0; l < 5; ++l) {
    EXPECT_EQ(small[l].thread, std::this_thread::get_id());
    EXPECT_EQ(small[l].k, serial[l].k);
  }
  // A failing sink: its error comes back, and no layer after it is handed over.
  const std::vector<Seen> failed = read(TierContext::SinkUses::kHostOnly, 2, &status);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(failed.size(), 3u);
}

// The runner's side, offload mode: three sequences get the same prompt and decode tokens: one
// with every entry on the device (gpu mode), one settled at once after the prompt, one settled
// a block (16 tokens) per decode step. Their logits agree within 1e-4 at every step.
class PromptSettleRunner : public testing::Stories260kRunnerTest {
 protected:
  std::unique_ptr<Sequence> NewSequence(const std::string& id, int64_t window) {
    const ModelConfig& c = model_->config;
    WindowOptions wo;
    wo.block = 16;
    wo.max_chunk = 512;
    wo.max_context = c.max_position_embeddings;
    wo.window = window;
    wo.sink = kSink;
    const WindowGeometry geometry{c.num_layers, c.num_kv_heads, c.head_dim, DType::kF32};
    auto cache = WindowCache::Create(*backend_, geometry, wo);
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return nullptr;
    const AttentionMode mode =
        window == WindowOptions::kUnlimited ? AttentionMode::kGpu : AttentionMode::kOffload;
    auto seq = std::make_unique<Sequence>(id, mode, std::move(*cache));
    if (mode == AttentionMode::kOffload) {
      auto kv = OffloadedKv::Create(*backend_, geometry, 16);
      EXPECT_TRUE(kv.ok()) << kv.status();
      if (!kv.ok()) return nullptr;
      seq->offload = std::make_unique<HostTier>(std::move(*kv));
    }
    return seq;
  }
};

TEST_F(PromptSettleRunner, DecodeWhileSettlingEqualsTheWholeSettleAndGpuMode) {
  std::unique_ptr<Sequence> gpu = NewSequence("gpu", WindowOptions::kUnlimited);
  std::unique_ptr<Sequence> whole = NewSequence("whole", kWindow);
  std::unique_ptr<Sequence> sliced = NewSequence("sliced", kWindow);
  ASSERT_TRUE(gpu && whole && sliced);
  const std::vector<int32_t> prompt = testing::SyntheticPrompt(kPrompt, 17);
  for (Sequence* seq : {whole.get(), sliced.get()}) {
    seq->prefill_end = kPrompt;
    ASSERT_TRUE(seq->window.Widen(kPrompt).ok());
  }
  std::vector<float> want = Step(*gpu, prompt);
  for (Sequence* seq : {whole.get(), sliced.get()}) {
    const std::vector<float> got = Step(*seq, prompt);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], kLogprobTolerance);
    EXPECT_TRUE(seq->window.settling());
    EXPECT_EQ(seq->offloaded_entries(), 0);
  }
  ASSERT_TRUE(runner_->SettleEvictions(*whole).ok());
  EXPECT_FALSE(whole->window.relaid());
  int settling_steps = 0;
  for (int step = 0; step < 24; ++step) {
    const int32_t token = 3 + (step * 53) % 500;
    want = Step(*gpu, {token});
    for (Sequence* seq : {whole.get(), sliced.get()}) {
      const std::vector<float> got = Step(*seq, {token});
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], kLogprobTolerance) << seq->id << " step " << step;
      }
      ExpectEveryEntryOnce(*seq, seq->id);
    }
    auto moved = runner_->SettleSlice(*sliced, kSlice);
    ASSERT_TRUE(moved.ok()) << moved.status();
    if (sliced->window.settling()) {
      EXPECT_EQ(*moved, kSlice);
      ++settling_steps;
    }
  }
  EXPECT_GE(settling_steps, 10);
  EXPECT_FALSE(sliced->window.relaid());
  EXPECT_EQ(sliced->offloaded_entries(), whole->offloaded_entries());
}

TEST_F(PromptSettle, DecodeWhileSettlingEqualsTheWholeSettleAndGpuMode) {
  std::unique_ptr<Engine> sliced = MakeEngine(kSlice);
  std::unique_ptr<Engine> whole = MakeEngine(0);
  ASSERT_NE(sliced, nullptr);
  ASSERT_NE(whole, nullptr);
  const std::vector<int32_t> prompt = testing::SyntheticPrompt(kPrompt, 13);
  constexpr int kTokens = 24;
  Driven gpu;
  auto reference = RunAlone(*whole, Request({"gpu", AttentionMode::kGpu, SelectionRule::kMaw},
                                            prompt, kTokens),
                            &gpu, "gpu");
  ASSERT_TRUE(reference.ok()) << reference.status();
  for (const Case& c : {Case{"offload", AttentionMode::kOffload, SelectionRule::kMaw},
                        Case{"exact", AttentionMode::kExact, SelectionRule::kMaw},
                        Case{"hybrid maw beta 0", AttentionMode::kHybrid, SelectionRule::kMaw},
                        Case{"hybrid pages all", AttentionMode::kHybrid, SelectionRule::kPages}}) {
    const GenerateRequest r = Request(c, prompt, kTokens);
    Driven a, b;
    auto at_once = RunAlone(*whole, r, &b, std::string(c.name) + ", whole settle");
    ASSERT_TRUE(at_once.ok()) << c.name << ": " << at_once.status();
    EXPECT_EQ(b.settling_steps, 0) << c.name;
    auto in_slices = RunAlone(*sliced, r, &a, std::string(c.name) + ", sliced settle");
    ASSERT_TRUE(in_slices.ok()) << c.name << ": " << in_slices.status();
    // ~280 tokens beyond the window, 16 a step: the settle spans most of the decode steps.
    EXPECT_GE(a.settling_steps, 10) << c.name;
    EXPECT_LT(a.settling_steps, kTokens - 1) << c.name;   // and ends within them
    ExpectSameTokens(a, *in_slices, *at_once, b, std::string(c.name) + " vs whole settle");
    ExpectSameTokens(a, *in_slices, *reference, gpu, std::string(c.name) + " vs gpu");
    EXPECT_EQ(in_slices->device_kv_entries + in_slices->cpu_kv_entries, kPrompt + kTokens - 1);
  }
  EXPECT_EQ(NodeStats(*sliced).sessions(), 0u);
  EXPECT_EQ(sliced->DeviceKvBytes(), 0u);
}

// A long prompt's settle and a short request at once: the short one's steps go on while the
// long one settles; the long one's session ends mid-settle (kept: the other's steps settle it)
// and its next turn, begun before the settle is over, still equals gpu mode.
TEST_F(PromptSettle, OtherRequestsStepWhileAPromptSettles) {
  std::unique_ptr<Engine> engine = MakeEngine(kSlice);
  ASSERT_NE(engine, nullptr);
  const Case offload{"offload", AttentionMode::kOffload, SelectionRule::kMaw};
  const Case gpu_mode{"gpu", AttentionMode::kGpu, SelectionRule::kMaw};
  const std::vector<int32_t> prompt = testing::SyntheticPrompt(kPrompt, 29);
  const std::vector<int32_t> next_turn = {403, 407};
  // gpu mode's two turns: the reference.
  GenerateRequest ref = Request(gpu_mode, prompt, 4);
  ref.session_id = "ref";
  Driven ref1, ref2;
  auto want1 = RunAlone(*engine, ref, &ref1, "gpu turn 1");
  ASSERT_TRUE(want1.ok()) << want1.status();
  ref.prompt_ids = next_turn;
  ref.max_tokens = 6;
  auto want2 = RunAlone(*engine, ref, &ref2, "gpu turn 2");
  ASSERT_TRUE(want2.ok()) << want2.status();
  ASSERT_TRUE(engine->CloseSession("ref").ok());

  GenerateRequest long_request = Request(offload, prompt, 4);
  long_request.session_id = "long";
  auto a = Start(*engine, long_request);
  ASSERT_TRUE(a.ok()) << a.status();
  Sequence* long_seq = (*a)->g->seq;
  while (!(*a)->g->first_token_sampled) ASSERT_TRUE(StepAll(*engine, {a->get()}));
  ASSERT_TRUE(long_seq->window.settling());
  auto b = Start(*engine, Request(offload, testing::SyntheticPrompt(20, 3), 60));
  ASSERT_TRUE(b.ok()) << b.status();
  int64_t short_tokens_while_settling = 0;
  while (!(*a)->g->finished()) {
    const int64_t before = (*b)->g->summary.completion_tokens;
    const bool settling = long_seq->window.settling();
    ASSERT_TRUE(StepAll(*engine, {a->get(), b->get()}));
    if (settling) short_tokens_while_settling += (*b)->g->summary.completion_tokens - before;
    ExpectEveryEntryOnce(*long_seq, "long, turn 1");
  }
  auto got1 = engine->End(*(*a)->g);
  ASSERT_TRUE(got1.ok()) << got1.status();
  ExpectSameTokens(**a, *got1, *want1, ref1, "turn 1");
  EXPECT_GT(short_tokens_while_settling, 0);
  // Ended mid-settle with another request running: kept, still settling; its next turn begins
  // with the pending blocks in the window.
  ASSERT_TRUE(long_seq->window.settling());
  GenerateRequest turn2 = long_request;
  turn2.prompt_ids = next_turn;
  turn2.max_tokens = 6;
  auto a2 = Start(*engine, turn2);
  ASSERT_TRUE(a2.ok()) << a2.status();
  while (!(*a2)->g->finished()) {
    ASSERT_TRUE(StepAll(*engine, {a2->get(), b->get()}));
    ExpectEveryEntryOnce(*long_seq, "long, turn 2");
  }
  auto got2 = engine->End(*(*a2)->g);
  ASSERT_TRUE(got2.ok()) << got2.status();
  ExpectSameTokens(**a2, *got2, *want2, ref2, "turn 2");
  // Idle now; the short request's steps settle the rest.
  int steps = 0;
  while (long_seq->window.relaid() && !(*b)->g->finished()) {
    ASSERT_TRUE(StepAll(*engine, {b->get()}));
    ++steps;
    ExpectEveryEntryOnce(*long_seq, "long, idle");
  }
  EXPECT_FALSE(long_seq->window.relaid()) << "after " << steps << " steps of the other request";
  EXPECT_GT(steps, 0);
  while (StepAll(*engine, {b->get()})) {
  }
  auto short_summary = engine->End(*(*b)->g);
  ASSERT_TRUE(short_summary.ok()) << short_summary.status();
  EXPECT_EQ(short_summary->completion_tokens, 60);
  ASSERT_TRUE(engine->CloseSession("long").ok());
  EXPECT_EQ(engine->DeviceKvBytes(), 0u);
}

// With settle_shares_prefill_budget, a prompt chunk of 48 tokens beside a settling request leaves
// 64 - 48 = 16 tokens (one block) of the 64-token budget to its settle; without it, or in the
// decode-only step after, the settle moves 64.
TEST_F(PromptSettle, AStepWithAPromptChunkSettlesWhatTheChunkLeaves) {
  constexpr int64_t kBudget = 64, kShortPrompt = 48;
  const Case offload{"offload", AttentionMode::kOffload, SelectionRule::kMaw};
  for (bool shares : {false, true}) {
    SCOPED_TRACE(shares ? "shares the budget" : "a whole slice");
    std::unique_ptr<Engine> engine = MakeEngine(kBudget, shares);
    ASSERT_NE(engine, nullptr);
    auto a = Start(*engine, Request(offload, testing::SyntheticPrompt(kPrompt, 31), 8));
    ASSERT_TRUE(a.ok()) << a.status();
    const Sequence& settling = *(*a)->g->seq;
    while (!(*a)->g->first_token_sampled) ASSERT_TRUE(StepAll(*engine, {a->get()}));
    ASSERT_TRUE(settling.window.settling());
    auto b = Start(*engine, Request(offload, testing::SyntheticPrompt(kShortPrompt, 5), 4));
    ASSERT_TRUE(b.ok()) << b.status();
    int64_t before = settling.offloaded_entries();
    ASSERT_TRUE(StepAll(*engine, {a->get(), b->get()}));   // a decodes, b's whole prompt
    ASSERT_TRUE((*b)->g->first_token_sampled);
    EXPECT_EQ(settling.offloaded_entries() - before, shares ? kBudget - kShortPrompt : kBudget);
    before = settling.offloaded_entries();
    ASSERT_TRUE(StepAll(*engine, {a->get(), b->get()}));   // both decode
    EXPECT_EQ(settling.offloaded_entries() - before, kBudget);
    while (StepAll(*engine, {a->get(), b->get()})) {
    }
    for (auto* d : {a->get(), b->get()}) {
      auto summary = engine->End(*d->g);
      ASSERT_TRUE(summary.ok()) << summary.status();
    }
  }
}

// A kept session that ends mid-settle beside another request settles a slice per step of that
// request; when the last running request ends, what is left settles at once (nothing steps).
TEST_F(PromptSettle, AnIdleSessionSettlesASliceAtATimeWhenNothingRuns) {
  std::unique_ptr<Engine> engine = MakeEngine(kSlice);
  ASSERT_NE(engine, nullptr);
  const Case offload{"offload", AttentionMode::kOffload, SelectionRule::kMaw};
  GenerateRequest long_request = Request(offload, testing::SyntheticPrompt(kPrompt, 37), 2);
  long_request.session_id = "idle";
  auto a = Start(*engine, long_request);
  ASSERT_TRUE(a.ok()) << a.status();
  Sequence* seq = (*a)->g->seq;
  while (!(*a)->g->first_token_sampled) ASSERT_TRUE(StepAll(*engine, {a->get()}));
  auto b = Start(*engine, Request(offload, testing::SyntheticPrompt(12, 9), 3));
  ASSERT_TRUE(b.ok()) << b.status();
  while (!(*a)->g->finished()) ASSERT_TRUE(StepAll(*engine, {a->get(), b->get()}));
  ASSERT_TRUE(engine->End(*(*a)->g).ok());
  ASSERT_TRUE(seq->window.settling());
  const int64_t offloaded = seq->offloaded_entries();
  ASSERT_TRUE(StepAll(*engine, {b->get()}));
  EXPECT_EQ(seq->offloaded_entries(), offloaded + kSlice);   // a slice in the other's step
  while (StepAll(*engine, {b->get()})) {
  }
  ASSERT_TRUE(seq->window.settling());
  const size_t kv_before = engine->DeviceKvBytes();
  ASSERT_TRUE(engine->End(*(*b)->g).ok());
  // End does not settle (the reply would wait): with nothing running, the scheduler's
  // SettleIdle moves a slice at a time.
  ASSERT_TRUE(engine->IdleSettlePending());
  const int64_t before_idle = seq->offloaded_entries();
  engine->SettleIdle();
  EXPECT_EQ(seq->offloaded_entries(), before_idle + kSlice);
  int slices = 1;
  while (engine->IdleSettlePending()) {
    engine->SettleIdle();
    ASSERT_LT(++slices, 1000);
  }
  EXPECT_FALSE(seq->window.relaid());
  ExpectEveryEntryOnce(*seq, "idle, after the last request");
  EXPECT_LT(engine->DeviceKvBytes(), kv_before);
  ASSERT_TRUE(engine->CloseSession("idle").ok());
}

// Cancelled mid-settle (a one-shot hybrid request): its window, tier and node session go.
TEST_F(PromptSettle, CancelledMidSettleReleasesEverything) {
  std::unique_ptr<Engine> engine = MakeEngine(kSlice);
  ASSERT_NE(engine, nullptr);
  GenerateRequest r = Request({"hybrid", AttentionMode::kHybrid, SelectionRule::kMaw},
                              testing::SyntheticPrompt(kPrompt, 41), 40);
  r.beta = 1.0f;   // a real selection
  auto a = Start(*engine, r);
  ASSERT_TRUE(a.ok()) << a.status();
  while ((*a)->g->summary.completion_tokens < 3) ASSERT_TRUE(StepAll(*engine, {a->get()}));
  ASSERT_TRUE((*a)->g->seq->window.settling());
  EXPECT_GT((*a)->g->seq->offloaded_entries(), 0);
  EXPECT_GT(NodeStats(*engine).blocks_in_use(), 0u);
  auto summary = engine->End(*(*a)->g);   // not finished: cancelled
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(engine->open_sessions(), 0u);
  EXPECT_EQ(engine->DeviceKvBytes(), 0u);
  EXPECT_EQ(NodeStats(*engine).sessions(), 0u);
  EXPECT_EQ(NodeStats(*engine).blocks_in_use(), 0u);
}

// The tier of one request loses its host pages (Append fails): a test decorator over the
// engine's real tier, failing every Append.
class AppendFails : public OffloadTier {
 public:
  explicit AppendFails(std::unique_ptr<OffloadTier> inner) : inner_(std::move(inner)) {}
  int64_t offloaded_tokens() const override { return inner_->offloaded_tokens(); }
  bool wants_maw() const override { return inner_->wants_maw(); }
  double off_device_work() const override { return inner_->off_device_work(); }
  TierFootprint footprint() const override { return inner_->footprint(); }
  absl::Status BeginPass(TierContext& context, size_t stream) override {
    return inner_->BeginPass(context, stream);
  }
  absl::Status PrepareAttend(TierContext& context, const AttendRows& rows) override {
    return inner_->PrepareAttend(context, rows);
  }
  absl::Status StartAttend(TierContext& context, const AttendRows& rows) override {
    return inner_->StartAttend(context, rows);
  }
  absl::StatusOr<bool> FinishAttend(TierContext& context, const AttendRows& rows) override {
    return inner_->FinishAttend(context, rows);
  }
  void CancelAttend(TierContext& context, const AttendRows& rows) override {
    inner_->CancelAttend(context, rows);
  }
  absl::Status Append(TierContext&, WindowCache&, const std::vector<EvictedBlock>&) override {
    return absl::DataLossError("host pages lost (injected by the test)");
  }
  absl::Status Reserve(int64_t tokens) override { return inner_->Reserve(tokens); }
  absl::Status Maintain() override { return inner_->Maintain(); }
  absl::Status Close() override { return inner_->Close(); }
  std::vector<double> MeanSelectedShare() const override { return inner_->MeanSelectedShare(); }

 private:
  std::unique_ptr<OffloadTier> inner_;
};

TEST_F(PromptSettle, ASettleFailureFailsOnlyItsRequest) {
  std::unique_ptr<Engine> engine = MakeEngine(kSlice);
  ASSERT_NE(engine, nullptr);
  const Case offload{"offload", AttentionMode::kOffload, SelectionRule::kMaw};
  const GenerateRequest short_request = Request(offload, testing::SyntheticPrompt(20, 7), 12);
  Driven solo;
  auto want = RunAlone(*engine, short_request, &solo, "short, alone");
  ASSERT_TRUE(want.ok()) << want.status();

  GenerateRequest long_request = Request(offload, testing::SyntheticPrompt(kPrompt, 5), 8);
  long_request.session_id = "failing";
  auto a = Start(*engine, long_request);
  ASSERT_TRUE(a.ok()) << a.status();
  Sequence& seq = *(*a)->g->seq;
  seq.offload = std::make_unique<AppendFails>(std::move(seq.offload));
  auto b = Start(*engine, short_request);
  ASSERT_TRUE(b.ok()) << b.status();
  while (StepAll(*engine, {a->get(), b->get()})) {
  }
  EXPECT_EQ((*a)->g->failure.code(), absl::StatusCode::kDataLoss) << (*a)->g->failure;
  EXPECT_EQ((*a)->g->summary.completion_tokens, 1);   // its first token, then the settle
  auto failed = engine->End(*(*a)->g);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  auto got = engine->End(*(*b)->g);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameTokens(**b, *got, *want, solo, "short, beside a failing settle");
  EXPECT_EQ(engine->open_sessions(), 0u);   // the failed session is closed
  EXPECT_EQ(engine->DeviceKvBytes(), 0u);
  EXPECT_TRUE(engine->Generate(short_request).ok());   // still serving
}

}  // namespace
}  // namespace tandem::gpu_worker
