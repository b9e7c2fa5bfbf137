// tandem-gateway end to end: the real tandem-cpu-attention, tandem-gpu-worker (cpu backend,
// stories260k, hybrid attention over the node) and tandem-gateway binaries on loopback ports;
// curl and the npm openai client as the HTTP clients. Texts are checked against the worker's own
// gRPC answer for the same greedy request, whose ids are checked against golden.json.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "child_process.h"
#include "promtool.h"
#include "service_test_util.h"

namespace tandem::gateway {
namespace {

using gpu_worker::testing::Golden;
using test_process::ChildProcess;
using test_process::CommandResult;
using test_process::RunCommand;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// The rendering of [{user: "Once upon a time"}] with chatml.jinja and a generation prompt.
constexpr char kChatPrompt[] =
    "<|im_start|>user\nOnce upon a time<|im_end|>\n<|im_start|>assistant\n";

class GatewayE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_worker::testing::LoadGolden(&golden_)) {
      GTEST_SKIP() << "stories260k not found under " << gpu_worker::testing::Stories260kDir();
    }
    auto node = ChildProcess::Start({TANDEM_CPU_ATTENTION_BIN, "--address=127.0.0.1:0",
                                     "--pool_bytes=64MiB", "--threads=1", "--executor_threads=2",
                                     "--log_level=warn"});
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = std::move(*node);
    absl::StatusOr<int> node_port = node_->WaitListening();
    ASSERT_TRUE(node_port.ok()) << node_port.status();
    auto worker = ChildProcess::Start(
        {TANDEM_GPU_WORKER_BIN, "--model=" + gpu_worker::testing::Stories260kDir().string(),
         "--address=127.0.0.1:0", "--backend=cpu", "--cpu_threads=2", "--prefill_chunk=64",
         "--mode=hybrid", "--window=32", "--sink=4", "--selection=maw", "--beta=0",
         absl::StrCat("--cpu_nodes=127.0.0.1:", *node_port), "--log_level=warn"});
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = std::move(*worker);
    absl::StatusOr<int> worker_port = worker_->WaitListening();
    ASSERT_TRUE(worker_port.ok()) << worker_port.status();
    worker_address_ = absl::StrCat("127.0.0.1:", *worker_port);
    stub_ = v1::Generation::NewStub(
        grpc::CreateChannel(worker_address_, grpc::InsecureChannelCredentials()));
    StartGateway(
        {"--workers=" + worker_address_, std::string("--chat_template=") + TANDEM_GATEWAY_CHATML});
  }

  void StartGateway(std::vector<std::string> flags) {
    std::vector<std::string> argv = {TANDEM_GATEWAY_BIN, "--address=127.0.0.1:0",
                                     "--log_level=warn"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto gateway = ChildProcess::Start(argv);
    ASSERT_TRUE(gateway.ok()) << gateway.status();
    gateway_ = std::move(*gateway);
    absl::StatusOr<int> port = gateway_->WaitListening();
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
    url_ = absl::StrCat("http://127.0.0.1:", port_);
  }

  void TearDown() override {
    if (gateway_ != nullptr) {
      absl::StatusOr<int> code = gateway_->Terminate();
      ASSERT_TRUE(code.ok()) << code.status();
      EXPECT_EQ(*code, 0) << "tandem-gateway exit status after SIGTERM";
    }
  }

  // The worker's own answer to a greedy prompt_text request (the reference).
  gpu_worker::testing::Stream Direct(const std::string& prompt, int64_t max_tokens) {
    v1::GenerateRequest r;
    r.set_prompt_text(prompt);
    r.set_max_tokens(max_tokens);
    return gpu_worker::testing::Generate(*stub_, r);
  }

  int64_t DirectTokenCount(const std::string& text) {
    v1::TokenizeRequest r;
    r.set_text(text);
    r.set_add_bos(false);
    v1::TokenizeResponse response;
    const grpc::Status s = stub_->Tokenize(gpu_worker::testing::Deadline().get(), r, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.count();
  }

  CommandResult Curl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"/usr/bin/curl", "-sS", "--max-time", "60"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<CommandResult> r = RunCommand(argv);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : CommandResult{};
  }

  CommandResult CurlPost(const std::string& path, const Json& body, bool stream) {
    std::vector<std::string> args;
    if (stream) args.push_back("-N");
    for (const char* a : {"-X", "POST", "-H", "Content-Type: application/json", "-d"})
      args.push_back(a);
    args.push_back(body.dump());
    args.push_back(url_ + path);
    return Curl(args);
  }

  Golden golden_;
  std::unique_ptr<ChildProcess> node_, worker_, gateway_;
  std::string worker_address_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  int port_ = 0;
  std::string url_;
};

