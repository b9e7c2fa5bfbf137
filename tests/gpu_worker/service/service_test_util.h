// Helpers shared by the Generation service tests: the stories260k reference (golden.json), a
// Generate stream collected into one result, and the grpc.health.v1 check.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "health_check.h"
#include "tandem/v1/generation.grpc.pb.h"

namespace tandem::gpu_worker::testing {

inline std::filesystem::path Stories260kDir() {
  return std::filesystem::path(TANDEM_SHARED_DIR) / "models" / "stories260k";
}

// golden.json of stories260k: greedy_ids = BOS + 60 greedy tokens of full attention in fp32;
// "Once upon a time" tokenizes (with BOS) to greedy_ids[0:5].
struct Golden {
  std::vector<int32_t> greedy_ids;
  std::string greedy_text;
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;  // prompt_text with BOS

  // greedy_ids[first, last)
  std::vector<int32_t> Ids(size_t first, size_t last) const {
    return std::vector<int32_t>(greedy_ids.begin() + first, greedy_ids.begin() + last);
  }
};

// False (and nothing loaded) when the shared models are absent.
inline bool LoadGolden(Golden* golden) {
  std::ifstream in(Stories260kDir() / "golden.json");
  if (!in) return false;
  const nlohmann::json j = nlohmann::json::parse(in);
  golden->greedy_ids = j.at("greedy_ids").get<std::vector<int32_t>>();
  golden->greedy_text = j.at("greedy_text").get<std::string>();
  golden->prompt_text = j.at("prompt_text_equivalent").get<std::string>();
  golden->prompt_ids = j.at("prompt_text_equivalent_ids").get<std::vector<int32_t>>();
  return true;
}

inline std::unique_ptr<grpc::ClientContext> Deadline(int ms = 60000) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
  return ctx;
}

// One Generate call, as the client saw it.
struct Stream {
  grpc::Status status;
  std::vector<v1::PrefillProgress> prefill;
  std::vector<int32_t> ids;  // token ids by index (a repeated index adds text only)
  std::string text;          // every delta's text, concatenated
  int finals = 0;
  v1::GenerateFinal final;
  bool prefill_after_token = false;  // a prefill message arrived after a token
  bool bad_index = false;            // an index neither new (== ids.size()) nor a repeat
};

// Runs `request`; with `cancel_after_tokens` > 0 the client cancels after that many tokens.
inline Stream Generate(v1::Generation::Stub& stub, const v1::GenerateRequest& request,
                       int cancel_after_tokens = 0) {
  Stream s;
  auto ctx = Deadline(120000);
  auto reader = stub.Generate(ctx.get(), request);
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
    switch (message.event_case()) {
      case v1::GenerateResponse::kPrefill:
        if (!s.ids.empty()) s.prefill_after_token = true;
        s.prefill.push_back(message.prefill());
        break;
      case v1::GenerateResponse::kToken: {
        const v1::TokenDelta& t = message.token();
        if (t.index() == static_cast<int64_t>(s.ids.size())) {
          s.ids.push_back(t.token_id());
        } else if (s.ids.empty() || t.index() != static_cast<int64_t>(s.ids.size()) - 1 ||
                   t.token_id() != s.ids.back()) {
          s.bad_index = true;
        }
        s.text += t.text();
        if (cancel_after_tokens > 0 && static_cast<int>(s.ids.size()) >= cancel_after_tokens) {
          ctx->TryCancel();
        }
        break;
      }
      case v1::GenerateResponse::kFinal:
        ++s.finals;
        s.final = message.final();
        break;
      case v1::GenerateResponse::EVENT_NOT_SET:
        break;
    }
  }
  s.status = reader->Finish();
  return s;
}

inline v1::GenerateRequest TextRequest(const std::string& prompt, int64_t max_tokens,
                                       const std::string& mode) {
  v1::GenerateRequest r;
  r.set_prompt_text(prompt);
  r.set_max_tokens(max_tokens);
  r.set_mode(mode);
  return r;
}

// grpc.health.v1.Health/Check: the serialized response ("\x08\x01" is SERVING), or "" on an
// RPC error.
inline std::string HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                               const std::string& service) {
  return test_health::HealthCheckBytes(channel, service).value_or("");
}

}  // namespace tandem::gpu_worker::testing
