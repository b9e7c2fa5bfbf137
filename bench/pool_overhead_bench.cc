// tandem-pool-bench: memory overhead of the paged KV block pool (the FMS paper's < 5% claim).
//
// Simulates a CPU attention node holding mixed-length sessions: lengths drawn log-uniformly
// from [--min_tokens, --max_tokens], each session owning --shards_per_session random
// (layer, kv-head) shards of the geometry (the planner spreads a session's shards over nodes,
// so one node holds a few per session). KV arrives the way the GPU worker sends it: one odd
// sized prefill chunk, then eviction chunks of --evict_tokens with an occasional new-turn
// prefill chunk. Halfway a random third of the sessions closes and as many new ones open, so
// freed blocks are reused. The same workload (same --seed) is replayed for every block size.
//
// Per block size it prints one JSON line, then a table:
//   stored      = held entries x entry_bytes (K row + V row + MAW), the payload
//   blocks      = bytes of blocks in use; overhead = blocks / stored - 1 (tail of each shard's
//                 last block plus 64-byte block rounding)
//   touched     = blocks ever handed out x block_bytes (the pool's physical high-water mark);
//                 compared against the peak of stored over the run
//   selected    = capacity of the contiguous selected copies (beta > 0), reported separately:
//                 it is the salience index, not pool overhead
//
// Flags: --sessions N --seed S --max_tokens T --min_tokens T --shards_per_session K
//        --evict_tokens E --beta B --window W
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "parse_flags.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/common/bf16.h"
#include "tandem/kv_store/kv_store.h"

ABSL_FLAG(uint32_t, sessions, 200, "live sessions");
ABSL_FLAG(uint64_t, seed, 1, "random seed (the same workload is replayed per block size)");
ABSL_FLAG(uint32_t, min_tokens, 1024, "shortest session, tokens per shard");
ABSL_FLAG(uint32_t, max_tokens, 128 * 1024, "longest session, tokens per shard");
ABSL_FLAG(uint32_t, shards_per_session, 2, "(layer, kv-head) shards each session holds here");
ABSL_FLAG(uint32_t, evict_tokens, 64, "tokens per eviction chunk");
ABSL_FLAG(float, beta, 1.0f, "selection threshold");
ABSL_FLAG(uint32_t, window, 1024, "GPU window the MAW values refer to");

