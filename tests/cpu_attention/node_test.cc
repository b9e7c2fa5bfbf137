// CpuAttentionNode in-process: results against the double-precision reference, selection and
// re-selection semantics, shards, forks, pool accounting, and bad requests.
#include "tandem/cpu_attention/cpu_attention_node.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>

#include "service_test_util.h"
#include "tandem/cpu_attention/merge_state.h"

namespace tandem::cpu_attention {
namespace {

using testing::AddRandomEntries;
using testing::AppendRequest;
using testing::ExpectHeadMatches;
using testing::Geometry;
using testing::HeadEntries;
using testing::OpenRequest;
using testing::RandomQueries;
using testing::ReferenceForHead;

// Tolerances (relative error = max |x - ref| / max |ref| over a head's O): bf16 KV differs from
// the reference only by fp32 accumulation thanks to the hi/lo split of q and p, so both are far
// below the 1e-3 the issue allows.
constexpr double kBf16Tolerance = 1e-3;
constexpr double kF32Tolerance = 1e-5;

std::unique_ptr<CpuAttentionNode> MakeNode(uint64_t pool_bytes = 256ull << 20,
                                           unsigned threads = 2) {
  NodeOptions options;
  options.pool_bytes = pool_bytes;
  options.threads = threads;
  auto node = CpuAttentionNode::Create(options);
  EXPECT_TRUE(node.ok()) << node.status();
  return std::move(*node);
}

v1::AttendRequest AttendOne(const std::string& session, uint32_t layer,
                            const std::vector<float>& q, size_t tokens, const Geometry& g) {
  v1::AttendRequest r;
  r.set_layer(layer);
  v1::AttendQuery* query = r.add_queries();
  query->set_session_id(session);
  const int64_t shape[] = {static_cast<int64_t>(tokens), g.q_heads, g.head_dim};
  EncodeF32(q, shape, query->mutable_q());
  return r;
}

v1::CloseSessionRequest MakeClose(const std::string& id) {
  v1::CloseSessionRequest r;
  r.set_session_id(id);
  return r;
}

std::vector<uint8_t> KeepAbove(const HeadEntries& e, float threshold) {
  std::vector<uint8_t> keep(e.n());
  for (size_t i = 0; i < e.n(); ++i) keep[i] = e.maw[i] > threshold;
  return keep;
}

class DenseRoundTrip
    : public ::testing::TestWithParam<std::tuple<uint32_t, uint32_t, uint32_t, bool>> {};

// β = 0: Attend equals exact attention over everything appended, for every shape.
TEST_P(DenseRoundTrip, MatchesReference) {
  const auto [head_dim, group, block, bf16] = GetParam();
  Geometry g{2, 2 * group, 2, head_dim};
  auto node = MakeNode();
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node->OpenSession(OpenRequest("s", g, block, bf16, 0), &opened).ok());
  EXPECT_EQ(opened.block_size(), block);