// The `data:` payloads of an SSE body, in order; every line is data, a comment or blank.
std::vector<std::string> SseData(const std::string& body, std::vector<std::string>* comments) {
  std::vector<std::string> data;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (absl::StartsWith(line, "data: ")) {
      data.emplace_back(line.substr(6));
    } else if (absl::StartsWith(line, ": ")) {
      if (comments != nullptr) comments->emplace_back(line.substr(2));
    } else {
      EXPECT_TRUE(line.empty()) << "unexpected SSE line: " << line;
    }
  }
  return data;
}

TEST_F(GatewayE2eTest, CurlCompletionEqualsTheWorkersGreedyText) {
  const gpu_worker::testing::Stream reference = Direct(golden_.prompt_text, 40);
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  ASSERT_THAT(reference.ids, ::testing::ElementsAreArray(golden_.Ids(5, 45)));

  CommandResult r = CurlPost("/v1/completions",
                             {{"model", "stories260k"},
                              {"prompt", golden_.prompt_text},
                              {"max_tokens", 40},
                              {"temperature", 0}},
                             false);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Json j = Json::parse(r.out);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "stories260k");
  EXPECT_EQ(j["choices"][0]["text"], reference.text);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"], Json({{"prompt_tokens", 5},
                              {"completion_tokens", 40},
                              {"total_tokens", 45},
                              {"prompt_tokens_details", {{"cached_tokens", 0}}},
                              {"degraded_steps", 0}}));
  // tandem's mark: no step ran without a CPU node's answer.
  EXPECT_EQ(j["tandem"], Json({{"degraded", false}, {"degraded_steps", 0}, {"mode", "hybrid"}}));
}