namespace tandem::kv_store {
namespace {

struct Flags {
  uint32_t sessions = 200;
  uint64_t seed = 1;
  uint32_t min_tokens = 1024;
  uint32_t max_tokens = 128 * 1024;
  uint32_t shards_per_session = 2;
  uint32_t evict_tokens = 64;
  float beta = 1.0f;
  uint32_t window = 1024;
  // Geometry of the model (a Llama-3-8B-like layout, 4 layers to keep the run short; only
  // shards_per_session of its layers x kv_heads shards live on this node per session).
  uint32_t layers = 4;
  uint32_t kv_heads = 8;
  uint32_t head_dim = 128;
};

// Reads the command-line flags; false (with a message) for an inconsistent set.
bool ReadFlags(Flags& flags) {
  flags.sessions = absl::GetFlag(FLAGS_sessions);
  flags.seed = absl::GetFlag(FLAGS_seed);
  flags.min_tokens = absl::GetFlag(FLAGS_min_tokens);
  flags.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  flags.shards_per_session = absl::GetFlag(FLAGS_shards_per_session);
  flags.evict_tokens = absl::GetFlag(FLAGS_evict_tokens);
  flags.beta = absl::GetFlag(FLAGS_beta);
  flags.window = absl::GetFlag(FLAGS_window);
  if (flags.sessions == 0 || flags.min_tokens == 0 || flags.max_tokens < flags.min_tokens ||
      flags.evict_tokens == 0 || flags.evict_tokens > 65536 || flags.window == 0 ||
      !(flags.beta >= 0) || flags.shards_per_session == 0 ||
      flags.shards_per_session > flags.layers * flags.kv_heads) {
    std::fprintf(stderr, "inconsistent flags\n");
    return false;
  }
  return true;
}

// One session of the workload: its shards and the chunk sizes it receives, in order.
struct SessionPlan {
  std::string id;
  std::vector<ShardKey> shards;
  std::vector<uint32_t> chunks;  // sum = the session's length
  uint64_t length = 0;
};

constexpr uint32_t kMaxPrefillChunk = 8192;
constexpr uint32_t kMaxTurnChunk = 4096;
constexpr double kTurnProbability = 0.05;

SessionPlan MakePlan(const Flags& flags, uint32_t index, std::mt19937_64& rng) {
  SessionPlan plan;
  plan.id = absl::StrCat("session-", index);
  std::uniform_real_distribution<double> log_len(std::log(flags.min_tokens),
                                                 std::log(flags.max_tokens));
  plan.length = static_cast<uint64_t>(std::llround(std::exp(log_len(rng))));
  std::vector<ShardKey> all;
  for (uint32_t l = 0; l < flags.layers; ++l) {
    for (uint32_t h = 0; h < flags.kv_heads; ++h) all.push_back({l, h});
  }
  std::shuffle(all.begin(), all.end(), rng);
  plan.shards.assign(all.begin(), all.begin() + flags.shards_per_session);

  uint64_t left = plan.length;
  auto take = [&](uint64_t n) {
    n = std::min(n, left);
    plan.chunks.push_back(static_cast<uint32_t>(n));
    left -= n;
  };
  take(std::uniform_int_distribution<uint32_t>(1, kMaxPrefillChunk)(rng));
  std::bernoulli_distribution new_turn(kTurnProbability);
  std::uniform_int_distribution<uint32_t> turn_len(1, kMaxTurnChunk);
  while (left > 0) take(new_turn(rng) ? turn_len(rng) : flags.evict_tokens);
  return plan;
}

struct Workload {
  std::vector<SessionPlan> initial;       // opened at the start
  std::vector<uint32_t> closed_midway;    // indices into initial
  std::vector<SessionPlan> replacements;  // opened after the closes
};

Workload MakeWorkload(const Flags& flags) {
  std::mt19937_64 rng(flags.seed);
  Workload w;
  for (uint32_t i = 0; i < flags.sessions; ++i) w.initial.push_back(MakePlan(flags, i, rng));
  std::vector<uint32_t> order(flags.sessions);
  for (uint32_t i = 0; i < flags.sessions; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  order.resize(flags.sessions / 3);
  w.closed_midway = order;
  for (uint32_t i = 0; i < order.size(); ++i) {
    w.replacements.push_back(MakePlan(flags, flags.sessions + i, rng));
  }
  return w;
}

struct Result {
  uint32_t block_tokens = 0;
  uint64_t block_bytes = 0;
  uint64_t sessions_opened = 0;
  uint64_t sessions_live = 0;
  uint64_t stored_bytes = 0;
  uint64_t block_bytes_in_use = 0;
  uint64_t peak_stored_bytes = 0;
  uint64_t peak_block_bytes_in_use = 0;
  uint64_t touched_bytes = 0;
  uint64_t selected_bytes = 0;
  uint64_t selected_entries = 0;
  uint64_t appended_entries = 0;
  double seconds = 0;

  double overhead_pct() const { return Pct(block_bytes_in_use, stored_bytes); }
  double touched_overhead_pct() const { return Pct(touched_bytes, peak_stored_bytes); }
  static double Pct(uint64_t a, uint64_t b) {
    return b == 0 ? 0.0 : 100.0 * (static_cast<double>(a) / static_cast<double>(b) - 1.0);
  }
};

// Source data shared by every append: K and V [kv_heads, max_chunk, head_dim] bf16 in a cheap
// pattern, and a pool of MAW values (log-normal around threshold / 4, so roughly 8% exceed
// beta / window) read at a rotating offset.
struct Source {
  std::vector<std::byte> k, v;
  std::vector<float> maw;
  size_t maw_offset = 0;
};

Source MakeSource(const Flags& flags, uint32_t max_chunk) {
  Source s;
  const size_t elems = size_t{flags.kv_heads} * max_chunk * flags.head_dim;
  std::vector<bf16_t> k(elems), v(elems);
  for (size_t i = 0; i < elems; ++i) {
    k[i] = FloatToBf16(static_cast<float>(i % 251) * 0.01f - 1.0f);
    v[i] = FloatToBf16(static_cast<float>(i % 241) * -0.01f + 1.0f);
  }
  s.k.resize(elems * sizeof(bf16_t));
  s.v.resize(elems * sizeof(bf16_t));
  std::memcpy(s.k.data(), k.data(), s.k.size());
  std::memcpy(s.v.data(), v.data(), s.v.size());
  std::mt19937_64 rng(12345);
  const double threshold = flags.beta / flags.window;
  std::lognormal_distribution<float> dist(
      static_cast<float>(std::log(threshold > 0 ? threshold / 4 : 1e-4)), 1.0f);
  s.maw.resize((size_t{1} << 20) + size_t{flags.kv_heads} * max_chunk);
  for (float& m : s.maw) m = dist(rng);
  return s;
}

class Replay {
 public:
  Replay(const Flags& flags, uint32_t block_tokens, Source& source)
      : flags_(flags), block_tokens_(block_tokens), source_(source) {
    KvStore::Options options;
    options.capacity_bytes = uint64_t{64} << 30;  // budget only; pages cost when written
    options.default_block_tokens = block_tokens;
    options.max_sessions = 1 << 16;
    store_ = std::make_unique<KvStore>(options);
  }

  // Returns false (after printing why) on an unexpected store error.
  bool Run(const Workload& w, Result& r) {
    const auto start = std::chrono::steady_clock::now();
    r.block_tokens = block_tokens_;
    source_.maw_offset = 0;  // every block size sees the same MAW sequence
    for (const SessionPlan& plan : w.initial) {
      if (!Open(plan)) return false;
    }
    // Phase 1: every initial session up to about half its length.
    if (!RoundRobin(/*half=*/true)) return false;
    for (uint32_t index : w.closed_midway) {
      auto closed = store_->CloseSession(w.initial[index].id);
      if (!closed.ok()) return Fail(closed.status());
      stored_ -= live_.at(w.initial[index].id).held * live_.at(w.initial[index].id).shard_bytes;
      live_.erase(w.initial[index].id);
    }
    for (const SessionPlan& plan : w.replacements) {
      if (!Open(plan)) return false;
    }
    // Phase 2: everyone to the end of its plan.
    if (!RoundRobin(/*half=*/false)) return false;

    const StoreStats stats = store_->Stats();
    if (stats.stored_bytes != stored_) {
      std::fprintf(stderr, "stored bytes mismatch: store %llu, bench %llu\n",
                   static_cast<unsigned long long>(stats.stored_bytes),
                   static_cast<unsigned long long>(stored_));
      return false;
    }
    r.block_bytes = live_.empty() ? 0 : live_.begin()->second.session->format().block_bytes();
    r.sessions_opened = w.initial.size() + w.replacements.size();
    r.sessions_live = stats.sessions;
    r.stored_bytes = stats.stored_bytes;
    r.block_bytes_in_use = stats.block_bytes_in_use;
    r.selected_bytes = stats.selected_bytes;
    r.peak_stored_bytes = peak_stored_;
    r.peak_block_bytes_in_use = peak_block_bytes_;
    r.touched_bytes =
        pool_ == nullptr ? 0 : pool_->blocks_touched() * pool_->format().block_bytes();
    r.selected_entries = selected_entries_;
    r.appended_entries = appended_entries_;

    // Closing everything must return every block and byte.
    for (const auto& [id, live] : live_) {
      if (auto closed = store_->CloseSession(id); !closed.ok()) return Fail(closed.status());
    }
    const StoreStats empty = store_->Stats();
    if (empty.blocks_in_use != 0 || empty.used_bytes != 0) {
      std::fprintf(stderr, "leak after closing every session: %llu blocks, %llu bytes\n",
                   static_cast<unsigned long long>(empty.blocks_in_use),
                   static_cast<unsigned long long>(empty.used_bytes));
      return false;
    }
    store_.reset();  // unmaps the pool before the next block size
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return true;
  }

 private:
  struct Live {
    std::shared_ptr<Session> session;
    const SessionPlan* plan = nullptr;
    size_t next_chunk = 0;
    uint64_t held = 0;         // entries per shard
    uint64_t shard_bytes = 0;  // entry_bytes x number of shards
    std::map<uint32_t, std::vector<uint32_t>> heads_by_layer;
  };

  bool Fail(const absl::Status& s) {
    std::fprintf(stderr, "block_tokens %u: %s\n", block_tokens_, std::string(s.message()).c_str());
    return false;
  }

  bool Open(const SessionPlan& plan) {
    SessionOptions options;
    options.geometry =
        Geometry{flags_.layers, flags_.kv_heads * 4, flags_.kv_heads, flags_.head_dim};
    options.block_tokens = 0;  // the store's default: the block size under test
    options.dtype = KvDType::kBf16;
    options.beta = flags_.beta;
    options.shards = plan.shards;
    auto session = store_->OpenSession(plan.id, options);
    if (!session.ok()) return Fail(session.status());
    Live live;
    live.session = *session;
    live.plan = &plan;
    live.shard_bytes = (*session)->format().entry_bytes() * plan.shards.size();
    for (const ShardKey& key : plan.shards) live.heads_by_layer[key.layer].push_back(key.kv_head);
    if (pool_ == nullptr)
      pool_ = (*session)->shard(plan.shards[0].layer, plan.shards[0].kv_head)->pool();
    live_.emplace(plan.id, std::move(live));
    return true;
  }

  // One chunk per session per round, in id order, until no session has a chunk left (or, with
  // `half`, until each has reached half its length).
  bool RoundRobin(bool half) {
    for (bool progressed = true; progressed;) {
      progressed = false;
      for (auto& [id, live] : live_) {
        if (live.next_chunk >= live.plan->chunks.size()) continue;
        if (half && 2 * live.held >= live.plan->length) continue;
        if (!AppendChunk(live)) return false;
        progressed = true;
      }
      peak_stored_ = std::max(peak_stored_, stored_);
      if (pool_ != nullptr) {
        peak_block_bytes_ =
            std::max(peak_block_bytes_, pool_->blocks_in_use() * pool_->format().block_bytes());
      }
    }
    return true;
  }

  bool AppendChunk(Live& live) {
    const uint32_t n = live.plan->chunks[live.next_chunk++];
    for (const auto& [layer, heads] : live.heads_by_layer) {
      const size_t values = heads.size() * size_t{n};
      if (source_.maw_offset + values > source_.maw.size()) source_.maw_offset = 0;
      auto stats = store_->Append(*live.session, layer, heads, source_.k.data(), source_.v.data(),
                                  source_.maw.data() + source_.maw_offset, n, flags_.window);
      if (!stats.ok()) return Fail(stats.status());
      source_.maw_offset += values;
      selected_entries_ += stats->entries_selected;
      appended_entries_ += stats->entries_appended;
    }
    live.held += n;
    stored_ += n * live.shard_bytes;
    return true;
  }

  const Flags& flags_;
  const uint32_t block_tokens_;
  Source& source_;
  std::unique_ptr<KvStore> store_;
  const BlockPool* pool_ = nullptr;  // the one pool: every session has the same format
  std::map<std::string, Live> live_;
  uint64_t stored_ = 0;
  uint64_t peak_stored_ = 0;
  uint64_t peak_block_bytes_ = 0;
  uint64_t selected_entries_ = 0;
  uint64_t appended_entries_ = 0;
};

double MiB(uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace
}  // namespace tandem::kv_store

int main(int argc, char** argv) {
  using namespace tandem::kv_store;
  Flags flags;
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  if (!ReadFlags(flags)) return 2;
  const Workload workload = MakeWorkload(flags);
  uint32_t max_chunk = flags.evict_tokens;
  for (const auto* plans : {&workload.initial, &workload.replacements}) {
    for (const SessionPlan& p : *plans) {
      for (uint32_t c : p.chunks) max_chunk = std::max(max_chunk, c);
    }
  }
  Source source = MakeSource(flags, max_chunk);

  std::vector<Result> results;
  for (uint32_t block_tokens : {16u, 32u, 64u, 128u, 256u}) {
    Result r;
    Replay replay(flags, block_tokens, source);
    if (!replay.Run(workload, r)) return 1;
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    nlohmann::json j = {
        {"bench", "pool_overhead"},
        {"block_tokens", r.block_tokens},
        {"block_bytes", r.block_bytes},
        {"sessions", flags.sessions},
        {"seed", flags.seed},
        {"min_tokens", flags.min_tokens},
        {"max_tokens", flags.max_tokens},
        {"shards_per_session", flags.shards_per_session},
        {"sessions_opened", r.sessions_opened},
        {"sessions_live", r.sessions_live},
        {"stored_bytes", r.stored_bytes},
        {"block_bytes_in_use", r.block_bytes_in_use},
        {"overhead_pct", r.overhead_pct()},
        {"peak_stored_bytes", r.peak_stored_bytes},
        {"peak_block_bytes_in_use", r.peak_block_bytes_in_use},
        {"touched_bytes", r.touched_bytes},
        {"touched_overhead_pct", r.touched_overhead_pct()},
        {"selected_bytes", r.selected_bytes},
        {"selected_entry_pct", r.appended_entries == 0
                                   ? 0.0
                                   : 100.0 * static_cast<double>(r.selected_entries) /
                                         static_cast<double>(r.appended_entries)},
        {"max_rss_mib", static_cast<double>(usage.ru_maxrss) / 1024.0},
        {"seconds", r.seconds},
    };
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
    results.push_back(r);
  }

  std::printf("\n%-6s %12s %12s %9s %12s %12s %9s %12s %8s\n", "block", "stored MiB", "blocks MiB",
              "overhead", "peak MiB", "touched MiB", "touched", "selected MiB", "seconds");
  for (const Result& r : results) {
    std::printf("%-6u %12.1f %12.1f %8.2f%% %12.1f %12.1f %8.2f%% %12.1f %8.2f\n", r.block_tokens,
                MiB(r.stored_bytes), MiB(r.block_bytes_in_use), r.overhead_pct(),
                MiB(r.peak_stored_bytes), MiB(r.touched_bytes), r.touched_overhead_pct(),
                MiB(r.selected_bytes), r.seconds);
  }
  return 0;
}
