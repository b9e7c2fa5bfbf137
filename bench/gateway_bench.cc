// tandem-gateway-bench: the gateway's overhead. The same greedy requests (random prompt ids of
// --prompt_tokens, --output_tokens generated past EOS) go to a worker directly over gRPC
// (Generation.Generate, streamed) and through tandem-gateway over HTTP (POST /v1/completions,
// stream: true, SSE), in a closed loop of --concurrency clients each; one client program times
// both the same way:
//   TTFT   request sent -> first generated token received (gRPC: its TokenDelta; HTTP: the first
//          SSE chunk with text)
//   TPOT   (end - first token) / (tokens - 1), per request
//   tok/s  generated tokens of all requests / wall time of the run
// Prints a table (one row per path and concurrency, and the HTTP/gRPC ratios) and one JSON line
// per row. Exit 1 when a request fails.
//
//   tandem-gateway-bench --worker=127.0.0.1:50051 --gateway=127.0.0.1:8000 --concurrency=1,4
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "parse_flags.h"
#include "tandem/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, worker, "", "tandem-gpu-worker host:port (required)");
ABSL_FLAG(std::string, gateway, "", "tandem-gateway host:port in front of that worker (required)");
ABSL_FLAG(std::vector<std::string>, concurrency, (std::vector<std::string>{"1", "4"}),
          "closed-loop clients, a list");
ABSL_FLAG(int64_t, num_requests, 16, "measured requests per path and concurrency");
ABSL_FLAG(int64_t, warmup, 2, "requests per path before measuring, not counted");
ABSL_FLAG(int64_t, prompt_tokens, 256, "prompt length, tokens (random ids)");
ABSL_FLAG(int64_t, output_tokens, 64, "tokens generated per request (ignore_eos)");
ABSL_FLAG(int64_t, vocab, 0, "prompt ids are drawn from 0..vocab-1; 0 = the worker's vocab");
ABSL_FLAG(uint64_t, seed, 1, "seed of the random prompts (request i gets the same on both paths)");

namespace {

using Clock = std::chrono::steady_clock;

struct Sample {
  double ttft = 0, e2e = 0;
  int64_t tokens = 0;
  bool ok = false;
  std::string error;
};

std::vector<int32_t> Prompt(uint64_t seed, int64_t index, int64_t length, int64_t vocab) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(index));
  std::uniform_int_distribution<int32_t> id(1, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(length));
  for (int32_t& t : ids) t = id(rng);
  return ids;
}

Sample ViaGrpc(tandem::v1::Generation::Stub& stub, const std::vector<int32_t>& prompt,
               int64_t output) {
  tandem::v1::GenerateRequest r;
  for (int32_t id : prompt) r.mutable_prompt_ids()->add_ids(id);
  r.set_max_tokens(output);
  r.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  Sample s;
  const Clock::time_point start = Clock::now();
  auto reader = stub.Generate(&ctx, r);
  tandem::v1::GenerateResponse m;
  bool first = true;
  while (reader->Read(&m)) {
    if (m.has_token() && first) {
      s.ttft = std::chrono::duration<double>(Clock::now() - start).count();
      first = false;
    }
    if (m.has_final()) s.tokens = m.final().usage().completion_tokens();
  }
  const grpc::Status status = reader->Finish();
  s.e2e = std::chrono::duration<double>(Clock::now() - start).count();
  s.ok = status.ok() && s.tokens > 0;
  if (!status.ok()) s.error = status.error_message();
  return s;
}

Sample ViaHttp(const std::string& host, int port, const std::vector<int32_t>& prompt,
               int64_t output) {
  const nlohmann::json body = {{"prompt", prompt},   {"max_tokens", output},
                               {"ignore_eos", true}, {"temperature", 0},
                               {"stream", true},     {"stream_options", {{"include_usage", true}}}};
  httplib::Client http(host, port);
  http.set_read_timeout(600, 0);
  Sample s;
  std::string pending;
  bool first = true;
  const Clock::time_point start = Clock::now();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    pending.append(data, n);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: {", 0) != 0) continue;
      const nlohmann::json chunk = nlohmann::json::parse(event.substr(6), nullptr, false);
      if (chunk.is_discarded()) continue;
      if (first && !chunk["choices"].empty() && !chunk["choices"][0].value("text", "").empty()) {
        s.ttft = std::chrono::duration<double>(Clock::now() - start).count();
        first = false;
      }
      if (chunk.contains("usage") && chunk["usage"].is_object()) {
        s.tokens = chunk["usage"]["completion_tokens"];
      }
      if (chunk.contains("error")) s.error = chunk["error"].dump();
    }
    return true;
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  const bool sent = http.send(req, res, error);
  s.e2e = std::chrono::duration<double>(Clock::now() - start).count();
  s.ok = sent && res.status == 200 && s.tokens > 0 && s.error.empty();
  if (!sent) s.error = httplib::to_string(error);
  if (sent && res.status != 200) s.error = absl::StrCat("HTTP ", res.status);
  return s;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5)];
}