  std::mt19937 rng(head_dim * 31 + group * 7 + block);
  std::vector<HeadEntries> entries(g.kv_heads);
  // Odd chunk sizes so blocks are filled across messages.
  for (size_t chunk : {size_t{5}, size_t{block}, size_t{3 * block + 7}, size_t{1}}) {
    const size_t first = entries[0].n();
    AddRandomEntries(entries, chunk, head_dim, bf16, 1e-3f, rng);
    v1::AppendKvResponse totals;
    ASSERT_TRUE(
        node->AppendKv(AppendRequest("s", 1, entries, first, chunk, head_dim, bf16, 256), &totals)
            .ok());
    EXPECT_EQ(totals.entries_appended(), chunk * g.kv_heads);
    EXPECT_EQ(totals.entries_selected(), chunk * g.kv_heads);
  }
  for (size_t tokens : {1, 3}) {
    const std::vector<float> q = RandomQueries(tokens, g, rng);
    v1::AttendResponse resp;
    ASSERT_TRUE(node->Attend(AttendOne("s", 1, q, tokens, g), &resp).ok());
    const v1::AttendResult& r = resp.results(0);
    ASSERT_EQ(r.kv_heads_size(), 2);
    for (uint32_t h = 0; h < g.kv_heads; ++h) {
      EXPECT_EQ(r.selected(h), entries[h].n());
      EXPECT_EQ(r.held(h), entries[h].n());
      ExpectHeadMatches(r, h, 2, h, q, tokens, g, entries[h], {},
                        bf16 ? kBf16Tolerance : kF32Tolerance);
    }
    // Layer 0 holds nothing: the empty state.
    v1::AttendResponse empty;
    ASSERT_TRUE(node->Attend(AttendOne("s", 0, q, tokens, g), &empty).ok());
    const float* lse = reinterpret_cast<const float*>(empty.results(0).lse().data().data());
    for (int i = 0; i < empty.results(0).lse().shape(1) * static_cast<int>(tokens); ++i) {
      EXPECT_EQ(lse[i], -std::numeric_limits<float>::infinity());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DenseRoundTrip,
                         ::testing::Combine(::testing::Values(8u, 64u, 128u),
                                            ::testing::Values(1u, 4u, 8u),
                                            ::testing::Values(16u, 64u, 256u),
                                            ::testing::Bool()));

TEST(NodeSelection, AppendSelectsEntriesAboveBetaOverWindow) {
  Geometry g{1, 8, 2, 64};
  auto node = MakeNode();
  const float beta = 1.0f;
  const uint32_t window = 128;
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node->OpenSession(OpenRequest("s", g, 32, true, beta), &opened).ok());
  std::mt19937 rng(5);
  std::vector<HeadEntries> entries(g.kv_heads);
  AddRandomEntries(entries, 700, g.head_dim, true, 1.0f / window, rng);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(
      node->AppendKv(AppendRequest("s", 0, entries, 0, 700, g.head_dim, true, window), &totals)
          .ok());
  const float threshold = beta / window;
  uint64_t expected = 0;
  for (const auto& e : entries) {
    for (float m : e.maw) expected += m > threshold;
  }
  EXPECT_EQ(totals.entries_selected(), expected);
  EXPECT_GT(expected, 0u);
  EXPECT_LT(expected, 1400u);

  const std::vector<float> q = RandomQueries(2, g, rng);
  v1::AttendResponse resp;
  ASSERT_TRUE(node->Attend(AttendOne("s", 0, q, 2, g), &resp).ok());
  for (uint32_t h = 0; h < g.kv_heads; ++h) {
    const auto keep = KeepAbove(entries[h], threshold);
    EXPECT_EQ(resp.results(0).selected(h),
              static_cast<uint64_t>(std::count(keep.begin(), keep.end(), 1)));
    ExpectHeadMatches(resp.results(0), h, 2, h, q, 2, g, entries[h], keep, kBf16Tolerance);
  }
}

TEST(NodeSelection, HugeBetaSelectsNothingAndGivesEmptyState) {
  Geometry g{1, 4, 1, 64};
  auto node = MakeNode();
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node->OpenSession(OpenRequest("s", g, 16, true, 1e9f), &opened).ok());
  std::mt19937 rng(6);
  std::vector<HeadEntries> entries(1);
  AddRandomEntries(entries, 40, g.head_dim, true, 1e-2f, rng);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(node->AppendKv(AppendRequest("s", 0, entries, 0, 40, 64, true, 64), &totals).ok());
  EXPECT_EQ(totals.entries_selected(), 0u);
  const std::vector<float> q = RandomQueries(1, g, rng);
  v1::AttendResponse resp;
  ASSERT_TRUE(node->Attend(AttendOne("s", 0, q, 1, g), &resp).ok());
  EXPECT_EQ(resp.results(0).selected(0), 0u);
  EXPECT_EQ(resp.results(0).held(0), 40u);
  ExpectHeadMatches(resp.results(0), 0, 1, 0, q, 1, g, entries[0],
                    std::vector<uint8_t>(40, 0), kBf16Tolerance);
}

// Reselect (HGCA Alg. 1 lines 20-22): fresh weights over all held entries, threshold β / held.
TEST(NodeSelection, ReselectUsesFreshScoresAndNewBeta) {
  Geometry g{1, 8, 2, 64};
  auto node = MakeNode();
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node->OpenSession(OpenRequest("s", g, 64, false, 1.0f), &opened).ok());
  std::mt19937 rng(7);
  std::vector<HeadEntries> entries(g.kv_heads);
  AddRandomEntries(entries, 300, g.head_dim, false, 1.0f / 64, rng);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(node->AppendKv(AppendRequest("s", 0, entries, 0, 300, 64, false, 64), &totals).ok());

  const size_t tokens = 4;
  // Queries aligned with a few keys so the fresh weights are peaked.
  std::vector<float> q = RandomQueries(tokens, g, rng);
  for (size_t t = 0; t < tokens; ++t) {
    for (uint32_t hq = 0; hq < g.q_heads; ++hq) {
      const HeadEntries& e = entries[hq / g.group()];
      for (uint32_t d = 0; d < g.head_dim; ++d) {
        q[(t * g.q_heads + hq) * g.head_dim + d] += 0.5f * e.k[(17 * t + 3) * g.head_dim + d];
      }
    }
  }
  const float new_beta = 2.0f;
  v1::ReselectRequest req;
  req.set_session_id("s");
  req.set_layer(0);
  req.set_beta(new_beta);
  const int64_t shape[] = {static_cast<int64_t>(tokens), g.q_heads, g.head_dim};
  EncodeF32(q, shape, req.mutable_q());
  v1::ReselectResponse resp;
  ASSERT_TRUE(node->Reselect(req, &resp).ok());