// The prefix cache through HTTP: a prompt resent with a new ending reports the reused part in
// usage.prompt_tokens_details.cached_tokens and gives the text of a cold run (the same request
// under another cache_salt, which never shares a cached prefix).
TEST_F(GatewayE2eTest, AResentPromptReportsCachedTokensAndTheColdRunsText) {
  const std::string document =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park with her friends. One day, she saw a big red ball";
  auto complete = [&](const std::string& prompt, const std::string& salt) {
    Json body = {{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}};
    if (!salt.empty()) body["cache_salt"] = salt;
    CommandResult r = CurlPost("/v1/completions", body, false);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return Json::parse(r.out);
  };
  const Json first = complete(document + ".", "");
  ASSERT_TRUE(first.contains("usage")) << first.dump();
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const Json second = complete(document + " and a small dog.", "");
  const Json cold = complete(document + " and a small dog.", "another tenant");
  ASSERT_TRUE(second.contains("usage")) << second.dump();
  const int64_t cached = second["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GE(cached, 16);
  EXPECT_LT(cached, second["usage"]["prompt_tokens"].get<int64_t>());
  EXPECT_EQ(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(second["usage"]["prompt_tokens"], cold["usage"]["prompt_tokens"]);
  EXPECT_EQ(second["choices"][0]["text"], cold["choices"][0]["text"]);
  // A salt longer than the gateway takes is refused naming the field.
  CommandResult r = CurlPost(
      "/v1/completions",
      {{"prompt", document}, {"max_tokens", 1}, {"cache_salt", std::string(200, 's')}}, false);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Json::parse(r.out)["error"]["param"], "cache_salt") << r.out;
}

// top_p 0 keeps only the most probable token (OpenAI): at temperature 1, any seed gives the
// greedy text.
TEST_F(GatewayE2eTest, TopPZeroIsGreedyWhateverTheSeed) {
  const gpu_worker::testing::Stream reference = Direct(golden_.prompt_text, 12);
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  for (int seed : {1, 2, 3}) {
    CommandResult r = CurlPost("/v1/completions",
                               {{"prompt", golden_.prompt_text},
                                {"max_tokens", 12},
                                {"temperature", 1},
                                {"top_p", 0},
                                {"seed", seed}},
                               false);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(Json::parse(r.out)["choices"][0]["text"], reference.text) << "seed " << seed;
  }
}

TEST_F(GatewayE2eTest, CurlStreamsAChatCompletionAsSse) {
  const Json body = {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                     {"max_tokens", 24},
                     {"temperature", 0}};
  CommandResult whole = CurlPost("/v1/chat/completions", body, false);
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const Json answer = Json::parse(whole.out);
  ASSERT_EQ(answer["object"], "chat.completion") << whole.out;
  const int64_t prompt_tokens = DirectTokenCount(kChatPrompt);
  EXPECT_EQ(answer["usage"]["prompt_tokens"], prompt_tokens);

  Json streamed_body = body;
  streamed_body["stream"] = true;
  streamed_body["stream_options"] = {{"include_usage", true}};
  CommandResult r = CurlPost("/v1/chat/completions", streamed_body, true);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> comments;
  const std::vector<std::string> data = SseData(r.out, &comments);
  ASSERT_GE(data.size(), 4u) << r.out;
  EXPECT_EQ(data.back(), "[DONE]");
  const Json first = Json::parse(data.front());
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  std::string content;
  std::string finish;
  for (size_t i = 0; i + 2 < data.size(); ++i) {
    const Json chunk = Json::parse(data[i]);
    EXPECT_EQ(chunk["id"], first["id"]);
    EXPECT_TRUE(chunk["usage"].is_null());
    ASSERT_EQ(chunk["choices"].size(), 1u);
    content += chunk["choices"][0]["delta"].value("content", "");
    if (!chunk["choices"][0]["finish_reason"].is_null())
      finish = chunk["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(content, answer["choices"][0]["message"]["content"]);
  EXPECT_EQ(finish, answer["choices"][0]["finish_reason"]);
  const Json usage_chunk = Json::parse(data[data.size() - 2]);
  EXPECT_EQ(usage_chunk["choices"], Json::array());
  // The same prompt again: the prefix cache serves all of it but the last token (one is left
  // to feed), which is the only prefill progress reported.
  Json usage = usage_chunk["usage"];
  EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], prompt_tokens - 1);
  EXPECT_EQ(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  usage["prompt_tokens_details"]["cached_tokens"] = 0;
  EXPECT_EQ(usage, answer["usage"]);
  ASSERT_FALSE(comments.empty());
  EXPECT_EQ(comments.back(), "prefill 1/1");
}

TEST_F(GatewayE2eTest, PrefillProgressChunksOnRequest) {
  // 150 prompt tokens in chunks of 64: progress 64, 128, 150.
  std::vector<int> ids(150);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = golden_.greedy_ids[i % golden_.greedy_ids.size()];
  CommandResult r = CurlPost(
      "/v1/completions",
      {{"prompt", ids}, {"max_tokens", 2}, {"stream", true}, {"return_progress", true}}, true);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> comments;
  std::vector<int64_t> processed;
  for (const std::string& d : SseData(r.out, &comments)) {
    if (d == "[DONE]") continue;
    const Json chunk = Json::parse(d);
    if (chunk.contains("prompt_progress")) {
      EXPECT_EQ(chunk["prompt_progress"]["total"], 150);
      processed.push_back(chunk["prompt_progress"]["processed"]);
    }
  }
  EXPECT_THAT(processed, ::testing::ElementsAre(64, 128, 150));
  EXPECT_THAT(comments,
              ::testing::ElementsAre("prefill 64/150", "prefill 128/150", "prefill 150/150"));
}

TEST_F(GatewayE2eTest, NpmOpenAiClient) {
  const std::filesystem::path npm_dir = TANDEM_GATEWAY_NPM_DIR;
  if (!std::filesystem::exists(npm_dir / "node_modules" / "openai" / "package.json")) {
    GTEST_SKIP() << "the npm openai package is not installed in " << npm_dir
                 << " (scripts/setup.sh runs npm ci there)";
  }
  absl::StatusOr<CommandResult> node_version = RunCommand({"/usr/bin/env", "node", "--version"});
  if (!node_version.ok() || node_version->exit_code != 0) GTEST_SKIP() << "node is not installed";

  const gpu_worker::testing::Stream reference = Direct(golden_.prompt_text, 40);
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  absl::StatusOr<CommandResult> r =
      RunCommand({"/usr/bin/env", "GATEWAY_URL=" + url_, "EXPECTED_COMPLETION=" + reference.text,
                  absl::StrCat("CHAT_PROMPT_TOKENS=", DirectTokenCount(kChatPrompt)), "node",
                  (npm_dir / "openai_e2e.mjs").string()});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("ALL OK"));
}

// The Responses API with openai's responses.create and the Vercel AI SDK's default provider
// (npm/responses_e2e.mjs says what it checks).
TEST_F(GatewayE2eTest, NpmResponsesApiClients) {
  const std::filesystem::path npm_dir = TANDEM_GATEWAY_NPM_DIR;
  if (!std::filesystem::exists(npm_dir / "node_modules" / "@ai-sdk" / "openai" / "package.json")) {
    GTEST_SKIP() << "the npm packages are not installed in " << npm_dir
                 << " (scripts/setup.sh runs npm ci there)";
  }
  absl::StatusOr<CommandResult> node_version = RunCommand({"/usr/bin/env", "node", "--version"});
  if (!node_version.ok() || node_version->exit_code != 0) GTEST_SKIP() << "node is not installed";
  absl::StatusOr<CommandResult> r =
      RunCommand({"/usr/bin/env", "GATEWAY_URL=" + url_,
                  absl::StrCat("CHAT_PROMPT_TOKENS=", DirectTokenCount(kChatPrompt)), "node",
                  (npm_dir / "responses_e2e.mjs").string()});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("ALL OK"));
}

