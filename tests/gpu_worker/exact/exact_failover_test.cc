// The served exact mode through a lost CPU node (exact_rebuild.h; issue 16): Engine::Generate on
// stories260k, the split forced to half fetched / half on two CPU attention servers on loopback
// ports. A server killed mid-decode (from the token callback) makes that turn's response
// degraded; the engine rebuilds between steps (RebuildLostKv -> ExactTier::Rebuild: the lost
// shards on the survivor, the degraded steps' positions repaired), so the kept session's next
// turn is not degraded and gives the tokens gpu mode gives for the same history. A server
// killed between turns is noticed at the next turn (RemoteKv::CheckNodes) and rebuilt before
// its first pass: no degraded step at all, gpu's tokens.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "../engine/engine_test_util.h"
#include "absl/strings/str_cat.h"
#include "loopback_node.h"
#include "tandem/cpu_attention/server.h"
#include "tandem/gpu_worker/engine.h"

namespace tandem::gpu_worker {
namespace {

class ExactFailover : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_MODEL("stories260k");
    TANDEM_SKIP_WITHOUT_BACKEND();
    EngineOptions options;
    options.model_dir = testing::ModelDir("stories260k").string();
    options.backend = testing::TestBackendName();
    for (int i = 0; i < 2; ++i) {
      nodes_.push_back(testing::StartLoopbackNode());
      ASSERT_NE(nodes_.back(), nullptr);
      options.nodes.addresses.push_back(absl::StrCat("127.0.0.1:", nodes_.back()->port()));
    }
    options.nodes.transport = NodeTransport::kGrpc;
    options.nodes.probe_ms = 100;
    options.nodes.probe_deadline_ms = 300;
    options.default_window = 32;
    options.offload_page_tokens = 32;
    options.exact_fetch_share = 0.5;
    auto engine = Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  static std::vector<int32_t> Prompt(int first, int n) {
    std::vector<int32_t> ids;
    for (int i = 0; i < n; ++i) ids.push_back(1 + (first + i * 37) % 500);
    return ids;
  }

  GenerateRequest Request(AttentionMode mode, const std::string& session,
                          std::vector<int32_t> prompt, int max_tokens) const {
    GenerateRequest r;
    r.prompt_ids = std::move(prompt);
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.mode = mode;
    r.session_id = session;
    return r;
  }

  // Gpu mode's tokens for the whole history of a kept session (its turns' prompts and outputs,
  // the last output fed at the next turn) followed by `prompt`.
  std::vector<int32_t> GpuTokens(const std::vector<int32_t>& history,
                                 const std::vector<int32_t>& prompt, int max_tokens) {
    std::vector<int32_t> all = history;
    all.insert(all.end(), prompt.begin(), prompt.end());
    auto gpu = engine_->Generate(Request(AttentionMode::kGpu, "", all, max_tokens));
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    return gpu.ok() ? gpu->token_ids : std::vector<int32_t>{};
  }

  std::vector<std::unique_ptr<cpu_attention::CpuAttentionServer>> nodes_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(ExactFailover, NodeKilledMidDecodeDegradesThatTurnThenTheSessionIsExactAgain) {
  std::vector<int32_t> history = Prompt(0, 150);
  GenerateCallbacks kill;
  kill.on_token = [&](const TokenEvent& e) {
    if (e.index == 10) nodes_[1].reset();
    return true;
  };
  auto first = engine_->Generate(Request(AttentionMode::kExact, "e", history, 60), kill);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(nodes_[1], nullptr);
  // The node's shutdown is announced: when the pool hears of it before the next step's attend,
  // the session is rebuilt at the end of the killing step and no attend reaches the dead node
  // (a race with the pool's membership thread). The turn then stayed exact; otherwise the steps
  // through the kill are degraded.
  if (first->degraded) {
    EXPECT_GT(first->degraded_steps, 0u);
  } else {
    EXPECT_EQ(first->token_ids, GpuTokens({}, history, 60)) << "neither degraded nor exact";
  }
  history.insert(history.end(), first->token_ids.begin(), first->token_ids.end());

  const std::vector<int32_t> prompt = Prompt(11, 30);
  auto second = engine_->Generate(Request(AttentionMode::kExact, "e", prompt, 40));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(second->degraded);
  EXPECT_EQ(second->degraded_steps, 0u);
  EXPECT_EQ(second->token_ids, GpuTokens(history, prompt, 40));
  ASSERT_TRUE(second->exact_split.has_value());
  EXPECT_GT(second->exact_split->node_entries, 0) << "rebuilt on the survivor";
  EXPECT_TRUE(engine_->CloseSession("e").ok());
  EXPECT_EQ(nodes_[0]->node().Stats().sessions(), 0u);
}

TEST_F(ExactFailover, NodeKilledBetweenTurnsIsRebuiltBeforeTheNextTurn) {
  std::vector<int32_t> history = Prompt(5, 150);
  auto first = engine_->Generate(Request(AttentionMode::kExact, "e", history, 30));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->degraded);
  EXPECT_EQ(first->token_ids, GpuTokens({}, history, 30));
  history.insert(history.end(), first->token_ids.begin(), first->token_ids.end());
  nodes_[0].reset();
  const std::vector<int32_t> prompt = Prompt(23, 30);
  auto second = engine_->Generate(Request(AttentionMode::kExact, "e", prompt, 40));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(second->degraded);
  EXPECT_EQ(second->token_ids, GpuTokens(history, prompt, 40));
  EXPECT_TRUE(engine_->CloseSession("e").ok());
}

}  // namespace
}  // namespace tandem::gpu_worker