  const double scale = 1.0 / std::sqrt(64.0);
  std::vector<std::vector<uint8_t>> keep(g.kv_heads);
  for (uint32_t h = 0; h < g.kv_heads; ++h) {
    const HeadEntries& e = entries[h];
    // a_i = mean over rows of softmax_i(scale q·k_i) over all 300 entries.
    std::vector<double> a(e.n(), 0.0);
    const uint32_t G = g.group();
    for (size_t t = 0; t < tokens; ++t) {
      for (uint32_t j = 0; j < G; ++j) {
        const float* qr = &q[(t * g.q_heads + h * G + j) * g.head_dim];
        std::vector<double> s(e.n());
        double m = -1e300;
        for (size_t i = 0; i < e.n(); ++i) {
          double dot = 0;
          for (uint32_t d = 0; d < g.head_dim; ++d) dot += double(qr[d]) * e.k[i * 64 + d];
          s[i] = dot * scale;
          m = std::max(m, s[i]);
        }
        double sum = 0;
        for (double x : s) sum += std::exp(x - m);
        for (size_t i = 0; i < e.n(); ++i) a[i] += std::exp(s[i] - m) / sum / (tokens * G);
      }
    }
    keep[h].resize(e.n());
    const double threshold = new_beta / e.n();
    uint64_t expected = 0;
    for (size_t i = 0; i < e.n(); ++i) {
      keep[h][i] = a[i] > threshold;
      expected += keep[h][i];
    }
    EXPECT_EQ(resp.kv_heads(h), h);
    EXPECT_EQ(resp.held(h), 300u);
    EXPECT_EQ(resp.selected(h), expected) << "head " << h;
    EXPECT_GT(expected, 0u);
    EXPECT_LT(expected, 300u);
  }
  // Attend now uses the re-evaluated set.
  const std::vector<float> q2 = RandomQueries(1, g, rng);
  v1::AttendResponse out;
  ASSERT_TRUE(node->Attend(AttendOne("s", 0, q2, 1, g), &out).ok());
  for (uint32_t h = 0; h < g.kv_heads; ++h) {
    ExpectHeadMatches(out.results(0), h, 2, h, q2, 1, g, entries[h], keep[h], kF32Tolerance);
  }
  // New entries after the reselect use the new β against their window.
  std::vector<HeadEntries> more(g.kv_heads);
  AddRandomEntries(more, 50, 64, false, 1.0f / 64, rng);
  v1::AppendKvResponse t2;
  ASSERT_TRUE(node->AppendKv(AppendRequest("s", 0, more, 0, 50, 64, false, 64), &t2).ok());
  uint64_t expected_new = 0;
  for (const auto& e : more) {
    for (float m : e.maw) expected_new += m > new_beta / 64;
  }
  EXPECT_EQ(t2.entries_selected(), expected_new);
}

TEST(NodeShards, OwnedSubsetOnly) {
  Geometry g{2, 8, 4, 64};
  auto node = MakeNode();
  v1::OpenSessionRequest open = OpenRequest("s", g, 16, true, 0);
  for (auto [l, h] : {std::pair{0u, 1u}, {0u, 3u}, {1u, 0u}}) {
    v1::ShardId* s = open.add_shards();
    s->set_layer(l);
    s->set_kv_head(h);
  }
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node->OpenSession(open, &opened).ok());
  std::mt19937 rng(8);
  std::vector<HeadEntries> entries(2);  // heads 1 and 3 of layer 0
  AddRandomEntries(entries, 50, 64, true, 1e-2f, rng);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(node->AppendKv(AppendRequest("s", 0, entries, 0, 50, 64, true, 64), &totals).ok());
  // Naming a head this node does not own is refused, and nothing is appended.
  v1::AppendKvRequest bad = AppendRequest("s", 0, entries, 0, 10, 64, true, 64);
  bad.add_kv_heads(1);
  bad.add_kv_heads(2);
  EXPECT_EQ(node->AppendKv(bad, &totals).code(), absl::StatusCode::kInvalidArgument);

  const std::vector<float> q = RandomQueries(1, g, rng);
  v1::AttendResponse resp;
  ASSERT_TRUE(node->Attend(AttendOne("s", 0, q, 1, g), &resp).ok());
  const v1::AttendResult& r = resp.results(0);
  ASSERT_EQ(r.kv_heads_size(), 2);
  EXPECT_EQ(r.kv_heads(0), 1u);
  EXPECT_EQ(r.kv_heads(1), 3u);
  EXPECT_EQ(r.o().shape(1), 2 * 2);
  ExpectHeadMatches(r, 0, 2, 1, q, 1, g, entries[0], {}, kBf16Tolerance);
  ExpectHeadMatches(r, 1, 2, 3, q, 1, g, entries[1], {}, kBf16Tolerance);
}