TEST_F(GatewayE2eTest, ErrorsInOpenAisShapeWithTheirHttpStatus) {
  httplib::Client http("127.0.0.1", port_);
  auto post = [&](const std::string& path, const std::string& body) {
    auto res = http.Post(path, body, "application/json");
    EXPECT_TRUE(res) << path;
    return res;
  };
  struct Case {
    std::string path, body;
    int status;
    std::string type, param, message_part;
  };
  const std::vector<Case> cases = {
      {"/v1/completions", R"({"prompt": "x", "n": 2})", 400, "invalid_request_error", "n",
       "'n' must be 1"},
      {"/v1/completions", "{not json", 400, "invalid_request_error", "", "not valid JSON"},
      {"/v1/completions", R"({"model": "gpt-4", "prompt": "x"})", 404, "invalid_request_error",
       "model", "gpt-4"},
      // The worker refuses it (INVALID_ARGUMENT): 400 before any stream starts.
      {"/v1/completions", R"({"prompt": "x", "window": 3, "stream": true})", 400,
       "invalid_request_error", "", "window"},
      {"/v1/completions", R"({"prompt": [100000], "max_tokens": 2})", 400, "invalid_request_error",
       "", ""},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": 1}]})", 400,
       "invalid_request_error", "messages[0].content", "must be a string"},
      {"/v1/nothing", "{}", 404, "not_found_error", "", "no route"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    auto res = post(c.path, c.body);
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, c.status) << res->body;
    const Json j = Json::parse(res->body);
    EXPECT_EQ(j["error"]["type"], c.type);
    EXPECT_EQ(j["error"]["param"], c.param.empty() ? Json(nullptr) : Json(c.param));
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(c.message_part));
  }
  // A generation route asked with GET: 405 naming the method it takes.
  auto get = http.Get("/v1/chat/completions");
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 405) << get->body;
  EXPECT_EQ(get->get_header_value("Allow"), "POST");
  EXPECT_THAT(Json::parse(get->body)["error"]["message"].get<std::string>(), HasSubstr("POST"));
  // A body over 8 KiB sent as a form (curl --data without a JSON Content-Type): the HTTP
  // library refuses it before any handler, and the error says what to send instead.
  const std::string big = R"({"prompt": ")" + std::string(9000, 'a') + R"(", "max_tokens": 1})";
  auto form = http.Post("/v1/completions", big, "application/x-www-form-urlencoded");
  ASSERT_TRUE(form);
  EXPECT_EQ(form->status, 413) << form->body;
  EXPECT_THAT(Json::parse(form->body)["error"]["message"].get<std::string>(),
              HasSubstr("Content-Type: application/json"));
  // The gateway keeps serving.
  auto ok = post("/v1/completions", R"({"prompt": "Once", "max_tokens": 2})");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;

  auto metrics = http.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_THAT(metrics->body, HasSubstr("tandem:gateway_requests_total{"));
  EXPECT_THAT(metrics->body, HasSubstr("code=\"400\""));
  EXPECT_THAT(metrics->body, HasSubstr("tandem:gateway_workers_serving 1"));
  EXPECT_THAT(metrics->body, HasSubstr("tandem:gateway_requests_running 0"));
  if (metrics_test::PromtoolAvailable()) {
    absl::StatusOr<metrics_test::PromtoolResult> lint = metrics_test::RunPromtool(metrics->body);
    ASSERT_TRUE(lint.ok()) << lint.status();
    // Parsed; the only lint is the colon of vLLM-style names (tests/metrics/promtool.h).
    EXPECT_THAT(lint->exit_code, ::testing::AnyOf(0, 3));
    EXPECT_TRUE(lint->problems.empty()) << absl::StrJoin(lint->problems, "\n");
  }
}

