// Shard migration and draining on CpuAttentionNode in-process: ReshardSession (errors, owned
// heads, memory given back), ExportShard (ranges, chunking, concurrent changes), AppendKv with
// selection flags, a live migration of a layer's shards from node A to node B whose Attend
// answers are bit-identical to A's, and Stats' draining / free_bytes / node_id.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "migration_test_util.h"
#include "service_test_util.h"
#include "tandem/cpu_attention/cpu_attention_node.h"

namespace tandem::cpu_attention {
namespace {

using testing::AddRandomEntries;
using testing::AppendRequest;
using testing::ExportRequest;
using testing::Geometry;
using testing::HeadEntries;
using testing::ImportRequest;
using testing::OpenRequest;
using testing::RandomQueries;
using testing::ReshardRequest;
using testing::ShardList;

constexpr uint32_t kBlock = 16;

std::unique_ptr<CpuAttentionNode> MakeNode(unsigned threads = 2) {
  NodeOptions options;
  options.pool_bytes = 64ull << 20;
  options.threads = threads;
  auto node = CpuAttentionNode::Create(options);
  EXPECT_TRUE(node.ok()) << node.status();
  return std::move(*node);
}

v1::AttendRequest AttendOne(const std::string& session, uint32_t layer, const std::vector<float>& q,
                            size_t tokens, const Geometry& g) {
  v1::AttendRequest r;
  r.set_layer(layer);
  v1::AttendQuery* query = r.add_queries();
  query->set_session_id(session);
  EncodeF32(q, std::vector<int64_t>{static_cast<int64_t>(tokens), g.q_heads, g.head_dim},
            query->mutable_q());
  return r;
}

v1::OpenSessionRequest OpenWith(const std::string& id, const Geometry& g, float beta,
                                const ShardList& shards) {
  v1::OpenSessionRequest r = OpenRequest(id, g, kBlock, /*bf16=*/true, beta);
  testing::AddShards(shards, r.mutable_shards());
  return r;
}

uint64_t Blocks(uint64_t entries) { return (entries + kBlock - 1) / kBlock; }

// Node A holds session "s" (2 layers x 2 kv heads, bf16, beta 1) with entries in both layers,
// and layer 1's selection re-evaluated by a Reselect with beta 2 (so its flags are not what the
// MAW rule gives).
class MigrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = MakeNode();
    b_ = MakeNode();
    v1::OpenSessionResponse opened;
    ASSERT_TRUE(a_->OpenSession(OpenRequest("s", g_, kBlock, true, 1.0f), &opened).ok());
    std::mt19937 rng(11);
    for (uint32_t layer = 0; layer < 2; ++layer) {
      entries_[layer].resize(g_.kv_heads);
      for (size_t chunk : {size_t{61}, size_t{16}, size_t{90}}) {
        const size_t first = entries_[layer][0].n();
        AddRandomEntries(entries_[layer], chunk, g_.head_dim, true, 1.0f / 64, rng);
        v1::AppendKvResponse totals;
        ASSERT_TRUE(a_->AppendKv(AppendRequest("s", layer, entries_[layer], first, chunk,
                                               g_.head_dim, true, 64),
                                 &totals)
                        .ok());
      }
    }
    // Reselect layer 1 with queries aligned to a few keys, and a new beta.
    std::vector<float> q = RandomQueries(2, g_, rng);
    for (size_t i = 0; i < q.size(); ++i) {
      const uint32_t hq = static_cast<uint32_t>(i / g_.head_dim) % g_.q_heads;
      q[i] += 0.7f * entries_[1][hq / g_.group()].k[(23 + hq) * g_.head_dim + i % g_.head_dim];
    }
    v1::ReselectRequest reselect;
    reselect.set_session_id("s");
    reselect.set_layer(1);
    reselect.set_beta(2.0f);
    EncodeF32(q, std::vector<int64_t>{2, g_.q_heads, g_.head_dim}, reselect.mutable_q());
    ASSERT_TRUE(a_->Reselect(reselect, &reselected_).ok());
  }