// Two partial states over disjoint halves merge into attention over the whole.
TEST(NodeMerge, HalvesOnTwoSessionsMergeToWhole) {
  Geometry g{1, 4, 1, 128};
  auto node = MakeNode();
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node->OpenSession(OpenRequest("a", g, 64, true, 0), &opened).ok());
  ASSERT_TRUE(node->OpenSession(OpenRequest("b", g, 64, true, 0), &opened).ok());
  std::mt19937 rng(9);
  std::vector<HeadEntries> entries(1);
  AddRandomEntries(entries, 1000, 128, true, 1e-2f, rng);
  v1::AppendKvResponse t;
  ASSERT_TRUE(node->AppendKv(AppendRequest("a", 0, entries, 0, 400, 128, true, 64), &t).ok());
  ASSERT_TRUE(node->AppendKv(AppendRequest("b", 0, entries, 400, 600, 128, true, 64), &t).ok());
  const std::vector<float> q = RandomQueries(1, g, rng);
  v1::AttendRequest req = AttendOne("a", 0, q, 1, g);
  *req.add_queries() = AttendOne("b", 0, q, 1, g).queries(0);
  v1::AttendResponse resp;
  ASSERT_TRUE(node->Attend(req, &resp).ok());
  ASSERT_EQ(resp.results_size(), 2);
  std::vector<float> o(4 * 128), lse(4);
  MergeStates(reinterpret_cast<const float*>(resp.results(0).o().data().data()),
              reinterpret_cast<const float*>(resp.results(0).lse().data().data()),
              reinterpret_cast<const float*>(resp.results(1).o().data().data()),
              reinterpret_cast<const float*>(resp.results(1).lse().data().data()), o.data(),
              lse.data(), 4, 128);
  v1::AttendResult merged = resp.results(0);
  EncodeF32(o, std::vector<int64_t>{1, 4, 128}, merged.mutable_o());
  EncodeF32(lse, std::vector<int64_t>{1, 4}, merged.mutable_lse());
  ExpectHeadMatches(merged, 0, 1, 0, q, 1, g, entries[0], {}, kBf16Tolerance);
}

TEST(NodeFork, SharedPrefixAndCopyOnWrite) {
  Geometry g{1, 4, 2, 64};
  auto node = MakeNode();
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node->OpenSession(OpenRequest("parent", g, 16, true, 0), &opened).ok());
  std::mt19937 rng(10);
  std::vector<HeadEntries> entries(2);
  AddRandomEntries(entries, 100, 64, true, 1e-2f, rng);
  v1::AppendKvResponse t;
  ASSERT_TRUE(
      node->AppendKv(AppendRequest("parent", 0, entries, 0, 100, 64, true, 64), &t).ok());
  const uint64_t blocks_before = node->Stats().blocks_in_use();

  v1::OpenSessionRequest fork = OpenRequest("child", g, 16, true, 0);
  fork.mutable_fork_from()->set_parent_session_id("parent");
  fork.mutable_fork_from()->set_prefix_tokens(70);  // mid-block: the 5th block is shared, partial
  ASSERT_TRUE(node->OpenSession(fork, &opened).ok());
  EXPECT_EQ(opened.shared_entries(), 70u);
  EXPECT_EQ(node->Stats().blocks_in_use(), blocks_before) << "a fork must not copy blocks";

  // The child diverges: its own entries after the shared prefix.
  std::vector<HeadEntries> child(2);
  for (int h = 0; h < 2; ++h) {
    child[h].k.assign(entries[h].k.begin(), entries[h].k.begin() + 70 * 64);
    child[h].v.assign(entries[h].v.begin(), entries[h].v.begin() + 70 * 64);
    child[h].maw.assign(entries[h].maw.begin(), entries[h].maw.begin() + 70);
  }
  AddRandomEntries(child, 20, 64, true, 1e-2f, rng);
  ASSERT_TRUE(node->AppendKv(AppendRequest("child", 0, child, 70, 20, 64, true, 64), &t).ok());

  const std::vector<float> q = RandomQueries(1, g, rng);
  v1::AttendResponse parent_out, child_out;
  ASSERT_TRUE(node->Attend(AttendOne("parent", 0, q, 1, g), &parent_out).ok());
  ASSERT_TRUE(node->Attend(AttendOne("child", 0, q, 1, g), &child_out).ok());
  for (uint32_t h = 0; h < 2; ++h) {
    EXPECT_EQ(parent_out.results(0).held(h), 100u);
    EXPECT_EQ(child_out.results(0).held(h), 90u);
    ExpectHeadMatches(parent_out.results(0), h, 2, h, q, 1, g, entries[h], {}, kBf16Tolerance);
    ExpectHeadMatches(child_out.results(0), h, 2, h, q, 1, g, child[h], {}, kBf16Tolerance);
  }
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(node->CloseSession(MakeClose("parent"), &closed).ok());
  ASSERT_TRUE(node->Attend(AttendOne("child", 0, q, 1, g), &child_out).ok());
  ExpectHeadMatches(child_out.results(0), 0, 2, 0, q, 1, g, child[0], {}, kBf16Tolerance);
  ASSERT_TRUE(node->CloseSession(MakeClose("child"), &closed).ok());
  const v1::StatsResponse s = node->Stats();
  EXPECT_EQ(s.blocks_in_use(), 0u);
  EXPECT_EQ(s.used_bytes(), 0u);
  EXPECT_EQ(s.sessions(), 0u);
}