TEST_F(GatewayE2eTest, ModelsAndHealth) {
  httplib::Client http("127.0.0.1", port_);
  auto models = http.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 200);
  const Json list = Json::parse(models->body);
  EXPECT_EQ(list["object"], "list");
  ASSERT_EQ(list["data"].size(), 1u);
  EXPECT_EQ(list["data"][0]["id"], "stories260k");
  EXPECT_EQ(list["data"][0]["object"], "model");
  EXPECT_EQ(list["data"][0]["max_model_len"], 512);
  auto one = http.Get("/v1/models/stories260k");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 200);
  auto none = http.Get("/v1/models/other");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 404);
  auto health = http.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(Json::parse(health->body)["workers_serving"], 1);
}

// CORS: off by default; with --cors_origins, a browser's preflight from a listed origin is
// answered (204, the methods and the headers it asked for) and its responses carry
// Access-Control-Allow-Origin; another origin gets neither. A bad origin stops the gateway.
TEST_F(GatewayE2eTest, CorsOnlyForListedOrigins) {
  const httplib::Headers preflight = {
      {"Origin", "https://app.example"},
      {"Access-Control-Request-Method", "POST"},
      {"Access-Control-Request-Headers", "authorization, content-type"}};
  {
    httplib::Client off("127.0.0.1", port_);
    auto res = off.Options("/v1/completions", preflight);
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 405);  // the route takes POST
    EXPECT_FALSE(res->has_header("Access-Control-Allow-Origin"));
  }
  std::unique_ptr<ChildProcess> first = std::move(gateway_);
  StartGateway({"--workers=" + worker_address_, "--cors_origins=https://app.example"});
  httplib::Client http("127.0.0.1", port_);
  auto pre = http.Options("/v1/completions", preflight);
  ASSERT_TRUE(pre);
  EXPECT_EQ(pre->status, 204);
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Origin"), "https://app.example");
  EXPECT_THAT(pre->get_header_value("Access-Control-Allow-Methods"), HasSubstr("POST"));
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Headers"), "authorization, content-type");
  const std::string body = R"({"prompt": "Once", "max_tokens": 2})";
  auto allowed =
      http.Post("/v1/completions", {{"Origin", "https://app.example"}}, body, "application/json");
  ASSERT_TRUE(allowed);
  EXPECT_EQ(allowed->status, 200) << allowed->body;
  EXPECT_EQ(allowed->get_header_value("Access-Control-Allow-Origin"), "https://app.example");
  auto error = http.Post("/v1/completions", {{"Origin", "https://app.example"}},
                         R"({"prompt": "x", "n": 2})", "application/json");
  ASSERT_TRUE(error);
  EXPECT_EQ(error->status, 400);
  EXPECT_EQ(error->get_header_value("Access-Control-Allow-Origin"), "https://app.example");
  auto other =
      http.Post("/v1/completions", {{"Origin", "https://other.example"}}, body, "application/json");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 200);
  EXPECT_FALSE(other->has_header("Access-Control-Allow-Origin"));
  httplib::Headers other_preflight = preflight;
  other_preflight.erase("Origin");
  other_preflight.emplace("Origin", "https://other.example");
  auto refused = http.Options("/v1/completions", other_preflight);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 403);
  EXPECT_FALSE(refused->has_header("Access-Control-Allow-Origin"));

  absl::StatusOr<CommandResult> bad =
      RunCommand({TANDEM_GATEWAY_BIN, "--address=127.0.0.1:0", "--workers=" + worker_address_,
                  "--cors_origins=app.example"});
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_NE(bad->exit_code, 0);
  EXPECT_THAT(bad->err, HasSubstr("--cors_origins"));
  absl::StatusOr<int> code = first->Terminate();
  ASSERT_TRUE(code.ok());
}