  // Streams shard (layer, head) of "s" from A into the same shard of "s" on B.
  void Migrate(uint32_t layer, uint32_t head, uint32_t max_chunk_entries) {
    v1::AppendKvResponse totals;
    uint64_t next = 0;
    const absl::Status s =
        a_->ExportShard(ExportRequest("s", layer, head, 0, 0, max_chunk_entries),
                        [&](const v1::ExportShardChunk& chunk) -> absl::Status {
                          EXPECT_EQ(chunk.first_entry(), next);
                          next += chunk.num_entries();
                          return b_->AppendKv(ImportRequest("s", layer, head, chunk), &totals);
                        });
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(next, entries_[layer][head].n());
    EXPECT_EQ(totals.entries_appended(), entries_[layer][head].n());
  }

  Geometry g_{2, 8, 2, 64};
  std::unique_ptr<CpuAttentionNode> a_, b_;
  std::vector<HeadEntries> entries_[2];  // [layer][kv head]
  v1::ReselectResponse reselected_;
};

TEST_F(MigrationTest, LayerMovesToNodeBWithBitIdenticalAttend) {
  // The flags must differ from the MAW rule for the test to show they are carried.
  bool differs = false;
  for (uint32_t h = 0; h < 2; ++h) {
    const uint64_t by_rule =
        static_cast<uint64_t>(std::count_if(entries_[1][h].maw.begin(), entries_[1][h].maw.end(),
                                            [](float m) { return m > 2.0f / 64; }));
    differs |= reselected_.selected(h) != by_rule;
    EXPECT_GT(reselected_.selected(h), 0u);
    EXPECT_LT(reselected_.selected(h), entries_[1][h].n());
  }
  ASSERT_TRUE(differs);

  std::mt19937 rng(12);
  const std::vector<float> q1 = RandomQueries(1, g_, rng);
  const std::vector<float> q3 = RandomQueries(3, g_, rng);
  v1::AttendResponse before1, before3;
  ASSERT_TRUE(a_->Attend(AttendOne("s", 1, q1, 1, g_), &before1).ok());
  ASSERT_TRUE(a_->Attend(AttendOne("s", 1, q3, 3, g_), &before3).ok());

  // B already serves another shard of the session; it adds layer 1's two shards.
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(b_->OpenSession(OpenWith("s", g_, 2.0f, {{0, 0}}), &opened).ok());
  v1::ReshardSessionResponse added;
  ASSERT_TRUE(b_->ReshardSession(ReshardRequest("s", {{1, 1}, {1, 0}}, {}), &added).ok());
  EXPECT_EQ(added.shards(), 3u);
  EXPECT_EQ(added.blocks_released(), 0u);
  EXPECT_EQ(added.free_bytes(), b_->Stats().free_bytes());
  Migrate(1, 0, 37);
  Migrate(1, 1, 4096);

  for (const auto& [q, tokens, before] :
       {std::tuple{&q1, 1, &before1}, std::tuple{&q3, 3, &before3}}) {
    v1::AttendResponse after;
    ASSERT_TRUE(b_->Attend(AttendOne("s", 1, *q, tokens, g_), &after).ok());
    const v1::AttendResult& x = before->results(0);
    const v1::AttendResult& y = after.results(0);
    ASSERT_EQ(y.kv_heads_size(), 2);
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(y.kv_heads(h), x.kv_heads(h));
      EXPECT_EQ(y.selected(h), reselected_.selected(h));
      EXPECT_EQ(y.selected(h), x.selected(h));
      EXPECT_EQ(y.held(h), x.held(h));
    }
    EXPECT_EQ(y.o().shape_size(), 3);
    EXPECT_EQ(y.o().data(), x.o().data()) << "O differs for " << tokens << " tokens";
    EXPECT_EQ(y.lse().data(), x.lse().data()) << "LSE differs for " << tokens << " tokens";
  }

  // A drops the migrated shards: blocks and bytes come back, layer 1 has no owned head.
  const v1::StatsResponse a_before = a_->Stats();
  v1::ReshardSessionResponse dropped;
  ASSERT_TRUE(a_->ReshardSession(ReshardRequest("s", {}, {{1, 0}, {1, 1}}), &dropped).ok());
  EXPECT_EQ(dropped.blocks_released(), 2 * Blocks(167));
  EXPECT_EQ(dropped.shards(), 2u);
  const v1::StatsResponse a_after = a_->Stats();
  EXPECT_EQ(dropped.free_bytes(), a_after.free_bytes());
  EXPECT_EQ(a_before.blocks_in_use() - a_after.blocks_in_use(), 2 * Blocks(167));
  EXPECT_GT(a_after.free_bytes(), a_before.free_bytes());
  EXPECT_EQ(a_after.stored_bytes(), 2 * 167 * (2 * 64 * 2 + 4u));  // layer 0 only

  for (size_t tokens : {1, 3}) {
    v1::AttendResponse empty;
    ASSERT_TRUE(a_->Attend(AttendOne("s", 1, tokens == 1 ? q1 : q3, tokens, g_), &empty).ok());
    const v1::AttendResult& r = empty.results(0);
    EXPECT_EQ(r.kv_heads_size(), 0);
    EXPECT_EQ(r.selected_size(), 0);
    EXPECT_EQ(r.o().shape(0), static_cast<int64_t>(tokens));
    EXPECT_EQ(r.o().shape(1), 0);
    EXPECT_EQ(r.o().shape(2), 64);
    EXPECT_EQ(r.lse().shape(1), 0);
    EXPECT_TRUE(r.o().data().empty());
  }
  // Layer 0 on A is untouched and still attends.
  v1::AttendResponse layer0;
  ASSERT_TRUE(a_->Attend(AttendOne("s", 0, q1, 1, g_), &layer0).ok());
  EXPECT_EQ(layer0.results(0).held(1), 167u);
  // Writes to a layer A no longer owns are refused; Reselect of it is an empty answer.
  v1::AppendKvResponse totals;
  EXPECT_EQ(a_->AppendKv(AppendRequest("s", 1, entries_[1], 0, 5, 64, true, 64), &totals).code(),
            absl::StatusCode::kInvalidArgument);
  v1::ReselectRequest reselect;
  reselect.set_session_id("s");
  reselect.set_layer(1);
  EncodeF32(q1, std::vector<int64_t>{1, g_.q_heads, g_.head_dim}, reselect.mutable_q());
  v1::ReselectResponse none;
  ASSERT_TRUE(a_->Reselect(reselect, &none).ok());
  EXPECT_EQ(none.kv_heads_size(), 0);

  // Dropping the rest leaves the session open with nothing; CloseSession still works.
  ASSERT_TRUE(a_->ReshardSession(ReshardRequest("s", {}, {{0, 0}, {0, 1}}), &dropped).ok());
  EXPECT_EQ(dropped.shards(), 0u);
  // Only the open session's bookkeeping stays charged (no shard, no block).
  EXPECT_EQ(a_->Stats().used_bytes(), CpuAttentionNode::SessionMetadataBytes(g_.layers, 0));
  EXPECT_EQ(a_->Stats().sessions(), 1u);
  v1::CloseSessionRequest close;
  close.set_session_id("s");
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(a_->CloseSession(close, &closed).ok());
  EXPECT_EQ(closed.blocks_released(), 0u);
  EXPECT_EQ(a_->Stats().sessions(), 0u);
}