TEST(NodeAccounting, CloseReleasesEverythingAndCapacityIsEnforced) {
  Geometry g{2, 4, 2, 64};
  // Room for a handful of blocks only.
  auto node = MakeNode(/*pool_bytes=*/64 * 1024);
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node->OpenSession(OpenRequest("s", g, 16, true, 0), &opened).ok());
  ASSERT_TRUE(node->OpenSession(OpenRequest("other", g, 16, true, 0), &opened).ok());
  std::mt19937 rng(11);
  std::vector<HeadEntries> entries(2);
  AddRandomEntries(entries, 2000, 64, true, 1e-2f, rng);
  v1::AppendKvResponse t;
  ASSERT_TRUE(node->AppendKv(AppendRequest("s", 0, entries, 0, 32, 64, true, 64), &t).ok());
  const v1::StatsResponse before = node->Stats();
  const absl::Status full =
      node->AppendKv(AppendRequest("s", 0, entries, 32, 1968, 64, true, 64), &t);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  const v1::StatsResponse after = node->Stats();
  EXPECT_EQ(after.blocks_in_use(), before.blocks_in_use()) << "a failed append keeps nothing";
  EXPECT_EQ(after.used_bytes(), before.used_bytes());
  // The node keeps serving: the other session still works.
  ASSERT_TRUE(node->AppendKv(AppendRequest("other", 1, entries, 0, 16, 64, true, 64), &t).ok());
  const std::vector<float> q = RandomQueries(1, g, rng);
  v1::AttendResponse resp;
  ASSERT_TRUE(node->Attend(AttendOne("s", 0, q, 1, g), &resp).ok());
  EXPECT_EQ(resp.results(0).held(0), 32u);

  v1::CloseSessionResponse closed;
  ASSERT_TRUE(node->CloseSession(MakeClose("s"), &closed).ok());
  EXPECT_GT(closed.blocks_released(), 0u);
  ASSERT_TRUE(node->CloseSession(MakeClose("other"), &closed).ok());
  const v1::StatsResponse end = node->Stats();
  EXPECT_EQ(end.blocks_in_use(), 0u);
  EXPECT_EQ(end.used_bytes(), 0u);
  EXPECT_EQ(end.stored_bytes(), 0u);
  EXPECT_EQ(node->CloseSession(MakeClose("s"), &closed).code(), absl::StatusCode::kNotFound);
}

// Stats.resident_block_bytes follows the node's block pages: in use while a session holds
// them, kept for a while after it closes, then given back (release_free_after); never given
// back when release_free_after is negative.
// Opens session "s" of geometry `g` (2 KV heads of 64, bf16 rows) and appends 512 random
// entries of layer 0 to it.
void OpenAndAppend512(CpuAttentionNode& node, const Geometry& g) {
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(node.OpenSession(OpenRequest("s", g, 16, true, 0), &opened).ok());
  std::mt19937 rng(5);
  std::vector<HeadEntries> entries(2);
  AddRandomEntries(entries, 512, 64, true, 1e-2f, rng);
  v1::AppendKvResponse t;
  ASSERT_TRUE(node.AppendKv(AppendRequest("s", 0, entries, 0, 512, 64, true, 64), &t).ok());
}