// The SigBlk mask (/proc/PID/task/TID/status) of every thread of process `pid` but the main one,
// by thread name; empty when /proc cannot be read. (The main thread waits in sigwait, which
// unblocks the awaited signals while it waits.)
std::vector<std::pair<std::string, uint64_t>> BlockedSignalsByThread(pid_t pid) {
  std::vector<std::pair<std::string, uint64_t>> threads;
  std::error_code error;
  const std::filesystem::path tasks = absl::StrCat("/proc/", pid, "/task");
  for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
    if (task.path().filename() == std::to_string(pid)) continue;
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (!absl::StartsWith(line, "SigBlk:")) continue;
      uint64_t mask = 0;
      if (absl::SimpleHexAtoi(absl::StripAsciiWhitespace(line.substr(7)), &mask)) {
        threads.emplace_back(name, mask);
      }
    }
  }
  return threads;
}

// A SIGTERM must reach the main thread's sigwait (a drain, exit 0), never a thread that leaves it
// to the default action (exit 143): every thread of the node, the worker and the gateway blocks
// SIGINT and SIGTERM (stop_signals.h; gRPC starts threads while flags are parsed).
// A gateway whose worker does not answer starts gRPC's executor and timer threads before it
// listens, which is where they once missed the mask (exit 143 on SIGTERM in CI).
TEST_F(GatewayE2eTest, EveryThreadOfEachServiceBlocksTheStopSignals) {
  auto unanswered = ChildProcess::Start(
      {TANDEM_GATEWAY_BIN, "--address=127.0.0.1:0", "--workers=127.0.0.1:1", "--log_level=error"});
  ASSERT_TRUE(unanswered.ok()) << unanswered.status();
  ASSERT_TRUE((*unanswered)->WaitListening().ok());
  const uint64_t stop_bits = (uint64_t{1} << (SIGINT - 1)) | (uint64_t{1} << (SIGTERM - 1));
  for (const auto& [service, process] :
       {std::pair<const char*, ChildProcess*>{"tandem-cpu-attention", node_.get()},
        {"tandem-gpu-worker", worker_.get()},
        {"tandem-gateway", gateway_.get()},
        {"tandem-gateway (worker unanswered)", unanswered->get()}}) {
    const auto threads = BlockedSignalsByThread(process->pid());
    ASSERT_FALSE(threads.empty()) << service << ": /proc/" << process->pid() << "/task unreadable";
    for (const auto& [thread, mask] : threads) {
      EXPECT_EQ(mask & stop_bits, stop_bits)
          << service << " thread '" << thread << "' has SIGINT or SIGTERM unblocked (SigBlk "
          << std::hex << mask << ")";
    }
  }
  absl::StatusOr<int> code = (*unanswered)->Terminate();
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << "exit status after SIGTERM";
}