// Without the flags (the MAW rule on B) the same import gives another selection: the flags are
// what keeps the migrated shard equal.
TEST_F(MigrationTest, ImportWithoutFlagsWouldDiffer) {
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(b_->OpenSession(OpenWith("s", g_, 2.0f, {{1, 0}, {1, 1}}), &opened).ok());
  v1::AppendKvResponse totals;
  uint64_t selected_by_rule = 0;
  ASSERT_TRUE(a_->ExportShard(ExportRequest("s", 1, 0), [&](const v1::ExportShardChunk& chunk) {
                  v1::AppendKvRequest r = ImportRequest("s", 1, 0, chunk);
                  r.clear_selected();
                  r.set_window_entries(64);
                  return b_->AppendKv(r, &totals);
                }).ok());
  for (float m : entries_[1][0].maw) selected_by_rule += m > 2.0f / 64;
  EXPECT_EQ(totals.entries_selected(), selected_by_rule);
  EXPECT_NE(totals.entries_selected(), reselected_.selected(0));
}

TEST_F(MigrationTest, ReshardSessionErrors) {
  v1::ReshardSessionResponse r;
  auto code = [&](const v1::ReshardSessionRequest& req) {
    return a_->ReshardSession(req, &r).code();
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(ReshardRequest("nobody", {{0, 0}}, {})), absl::StatusCode::kNotFound);
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(a_->OpenSession(OpenWith("t", g_, 0, {{0, 1}}), &opened).ok());
  EXPECT_EQ(code(ReshardRequest("t", {{2, 0}}, {})), kInvalid);          // layer out of range
  EXPECT_EQ(code(ReshardRequest("t", {{0, 2}}, {})), kInvalid);          // head out of range
  EXPECT_EQ(code(ReshardRequest("t", {{1, 0}, {1, 0}}, {})), kInvalid);  // duplicate
  EXPECT_EQ(code(ReshardRequest("t", {{0, 1}}, {})), kInvalid);          // already owned
  EXPECT_EQ(code(ReshardRequest("t", {}, {{0, 0}})), kInvalid);          // not owned
  EXPECT_EQ(code(ReshardRequest("t", {{0, 1}}, {{0, 1}})), kInvalid);    // in both lists
  EXPECT_EQ(code(ReshardRequest("t", {{1, 1}}, {{1, 1}})), kInvalid);    // in both lists
  ShardList too_many;
  for (int i = 0; i < 5; ++i) too_many.push_back({0, 0});  // more than 2 x 2 entries
  EXPECT_EQ(code(ReshardRequest("t", too_many, {})), kInvalid);
  // Nothing changed: "t" still owns (0, 1) only, and an Attend shows it.
  std::mt19937 rng(13);
  const std::vector<float> q = RandomQueries(1, g_, rng);
  v1::AttendResponse resp;
  ASSERT_TRUE(a_->Attend(AttendOne("t", 0, q, 1, g_), &resp).ok());
  ASSERT_EQ(resp.results(0).kv_heads_size(), 1);
  EXPECT_EQ(resp.results(0).kv_heads(0), 1u);
  v1::AttendResponse layer1;
  ASSERT_TRUE(a_->Attend(AttendOne("t", 1, q, 1, g_), &layer1).ok());
  EXPECT_EQ(layer1.results(0).kv_heads_size(), 0);

  // An empty request is a no-op that reports the state.
  ASSERT_TRUE(a_->ReshardSession(ReshardRequest("t", {}, {}), &r).ok());
  EXPECT_EQ(r.shards(), 1u);

  // Draining: adding is UNAVAILABLE (even together with a drop, which then does not happen);
  // dropping alone still works.
  a_->SetDraining(true);
  EXPECT_EQ(code(ReshardRequest("t", {{1, 0}}, {})), absl::StatusCode::kUnavailable);
  EXPECT_EQ(code(ReshardRequest("t", {{1, 0}}, {{0, 1}})), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(a_->ReshardSession(ReshardRequest("t", {}, {{0, 1}}), &r).ok());
  EXPECT_EQ(r.shards(), 0u);
  a_->SetDraining(false);
  ASSERT_TRUE(a_->ReshardSession(ReshardRequest("t", {{1, 0}}, {}), &r).ok());
  EXPECT_EQ(r.shards(), 1u);
}

TEST_F(MigrationTest, ExportShardRangesErrorsAndChunks) {
  const uint64_t held = entries_[1][1].n();  // 167
  std::vector<v1::ExportShardChunk> chunks;
  auto collect = [&](const v1::ExportShardChunk& c) {
    chunks.push_back(c);
    return absl::OkStatus();
  };
  auto code = [&](const v1::ExportShardRequest& req) {
    chunks.clear();
    return a_->ExportShard(req, collect).code();
  };
  EXPECT_EQ(code(ExportRequest("nobody", 1, 1)), absl::StatusCode::kNotFound);
  EXPECT_EQ(code(ExportRequest("s", 2, 0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(ExportRequest("s", 0, 2)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(ExportRequest("s", 1, 1, held + 1)), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(code(ExportRequest("s", 1, 1, 0, held + 1)), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(code(ExportRequest("s", 1, 1, 10, 5)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(ExportRequest("s", 1, 1, 0, 0, 65537)), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(chunks.empty());
  // from == to: no chunk. from == held with to 0 (= held): no chunk.
  EXPECT_EQ(code(ExportRequest("s", 1, 1, 20, 20)), absl::StatusCode::kOk);
  EXPECT_TRUE(chunks.empty());
  EXPECT_EQ(code(ExportRequest("s", 1, 1, held, 0)), absl::StatusCode::kOk);
  EXPECT_TRUE(chunks.empty());

  // [5, 100) in chunks of 7: 14 chunks, the entries as appended (bf16 K/V, f32 MAW) and the
  // flags as Reselect left them.
  ASSERT_EQ(code(ExportRequest("s", 1, 1, 5, 100, 7)), absl::StatusCode::kOk);
  ASSERT_EQ(chunks.size(), 14u);
  uint64_t next = 5, selected = 0;
  for (const v1::ExportShardChunk& c : chunks) {
    ASSERT_EQ(c.first_entry(), next);
    const uint32_t n = c.num_entries();
    EXPECT_EQ(n, std::min<uint64_t>(7, 100 - next));
    EXPECT_EQ(c.held(), held);
    EXPECT_EQ(c.k().dtype(), v1::DTYPE_BF16);
    EXPECT_EQ(std::vector<int64_t>(c.k().shape().begin(), c.k().shape().end()),
              (std::vector<int64_t>{n, 64}));
    EXPECT_EQ(std::vector<int64_t>(c.maw().shape().begin(), c.maw().shape().end()),
              (std::vector<int64_t>{n}));
    ASSERT_EQ(c.selected().size(), n);
    std::vector<float> k, v, maw;
    const int64_t kv_shape[] = {n, 64};
    const int64_t maw_shape[] = {n};
    ASSERT_TRUE(DecodeFloats(c.k(), "k", kv_shape, true, &k).ok());
    ASSERT_TRUE(DecodeFloats(c.v(), "v", kv_shape, true, &v).ok());
    ASSERT_TRUE(DecodeFloats(c.maw(), "maw", maw_shape, true, &maw).ok());
    const HeadEntries& e = entries_[1][1];
    for (uint32_t i = 0; i < n; ++i) {
      EXPECT_EQ(maw[i], e.maw[next + i]);
      for (uint32_t d = 0; d < 64; ++d) {
        ASSERT_EQ(k[i * 64 + d], e.k[(next + i) * 64 + d]);  // bf16-exact test data
        ASSERT_EQ(v[i * 64 + d], e.v[(next + i) * 64 + d]);
      }
      ASSERT_LE(static_cast<uint8_t>(c.selected()[i]), 1);
      selected += c.selected()[i];
    }
    next += n;
  }
  EXPECT_EQ(next, 100u);
  // The whole shard in one chunk carries as many selected flags as Attend reports.
  ASSERT_EQ(code(ExportRequest("s", 1, 1)), absl::StatusCode::kOk);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(static_cast<uint64_t>(
                std::count(chunks[0].selected().begin(), chunks[0].selected().end(), 1)),
            reselected_.selected(1));
  EXPECT_GT(selected, 0u);

  // The byte cap: 64 dims of bf16 = 2 x 128 + 5 bytes per entry, so 1000 bytes hold 3.
  auto capped = a_->StartExport(ExportRequest("s", 1, 1, 0, 0, 100), 1000);
  ASSERT_TRUE(capped.ok()) << capped.status();
  EXPECT_EQ(capped->chunk_entries(), 3u);
  auto defaulted = a_->StartExport(ExportRequest("s", 1, 1));
  ASSERT_TRUE(defaulted.ok());
  EXPECT_EQ(defaulted->chunk_entries(), 4096u);
  EXPECT_EQ(defaulted->end_entry(), held);
}

// Each chunk is read under the shared lock alone: writes go through between chunks, and a
// dropped shard or a closed session ends the export.
TEST_F(MigrationTest, ExportSeesChangesBetweenChunks) {
  auto e = a_->StartExport(ExportRequest("s", 1, 0, 0, 0, 50));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->end_entry(), 167u);
  v1::ExportShardChunk chunk;
  ASSERT_TRUE(e->Next(&chunk).ok());
  EXPECT_EQ(chunk.num_entries(), 50u);
  // An append between chunks (needs the exclusive lock) goes through; the range stays fixed.
  v1::AppendKvResponse totals;
  std::mt19937 rng(14);
  std::vector<HeadEntries> more(2);
  AddRandomEntries(more, 9, 64, true, 1.0f / 64, rng);
  ASSERT_TRUE(a_->AppendKv(AppendRequest("s", 1, more, 0, 9, 64, true, 64), &totals).ok());
  ASSERT_TRUE(e->Next(&chunk).ok());
  EXPECT_EQ(chunk.first_entry(), 50u);
  EXPECT_EQ(chunk.held(), 176u);
  // The shard dropped (and even added back empty): ABORTED.
  v1::ReshardSessionResponse r;
  ASSERT_TRUE(a_->ReshardSession(ReshardRequest("s", {}, {{1, 0}}), &r).ok());
  EXPECT_EQ(e->Next(&chunk).code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(a_->ReshardSession(ReshardRequest("s", {{1, 0}}, {}), &r).ok());
  EXPECT_EQ(e->Next(&chunk).code(), absl::StatusCode::kAborted);
  // Another export of a live shard, then the session closed: NOT_FOUND.
  auto f = a_->StartExport(ExportRequest("s", 1, 1, 0, 0, 100));
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->Next(&chunk).ok());
  v1::CloseSessionRequest close;
  close.set_session_id("s");
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(a_->CloseSession(close, &closed).ok());
  EXPECT_EQ(f->Next(&chunk).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a_->Stats().used_bytes(), 0u);
}

TEST_F(MigrationTest, AppendKvSelectedFlagsAreValidated) {
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(b_->OpenSession(OpenWith("s", g_, 1e9f, {{1, 0}, {1, 1}}), &opened).ok());
  v1::AppendKvRequest r = AppendRequest("s", 1, entries_[1], 0, 10, 64, true, 64);
  r.set_window_entries(0);
  std::string flags(20, '\1');
  flags[3] = '\0';
  flags[12] = '\0';
  v1::AppendKvResponse totals;
  r.set_selected(flags.substr(0, 19));  // one short of 2 heads x 10 tokens
  EXPECT_EQ(b_->AppendKv(r, &totals).code(), absl::StatusCode::kInvalidArgument);
  std::string two = flags;
  two[7] = '\2';
  r.set_selected(two);
  EXPECT_EQ(b_->AppendKv(r, &totals).code(), absl::StatusCode::kInvalidArgument);
  r.clear_selected();  // window_entries 0 without flags
  EXPECT_EQ(b_->AppendKv(r, &totals).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->Stats().stored_bytes(), 0u);
  // Valid flags select what they say, whatever MAW and beta (1e9 would select nothing).
  r.set_selected(flags);
  ASSERT_TRUE(b_->AppendKv(r, &totals).ok());
  EXPECT_EQ(totals.entries_appended(), 20u);
  EXPECT_EQ(totals.entries_selected(), 18u);
  std::mt19937 rng(15);
  v1::AttendResponse resp;
  ASSERT_TRUE(b_->Attend(AttendOne("s", 1, RandomQueries(1, g_, rng), 1, g_), &resp).ok());
  EXPECT_EQ(resp.results(0).selected(0), 9u);
  EXPECT_EQ(resp.results(0).selected(1), 9u);
}

// Attend, export and reshard of the same session from several threads: every call sees a
// consistent shard set (one of the two states), nothing fails that should not.
TEST_F(MigrationTest, ReshardExportAndAttendConcurrently) {
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0}, attends{0}, exports{0}, reshards{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      const std::vector<float> q = RandomQueries(2, g_, rng);
      while (!stop.load()) {
        v1::AttendResponse resp;
        if (!a_->Attend(AttendOne("s", 1, q, 2, g_), &resp).ok()) ++errors;
        const v1::AttendResult& r = resp.results(0);
        const int heads = r.kv_heads_size();
        if (heads < 1 || heads > 2 || r.kv_heads(heads - 1) != 1u || r.held(heads - 1) != 167u ||
            r.o().shape(1) != heads * 4) {
          ++errors;
        }
        ++attends;
      }
    });
  }
  threads.emplace_back([&] {
    while (!stop.load()) {
      uint64_t entries = 0;
      const absl::Status s =
          a_->ExportShard(ExportRequest("s", 1, 1, 0, 0, 40), [&](const v1::ExportShardChunk& c) {
            entries += c.num_entries();
            return absl::OkStatus();
          });
      if (!s.ok() || entries != 167) ++errors;
      ++exports;
    }
  });
  threads.emplace_back([&] {
    std::mt19937 rng(7);
    std::vector<HeadEntries> one(1);
    AddRandomEntries(one, 20, 64, true, 1.0f / 64, rng);
    v1::AppendKvRequest append = AppendRequest("s", 1, one, 0, 20, 64, true, 64);
    append.add_kv_heads(0);
    // Reshard only once the readers run (a loaded machine may not have scheduled them yet).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((attends.load() == 0 || exports.load() == 0) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    for (int i = 0; i < 50; ++i) {
      v1::ReshardSessionResponse r;
      v1::AppendKvResponse totals;
      if (!a_->ReshardSession(ReshardRequest("s", {}, {{1, 0}}), &r).ok()) ++errors;
      if (!a_->ReshardSession(ReshardRequest("s", {{1, 0}}, {}), &r).ok()) ++errors;
      if (!a_->AppendKv(append, &totals).ok()) ++errors;
      ++reshards;
    }
    stop.store(true);
  });
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(reshards.load(), 50);
  EXPECT_GT(attends.load(), 0);
  EXPECT_GT(exports.load(), 0);
  // The last state: head 0 re-added with the 20 entries appended after it.
  v1::AttendResponse resp;
  std::mt19937 rng(8);
  ASSERT_TRUE(a_->Attend(AttendOne("s", 1, RandomQueries(1, g_, rng), 1, g_), &resp).ok());
  ASSERT_EQ(resp.results(0).kv_heads_size(), 2);
  EXPECT_EQ(resp.results(0).held(0), 20u);
  EXPECT_EQ(resp.results(0).held(1), 167u);
}

TEST(NodeDraining, RefusesNewSessionsAndReportsStats) {
  auto a = MakeNode(1);
  auto b = MakeNode(1);
  const v1::StatsResponse sa = a->Stats();
  const v1::StatsResponse sb = b->Stats();
  ASSERT_EQ(sa.node_id().size(), 16u);
  EXPECT_EQ(sa.node_id().find_first_not_of("0123456789abcdef"), std::string::npos) << sa.node_id();
  EXPECT_NE(sa.node_id(), sb.node_id());
  EXPECT_EQ(sa.node_id(), a->Stats().node_id());  // fixed for the node's life
  EXPECT_FALSE(sa.draining());
  EXPECT_EQ(sa.free_bytes(), 64ull << 20);

  Geometry g{1, 4, 1, 64};
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(a->OpenSession(OpenRequest("s", g, kBlock, true, 0), &opened).ok());
  std::mt19937 rng(16);
  std::vector<HeadEntries> entries(1);
  AddRandomEntries(entries, 40, 64, true, 1e-2f, rng);
  v1::AppendKvResponse totals;
  ASSERT_TRUE(a->AppendKv(AppendRequest("s", 0, entries, 0, 40, 64, true, 64), &totals).ok());
  v1::StatsResponse loaded = a->Stats();
  EXPECT_EQ(loaded.free_bytes(), loaded.capacity_bytes() - loaded.used_bytes());
  // opened.free_bytes() already had the session's bookkeeping charged.
  EXPECT_EQ(loaded.free_bytes(), opened.free_bytes() - (loaded.used_bytes() -
                                                        CpuAttentionNode::SessionMetadataBytes(1, 1)));
  EXPECT_GT(loaded.used_bytes(), 3 * opened.bytes_per_block() - 1);

  a->SetDraining(true);
  EXPECT_TRUE(a->draining());
  EXPECT_TRUE(a->Stats().draining());
  const absl::Status refused = a->OpenSession(OpenRequest("t", g, kBlock, true, 0), &opened);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("draining"), std::string::npos) << refused;
  // Everything else keeps working while draining.
  ASSERT_TRUE(a->AppendKv(AppendRequest("s", 0, entries, 0, 10, 64, true, 64), &totals).ok());
  v1::AttendResponse resp;
  ASSERT_TRUE(a->Attend(AttendOne("s", 0, RandomQueries(1, g, rng), 1, g), &resp).ok());
  EXPECT_EQ(resp.results(0).held(0), 50u);
  std::vector<v1::ExportShardChunk> chunks;
  ASSERT_TRUE(a->ExportShard(testing::ExportRequest("s", 0, 0), [&](const v1::ExportShardChunk& c) {
                 chunks.push_back(c);
                 return absl::OkStatus();
               }).ok());
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].num_entries(), 50u);
  v1::CloseSessionRequest close;
  close.set_session_id("s");
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(a->CloseSession(close, &closed).ok());
  EXPECT_EQ(a->Stats().sessions(), 0u);
  EXPECT_EQ(a->Stats().free_bytes(), 64ull << 20);
  a->SetDraining(false);
  EXPECT_FALSE(a->Stats().draining());
  EXPECT_TRUE(a->OpenSession(OpenRequest("t", g, kBlock, true, 0), &opened).ok());
}

}  // namespace
}  // namespace tandem::cpu_attention