TEST(NodeAccounting, FreeBlockPagesGoBackToTheKernelAfterTheDelay) {
  Geometry g{2, 4, 2, 64};
  for (const auto after : {std::chrono::milliseconds(50), std::chrono::milliseconds(-1)}) {
    SCOPED_TRACE(after.count());
    NodeOptions options;
    options.pool_bytes = 64ull << 20;
    options.threads = 1;
    options.release_free_after = after;
    options.warm_reserve_bytes = 0;   // resident == in use exactly (the reserve: next test)
    auto node = CpuAttentionNode::Create(options);
    ASSERT_TRUE(node.ok()) << node.status();
    ASSERT_NO_FATAL_FAILURE(OpenAndAppend512(**node, g));
    const v1::StatsResponse loaded = (*node)->Stats();
    ASSERT_GT(loaded.block_bytes_in_use(), 0u);
    EXPECT_EQ(loaded.resident_block_bytes(), loaded.block_bytes_in_use());
    v1::CloseSessionResponse closed;
    ASSERT_TRUE((*node)->CloseSession(MakeClose("s"), &closed).ok());
    EXPECT_EQ((*node)->Stats().blocks_in_use(), 0u);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((*node)->Stats().resident_block_bytes() > 0 &&
           std::chrono::steady_clock::now() < deadline && after.count() >= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (after.count() >= 0) {
      EXPECT_EQ((*node)->Stats().resident_block_bytes(), 0u);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      EXPECT_EQ((*node)->Stats().resident_block_bytes(), loaded.block_bytes_in_use());
    }
  }
}

// A warm reserve keeps free block pages faulted in beside a session's blocks (a settle's next
// appends land on them), and goes with the rest once no session holds blocks.
TEST(NodeAccounting, WarmReserveStaysBesideSessionsAndGoesWhenIdle) {
  Geometry g{2, 4, 2, 64};
  NodeOptions options;
  options.pool_bytes = 64ull << 20;
  options.threads = 1;
  options.release_free_after = std::chrono::milliseconds(50);
  options.warm_reserve_bytes = 2ull << 20;
  auto node = CpuAttentionNode::Create(options);
  ASSERT_TRUE(node.ok()) << node.status();
  ASSERT_NO_FATAL_FAILURE(OpenAndAppend512(**node, g));
  const uint64_t in_use = (*node)->Stats().block_bytes_in_use();
  ASSERT_GT(in_use, 0u);
  // The reserve in whole blocks of 16 entries of bf16 K and V rows of 64 and a MAW float:
  // 16 x (2 x 128 + 4) = 4,160 bytes (a multiple of 64 already).
  const uint64_t block_bytes = 16 * (2 * 64 * 2 + 4);
  const uint64_t reserve = (2ull << 20) / block_bytes * block_bytes;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((*node)->Stats().resident_block_bytes() < in_use + reserve &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Held past the release delay: the reserve is not released while blocks are in use.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ((*node)->Stats().resident_block_bytes(), in_use + reserve);
  v1::CloseSessionResponse closed;
  ASSERT_TRUE((*node)->CloseSession(MakeClose("s"), &closed).ok());
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((*node)->Stats().resident_block_bytes() > 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ((*node)->Stats().resident_block_bytes(), 0u);
}

class NodeBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    node_ = MakeNode();
    v1::OpenSessionResponse opened;
    ASSERT_TRUE(node_->OpenSession(OpenRequest("s", g_, 16, true, 0), &opened).ok());
    AddRandomEntries(entries_, 40, g_.head_dim, true, 1e-2f, rng_);
    v1::AppendKvResponse t;
    ASSERT_TRUE(node_->AppendKv(AppendRequest("s", 0, entries_, 0, 40, 64, true, 64), &t).ok());
  }

  // After every bad request the node must still answer a good one correctly.
  void ExpectStillServes() {
    const std::vector<float> q = RandomQueries(1, g_, rng_);
    v1::AttendResponse resp;
    ASSERT_TRUE(node_->Attend(AttendOne("s", 0, q, 1, g_), &resp).ok());
    ExpectHeadMatches(resp.results(0), 1, 2, 1, q, 1, g_, entries_[1], {}, kBf16Tolerance);
  }

  Geometry g_{2, 4, 2, 64};
  std::unique_ptr<CpuAttentionNode> node_;
  std::mt19937 rng_{12};
  std::vector<HeadEntries> entries_{2};
};

TEST_F(NodeBadInput, OpenSession) {
  v1::OpenSessionResponse r;
  auto expect = [&](v1::OpenSessionRequest req, absl::StatusCode code, const char* what) {
    const absl::Status s = node_->OpenSession(req, &r);
    EXPECT_EQ(s.code(), code) << what << ": " << s;
    EXPECT_FALSE(s.message().empty()) << what;
  };
  expect(OpenRequest("s", g_, 16, true, 0), absl::StatusCode::kAlreadyExists, "duplicate");
  expect(OpenRequest("bad id!", g_, 16, true, 0), absl::StatusCode::kInvalidArgument, "id");
  expect(OpenRequest("", g_, 16, true, 0), absl::StatusCode::kInvalidArgument, "empty id");
  v1::OpenSessionRequest no_geometry = OpenRequest("x", g_, 16, true, 0);
  no_geometry.clear_geometry();
  expect(no_geometry, absl::StatusCode::kInvalidArgument, "no geometry");
  expect(OpenRequest("x", {2, 5, 2, 64}, 16, true, 0), absl::StatusCode::kInvalidArgument,
         "q heads not a multiple");
  expect(OpenRequest("x", {2, 4, 2, 60}, 16, true, 0), absl::StatusCode::kInvalidArgument,
         "head_dim");
  expect(OpenRequest("x", {0, 4, 2, 64}, 16, true, 0), absl::StatusCode::kInvalidArgument,
         "layers");
  expect(OpenRequest("x", g_, 8, true, 0), absl::StatusCode::kInvalidArgument, "block 8");
  expect(OpenRequest("x", g_, 512, true, 0), absl::StatusCode::kInvalidArgument, "block 512");
  expect(OpenRequest("x", g_, 16, true, -1), absl::StatusCode::kInvalidArgument, "beta < 0");
  expect(OpenRequest("x", g_, 16, true, std::nanf("")), absl::StatusCode::kInvalidArgument,
         "beta NaN");
  v1::OpenSessionRequest f16 = OpenRequest("x", g_, 16, true, 0);
  f16.set_kv_dtype(v1::DTYPE_F16);
  expect(f16, absl::StatusCode::kInvalidArgument, "f16");
  v1::OpenSessionRequest bad_shard = OpenRequest("x", g_, 16, true, 0);
  bad_shard.add_shards()->set_layer(7);
  expect(bad_shard, absl::StatusCode::kInvalidArgument, "shard layer");
  v1::OpenSessionRequest fork = OpenRequest("x", g_, 16, true, 0);
  fork.mutable_fork_from()->set_parent_session_id("nope");
  expect(fork, absl::StatusCode::kNotFound, "fork parent");
  fork.mutable_fork_from()->set_parent_session_id("s");
  fork.mutable_fork_from()->set_prefix_tokens(41);
  expect(fork, absl::StatusCode::kInvalidArgument, "fork prefix too long");
  ExpectStillServes();
}

TEST_F(NodeBadInput, AppendKv) {
  v1::AppendKvResponse t;
  auto expect = [&](v1::AppendKvRequest req, absl::StatusCode code, const char* what) {
    const absl::Status s = node_->AppendKv(req, &t);
    EXPECT_EQ(s.code(), code) << what << ": " << s;
  };
  const v1::AppendKvRequest good = AppendRequest("s", 0, entries_, 0, 8, 64, true, 64);
  v1::AppendKvRequest r = good;
  r.set_session_id("unknown");
  expect(r, absl::StatusCode::kNotFound, "session");
  r = good;
  r.set_layer(2);
  expect(r, absl::StatusCode::kInvalidArgument, "layer");
  r = good;
  r.mutable_k()->set_dtype(v1::DTYPE_F32);
  expect(r, absl::StatusCode::kInvalidArgument, "k dtype");
  r = good;
  r.mutable_v()->mutable_data()->resize(10);
  expect(r, absl::StatusCode::kInvalidArgument, "v bytes");
  r = good;
  r.mutable_maw()->set_shape(1, 7);
  expect(r, absl::StatusCode::kInvalidArgument, "maw shape");
  r = good;
  reinterpret_cast<float*>(r.mutable_maw()->mutable_data()->data())[3] = std::nanf("");
  expect(r, absl::StatusCode::kInvalidArgument, "maw NaN");
  r = good;
  r.set_window_entries(0);
  expect(r, absl::StatusCode::kInvalidArgument, "window 0");
  r = good;
  r.add_kv_heads(0);
  r.add_kv_heads(0);
  expect(r, absl::StatusCode::kInvalidArgument, "duplicate heads");
  r = good;
  r.mutable_k()->set_shape(1, 1 << 30);
  expect(r, absl::StatusCode::kInvalidArgument, "huge token count");
  EXPECT_EQ(node_->Stats().stored_bytes(),
            2 * 40 * (2 * 64 * 2 + 4)) << "failed appends must store nothing";
  ExpectStillServes();
}

TEST_F(NodeBadInput, Attend) {
  v1::AttendResponse resp;
  auto expect = [&](v1::AttendRequest req, absl::StatusCode code, const char* what) {
    const absl::Status s = node_->Attend(req, &resp);
    EXPECT_EQ(s.code(), code) << what << ": " << s;
  };
  const std::vector<float> q = RandomQueries(1, g_, rng_);
  const v1::AttendRequest good = AttendOne("s", 0, q, 1, g_);
  v1::AttendRequest r = good;
  r.mutable_queries(0)->set_session_id("unknown");
  expect(r, absl::StatusCode::kNotFound, "session");
  r = good;
  r.set_layer(9);
  expect(r, absl::StatusCode::kInvalidArgument, "layer");
  r = good;
  r.clear_queries();
  expect(r, absl::StatusCode::kInvalidArgument, "no queries");
  r = good;
  *r.add_queries() = good.queries(0);
  expect(r, absl::StatusCode::kInvalidArgument, "duplicate session");
  r = good;
  r.mutable_queries(0)->mutable_q()->set_shape(1, 8);
  expect(r, absl::StatusCode::kInvalidArgument, "q heads");
  r = good;
  r.mutable_queries(0)->mutable_q()->set_shape(0, 0);
  expect(r, absl::StatusCode::kInvalidArgument, "zero tokens");
  r = good;
  r.mutable_queries(0)->mutable_q()->set_shape(0, 1 << 20);
  expect(r, absl::StatusCode::kInvalidArgument, "too many tokens");
  r = good;
  reinterpret_cast<float*>(r.mutable_queries(0)->mutable_q()->mutable_data()->data())[5] =
      std::nanf("");
  expect(r, absl::StatusCode::kInvalidArgument, "NaN in q");
  r = good;
  reinterpret_cast<float*>(r.mutable_queries(0)->mutable_q()->mutable_data()->data())[5] =
      std::numeric_limits<float>::infinity();
  expect(r, absl::StatusCode::kInvalidArgument, "Inf in q");
  r = good;
  r.mutable_queries(0)->mutable_q()->set_dtype(v1::DTYPE_F16);
  expect(r, absl::StatusCode::kInvalidArgument, "f16 q");
  ExpectStillServes();
}

TEST_F(NodeBadInput, Reselect) {
  v1::ReselectResponse resp;
  v1::ReselectRequest r;
  r.set_session_id("s");
  r.set_layer(0);
  const std::vector<float> q = RandomQueries(2, g_, rng_);
  EncodeF32(q, std::vector<int64_t>{2, 4, 64}, r.mutable_q());
  v1::ReselectRequest bad = r;
  bad.set_beta(-2);
  EXPECT_EQ(node_->Reselect(bad, &resp).code(), absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.mutable_q()->set_shape(2, 32);
  EXPECT_EQ(node_->Reselect(bad, &resp).code(), absl::StatusCode::kInvalidArgument);
  bad = r;
  bad.set_session_id("nope");
  EXPECT_EQ(node_->Reselect(bad, &resp).code(), absl::StatusCode::kNotFound);
  ExpectStillServes();
  // β = 0 through Reselect: dense again.
  r.set_beta(0);
  ASSERT_TRUE(node_->Reselect(r, &resp).ok());
  EXPECT_EQ(resp.selected(0), 40u);
}

}  // namespace
}  // namespace tandem::cpu_attention