TEST_F(GatewayE2eTest, ServedModelNameAndNoTemplate) {
  // A second gateway on the same worker: another name, and no --chat_template (stories260k has
  // no chat template of its own).
  std::unique_ptr<ChildProcess> first = std::move(gateway_);
  StartGateway({"--workers=" + worker_address_, "--served-model-name=tiny"});
  httplib::Client http("127.0.0.1", port_);
  auto models = http.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(Json::parse(models->body)["data"][0]["id"], "tiny");
  auto chat = http.Post("/v1/chat/completions",
                        R"({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})",
                        "application/json");
  ASSERT_TRUE(chat);
  EXPECT_EQ(chat->status, 400);
  EXPECT_THAT(Json::parse(chat->body)["error"]["message"].get<std::string>(),
              HasSubstr("--chat_template"));
  absl::StatusOr<int> code = first->Terminate();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
}

TEST(GatewayBinary, HelpBadFlagsAndNoWorker) {
  absl::StatusOr<CommandResult> help = RunCommand({TANDEM_GATEWAY_BIN, "--help"});
  ASSERT_TRUE(help.ok()) << help.status();
  EXPECT_EQ(help->exit_code, 0);
  EXPECT_THAT(help->out + help->err, HasSubstr("--workers"));
  EXPECT_THAT(help->out + help->err, HasSubstr("--chat_template"));
  absl::StatusOr<CommandResult> bad = RunCommand({TANDEM_GATEWAY_BIN, "--no_such_flag=1"});
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(bad->exit_code, 2);
  absl::StatusOr<CommandResult> none = RunCommand({TANDEM_GATEWAY_BIN});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->exit_code, 2);
  EXPECT_THAT(none->err, HasSubstr("--workers is required"));

  // Nothing listens on port 1: the gateway starts, says 503, and answers requests with 503.
  auto gateway = ChildProcess::Start(
      {TANDEM_GATEWAY_BIN, "--workers=127.0.0.1:1", "--address=127.0.0.1:0", "--log_level=error"});
  ASSERT_TRUE(gateway.ok());
  absl::StatusOr<int> port = (*gateway)->WaitListening();
  ASSERT_TRUE(port.ok()) << port.status();
  httplib::Client http("127.0.0.1", *port);
  auto health = http.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  auto completion = http.Post("/v1/completions", R"({"prompt": "x"})", "application/json");
  ASSERT_TRUE(completion);
  EXPECT_EQ(completion->status, 503);
  EXPECT_EQ(Json::parse(completion->body)["error"]["type"], "service_unavailable_error");
  absl::StatusOr<int> code = (*gateway)->Terminate();
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
}

}  // namespace
}  // namespace tandem::gateway