struct Row {
  std::string path;
  int64_t concurrency = 0, requests = 0, failed = 0;
  double ttft_mean = 0, ttft_p50 = 0, ttft_p90 = 0, tpot_mean = 0, tokens_per_s = 0, wall = 0;
};

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "TTFT and tokens/s through tandem-gateway "
      "(HTTP SSE) vs directly over gRPC");
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  const std::string worker = absl::GetFlag(FLAGS_worker), gateway = absl::GetFlag(FLAGS_gateway);
  const size_t colon = gateway.rfind(':');
  int gateway_port = 0;
  if (worker.empty() || colon == std::string::npos ||
      !absl::SimpleAtoi(gateway.substr(colon + 1), &gateway_port)) {
    std::fprintf(stderr,
                 "tandem-gateway-bench: --worker=host:port and --gateway=host:port are required\n");
    return 2;
  }
  const std::string gateway_host = gateway.substr(0, colon);
  auto stub = tandem::v1::Generation::NewStub(
      grpc::CreateChannel(worker, grpc::InsecureChannelCredentials()));
  int64_t vocab = absl::GetFlag(FLAGS_vocab);
  if (vocab <= 0) {
    tandem::v1::ModelInfoResponse info;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status s = stub->GetModelInfo(&ctx, {}, &info);
    if (!s.ok()) {
      std::fprintf(stderr, "tandem-gateway-bench: worker %s: %s\n", worker.c_str(),
                   s.error_message().c_str());
      return 1;
    }
    vocab = info.vocab_size();
  }
  const int64_t n = absl::GetFlag(FLAGS_num_requests), warmup = absl::GetFlag(FLAGS_warmup);
  const int64_t prompt_len = absl::GetFlag(FLAGS_prompt_tokens);
  const int64_t output = absl::GetFlag(FLAGS_output_tokens);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);

  std::vector<Row> rows;
  bool failed = false;
  for (const std::string& c_text : absl::GetFlag(FLAGS_concurrency)) {
    int64_t c = 0;
    if (!absl::SimpleAtoi(c_text, &c) || c < 1) {
      std::fprintf(stderr, "tandem-gateway-bench: bad --concurrency '%s'\n", c_text.c_str());
      return 2;
    }
    for (const std::string path : {"grpc", "http"}) {
      auto one = [&](int64_t index) {
        const std::vector<int32_t> prompt = Prompt(seed, index, prompt_len, vocab);
        return path == "grpc" ? ViaGrpc(*stub, prompt, output)
                              : ViaHttp(gateway_host, gateway_port, prompt, output);
      };
      for (int64_t i = 0; i < warmup; ++i) one(-1 - i);
      std::vector<Sample> samples(static_cast<size_t>(n));
      std::atomic<int64_t> next{0};
      const Clock::time_point start = Clock::now();
      std::vector<std::thread> clients;
      for (int64_t t = 0; t < c; ++t) {
        clients.emplace_back([&] {
          for (int64_t i; (i = next.fetch_add(1)) < n;) samples[static_cast<size_t>(i)] = one(i);
        });
      }
      for (std::thread& t : clients) t.join();
      Row row{path, c, n};
      row.wall = std::chrono::duration<double>(Clock::now() - start).count();
      std::vector<double> ttft, tpot;
      int64_t tokens = 0;
      for (const Sample& s : samples) {
        if (!s.ok) {
          ++row.failed;
          std::fprintf(stderr, "%s request failed: %s\n", path.c_str(), s.error.c_str());
          continue;
        }
        ttft.push_back(s.ttft);
        if (s.tokens > 1) tpot.push_back((s.e2e - s.ttft) / static_cast<double>(s.tokens - 1));
        tokens += s.tokens;
      }
      failed = failed || row.failed > 0;
      for (double v : ttft) row.ttft_mean += v / static_cast<double>(ttft.size());
      for (double v : tpot) row.tpot_mean += v / static_cast<double>(tpot.size());
      row.ttft_p50 = Percentile(ttft, 0.5);
      row.ttft_p90 = Percentile(ttft, 0.9);
      row.tokens_per_s = static_cast<double>(tokens) / row.wall;
      rows.push_back(row);
    }
  }

  std::printf("prompt %lld tokens, %lld generated, %lld requests per row\n",
              static_cast<long long>(prompt_len), static_cast<long long>(output),
              static_cast<long long>(n));
  std::printf("%-5s %4s %6s %12s %12s %12s %12s %10s\n", "path", "conc", "failed", "TTFT mean ms",
              "TTFT p50 ms", "TTFT p90 ms", "TPOT ms", "tok/s");
  for (const Row& r : rows) {
    std::printf("%-5s %4lld %6lld %12.2f %12.2f %12.2f %12.3f %10.1f\n", r.path.c_str(),
                static_cast<long long>(r.concurrency), static_cast<long long>(r.failed),
                r.ttft_mean * 1e3, r.ttft_p50 * 1e3, r.ttft_p90 * 1e3, r.tpot_mean * 1e3,
                r.tokens_per_s);
  }
  for (size_t i = 0; i + 1 < rows.size(); i += 2) {
    const Row& g = rows[i];
    const Row& h = rows[i + 1];
    std::printf("http/grpc at concurrency %lld: TTFT %+.2f ms (%.3fx), tok/s %.3fx\n",
                static_cast<long long>(g.concurrency), (h.ttft_mean - g.ttft_mean) * 1e3,
                g.ttft_mean > 0 ? h.ttft_mean / g.ttft_mean : 0.0,
                g.tokens_per_s > 0 ? h.tokens_per_s / g.tokens_per_s : 0.0);
  }
  for (const Row& r : rows) {
    std::printf("%s\n", nlohmann::json({{"path", r.path},
                                        {"concurrency", r.concurrency},
                                        {"requests", r.requests},
                                        {"failed", r.failed},
                                        {"mean_ttft_ms", r.ttft_mean * 1e3},
                                        {"p50_ttft_ms", r.ttft_p50 * 1e3},
                                        {"p90_ttft_ms", r.ttft_p90 * 1e3},
                                        {"mean_tpot_ms", r.tpot_mean * 1e3},
                                        {"output_throughput", r.tokens_per_s},
                                        {"prompt_tokens", prompt_len},
                                        {"output_tokens", output}})
                            .dump()
                            .c_str());
  }
  return failed ? 1 : 0;
}