namespace tandem::cpu_attention {
namespace {

// Closing a session while other threads attend and append to it: every call answers OK or
// NOT_FOUND (never a crash), and the node ends with no block held.
TEST(NodeConcurrency, CloseDuringAttendAndAppend) {
  Geometry g{1, 8, 2, 64};
  auto node = MakeNode(256ull << 20, 2);
  std::mt19937 rng(13);
  std::vector<HeadEntries> entries(2);
  AddRandomEntries(entries, 4096, 64, true, 1e-3f, rng);
  const std::vector<float> q = RandomQueries(1, g, rng);
  for (int round = 0; round < 20; ++round) {
    v1::OpenSessionResponse opened;
    ASSERT_TRUE(node->OpenSession(OpenRequest("s", g, 64, true, 0), &opened).ok());
    v1::AppendKvResponse t;
    ASSERT_TRUE(node->AppendKv(AppendRequest("s", 0, entries, 0, 2048, 64, true, 64), &t).ok());
    std::atomic<bool> stop{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i) {
      threads.emplace_back([&, i] {
        while (!stop.load()) {
          absl::Status s;
          if (i == 0) {
            v1::AttendResponse resp;
            s = node->Attend(AttendOne("s", 0, q, 1, g), &resp);
          } else {
            v1::AppendKvResponse totals;
            s = node->AppendKv(AppendRequest("s", 0, entries, 2048, 64, 64, true, 64), &totals);
          }
          ASSERT_TRUE(s.ok() || s.code() == absl::StatusCode::kNotFound) << s;
          if (s.code() == absl::StatusCode::kNotFound) return;
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    v1::CloseSessionResponse closed;
    ASSERT_TRUE(node->CloseSession(MakeClose("s"), &closed).ok());
    stop.store(true);
    for (auto& t : threads) t.join();
  }
  EXPECT_EQ(node->Stats().blocks_in_use(), 0u);
  EXPECT_EQ(node->Stats().used_bytes(), 0u);
}

}  // namespace
}  // namespace tandem::cpu_attention

namespace tandem::cpu_attention {
namespace {

// The pool's task split and spin are node options with bounds: out of them the node refuses to
// start and says which; in them it serves.
TEST(NodeOptionsTest, TaskSplitSpinAndPrefetchAreBounded) {
  auto refused = [](NodeOptions options, const char* what) {
    options.pool_bytes = 16ull << 20;
    options.threads = 1;
    const absl::Status s = CpuAttentionNode::Create(options).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  NodeOptions o;
  o.tasks_per_thread = 0;
  refused(o, "tasks_per_thread");
  o.tasks_per_thread = 65;
  refused(o, "tasks_per_thread");
  o = NodeOptions{};
  o.dense_tasks_per_thread = 0;
  refused(o, "dense_tasks_per_thread");
  o.dense_tasks_per_thread = 65;
  refused(o, "dense_tasks_per_thread");
  o = NodeOptions{};
  o.pool_spin_us = 100001;
  refused(o, "pool_spin_us");
  o = NodeOptions{};
  o.prefetch_entries = 4097;
  refused(o, "prefetch_entries");
  o = NodeOptions{};
  o.pool_bytes = 16ull << 20;
  o.threads = 1;
  o.tasks_per_thread = 64;
  o.dense_tasks_per_thread = 1;
  o.pool_spin_us = 0;
  o.prefetch_entries = 4096;
  EXPECT_TRUE(CpuAttentionNode::Create(o).ok());
  o.prefetch_entries = 0;
  EXPECT_TRUE(CpuAttentionNode::Create(o).ok());
}

}  // namespace
}  // namespace tandem::cpu_attention
