// tandem-load: a load generator for tandem-gpu-worker, after vLLM's benchmark_serving. It sends
// server-streaming Generate calls and measures what a client sees: time to first token (send ->
// first `token` message), inter-token latency (gaps between `token` messages), time per output
// token, end-to-end latency, and request and token throughput over the measured span.
//
//   closed loop (--request_rate=0): --concurrency threads, each sending its next request as soon
//     as the previous one ends;
//   open loop (--request_rate=R): Poisson arrivals at R req/s; --concurrency threads cap the
//     requests in flight, so a request due while all are busy waits (its queue delay, due ->
//     sent, is reported; latencies count from the send, as vLLM's --max-concurrency does).
//
// Prompts are token ids (prompt_ids): random ids in [1, vocab) or slices of a text file tokenized
// by the worker's Tokenize RPC. Lengths follow --prompt_dist / --output_dist; --ignore_eos
// (default) makes every request generate its asked length. Failed requests are counted by
// status code, never fatal. Prints a table, then the report as one JSON line (also written to
// --json_out). A request failing UNAVAILABLE makes the tool probe the worker (GetModelInfo, up to
// --connect_timeout_s); when it does not answer, the run stops there and the report covers what
// finished. Exit status: 0 done, 1 the worker cannot be reached (at the start or mid-run) / the
// prompt text cannot be read / no request succeeded, 2 a bad command line, 130 interrupted
// (SIGINT/SIGTERM: requests in flight are cancelled and the report covers what finished).
#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "load_client.h"
#include "load_stats.h"
#include "load_workload.h"
#include "nlohmann/json.hpp"
#include "parse_flags.h"
#include "tandem/common/status_macros.h"
#include "tandem/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, target, "", "worker host:port (required)");
ABSL_FLAG(int64_t, concurrency, 1,
          "client threads (1..4096): the requests in flight in a closed loop, their cap in an "
          "open loop");
ABSL_FLAG(double, request_rate, 0, "open loop: Poisson arrivals per second; 0 = closed loop");
ABSL_FLAG(int64_t, num_requests, 0,
          "measured requests (<= 10^7); 0 = 100, or no limit but 10^7 with --duration_s");
ABSL_FLAG(double, duration_s, 0, "stop sending after this many seconds; 0 = no time limit");
ABSL_FLAG(int64_t, warmup, 0, "requests sent (closed loop) before measuring, not counted");
ABSL_FLAG(int64_t, prompt_tokens, 128, "mean prompt length, tokens");
ABSL_FLAG(std::string, prompt_dist, "fixed", "prompt lengths: fixed, uniform or normal");
ABSL_FLAG(double, prompt_spread, 0,
          "prompt length spread relative to the mean: uniform in mean*(1+-spread), normal with "
          "stddev spread*mean");
ABSL_FLAG(int64_t, output_tokens, 128, "mean output length (max_tokens), tokens");
ABSL_FLAG(std::string, output_dist, "fixed", "output lengths: fixed, uniform or normal");
ABSL_FLAG(double, output_spread, 0, "output length spread, as --prompt_spread");
ABSL_FLAG(std::string, prompt_source, "random",
          "random (ids in [1, vocab)) or a UTF-8 text file whose tokens are sliced into prompts");
ABSL_FLAG(uint64_t, load_seed, 0, "seed of lengths, random prompts and arrival times");
ABSL_FLAG(int64_t, shared_prefix_tokens, 0,
          "length of the documents prompts start with (request i: document i mod "
          "--shared_prefixes, then its own --prompt_tokens; the same documents in every run "
          "with the same --shared_prefix_seed): the prefix cache's workload; 0 = none");
ABSL_FLAG(int64_t, shared_prefixes, 1, "number of --shared_prefix_tokens documents (1..1024)");
ABSL_FLAG(uint64_t, shared_prefix_seed, 0, "seed of the documents' ids");
ABSL_FLAG(bool, ignore_eos, true, "request field: generate past EOS (exact output lengths)");
ABSL_FLAG(std::string, mode, "", "request field: gpu or hybrid; empty = the worker's default");
ABSL_FLAG(std::optional<double>, beta, std::nullopt, "request field: hybrid beta");
ABSL_FLAG(std::optional<int64_t>, window, std::nullopt, "request field: hybrid device window");
ABSL_FLAG(std::optional<int64_t>, sink, std::nullopt, "request field: hybrid sink tokens");
ABSL_FLAG(std::string, selection, "", "request field: maw or pages; empty = the worker's");
ABSL_FLAG(std::optional<int64_t>, select_tokens, std::nullopt,
          "request field: selection=pages budget per (layer, kv head, token)");
ABSL_FLAG(double, temperature, 0, "request field: sampling temperature; 0 = greedy");
ABSL_FLAG(double, top_p, 0, "request field: nucleus sampling; 0 = off");
ABSL_FLAG(int32_t, top_k, 0, "request field: top-k sampling; 0 = off");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt, "request field: sampling seed");
ABSL_FLAG(double, deadline_s, 600, "deadline of each Generate call, seconds");
ABSL_FLAG(double, connect_timeout_s, 10, "how long to wait for the worker at the start");
ABSL_FLAG(int32_t, channels, 1, "gRPC connections to the worker (1..64), threads spread over them");
ABSL_FLAG(std::string, json_out, "", "also write the JSON report to this file");
ABSL_FLAG(double, progress_s, 10, "seconds between progress lines on stderr; 0 = none");

namespace {

namespace v1 = tandem::v1;
namespace tb = tandem::bench;

constexpr int64_t kMaxConcurrency = 4096;
constexpr int64_t kMaxRequests = 10'000'000;

struct Settings {
  std::string target;
  int64_t concurrency = 1;
  double request_rate = 0;
  int64_t num_requests = 0;  // the cap: kMaxRequests when only --duration_s limits the run
  double duration_s = 0;
  int64_t warmup = 0;
  tb::LengthSpec prompt, output;
  double deadline_s = 0;
  int channels = 1;
  v1::GenerateRequest request_template;  // every field but the prompt and max_tokens
};

absl::StatusOr<Settings> SettingsFromFlags() {
  Settings s;
  s.target = absl::GetFlag(FLAGS_target);
  if (s.target.empty()) return absl::InvalidArgumentError("--target host:port is required");
  s.concurrency = absl::GetFlag(FLAGS_concurrency);
  if (s.concurrency < 1 || s.concurrency > kMaxConcurrency) {
    return absl::InvalidArgumentError(
        absl::StrCat("--concurrency must be in 1..", kMaxConcurrency, ", got ", s.concurrency));
  }
  s.request_rate = absl::GetFlag(FLAGS_request_rate);
  if (!std::isfinite(s.request_rate) || s.request_rate < 0) {
    return absl::InvalidArgumentError("--request_rate must be >= 0 (0 = closed loop)");
  }
  s.duration_s = absl::GetFlag(FLAGS_duration_s);
  if (!std::isfinite(s.duration_s) || s.duration_s < 0) {
    return absl::InvalidArgumentError("--duration_s must be >= 0");
  }
  s.num_requests = absl::GetFlag(FLAGS_num_requests);
  if (s.num_requests < 0 || s.num_requests > kMaxRequests) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_requests must be in 0..", kMaxRequests, ", got ", s.num_requests));
  }
  if (s.num_requests == 0) s.num_requests = s.duration_s > 0 ? kMaxRequests : 100;
  s.warmup = absl::GetFlag(FLAGS_warmup);
  if (s.warmup < 0 || s.warmup > kMaxRequests) {
    return absl::InvalidArgumentError(absl::StrCat("--warmup must be in 0..", kMaxRequests));
  }
  TANDEM_ASSIGN_OR_RETURN(s.prompt.dist, tb::ParseLengthDist(absl::GetFlag(FLAGS_prompt_dist)));
  s.prompt.mean = absl::GetFlag(FLAGS_prompt_tokens);
  s.prompt.spread = absl::GetFlag(FLAGS_prompt_spread);
  TANDEM_ASSIGN_OR_RETURN(s.output.dist, tb::ParseLengthDist(absl::GetFlag(FLAGS_output_dist)));
  s.output.mean = absl::GetFlag(FLAGS_output_tokens);
  s.output.spread = absl::GetFlag(FLAGS_output_spread);
  if (s.output.mean > tb::kMaxLoadOutputTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("--output_tokens must be <= ", tb::kMaxLoadOutputTokens));
  }
  s.deadline_s = absl::GetFlag(FLAGS_deadline_s);
  if (!std::isfinite(s.deadline_s) || s.deadline_s <= 0) {
    return absl::InvalidArgumentError("--deadline_s must be > 0");
  }
  s.channels = absl::GetFlag(FLAGS_channels);
  if (s.channels < 1 || s.channels > 64) {
    return absl::InvalidArgumentError("--channels must be in 1..64");
  }

  v1::GenerateRequest& r = s.request_template;
  r.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  r.set_mode(absl::GetFlag(FLAGS_mode));
  if (const auto beta = absl::GetFlag(FLAGS_beta)) r.set_beta(static_cast<float>(*beta));
  if (const auto window = absl::GetFlag(FLAGS_window)) r.set_window(*window);
  if (const auto sink = absl::GetFlag(FLAGS_sink)) r.set_sink(*sink);
  r.set_selection(absl::GetFlag(FLAGS_selection));
  if (const auto n = absl::GetFlag(FLAGS_select_tokens)) r.set_select_tokens(*n);
  r.set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  r.set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  r.set_top_k(absl::GetFlag(FLAGS_top_k));
  if (const auto seed = absl::GetFlag(FLAGS_seed)) r.set_seed(*seed);
  return s;
}

// Waits for the phase's threads, printing progress; SIGINT/SIGTERM (blocked in every thread)
// stops it. True when a signal stopped it.
bool WaitForPhase(tb::LoadPhase& phase, const char* name, int64_t total) {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  const double progress_s = absl::GetFlag(FLAGS_progress_s);
  double next_progress = progress_s;
  bool interrupted = false;
  while (!phase.Done()) {
    const timespec tick{0, 100'000'000};
    const int sig = sigtimedwait(&stop_signals, nullptr, &tick);
    if (sig == SIGINT || sig == SIGTERM) {
      if (!interrupted) {
        std::fprintf(stderr, "tandem-load: signal %d: cancelling the requests in flight\n", sig);
        phase.Stop();
      }
      interrupted = true;
    }
    if (progress_s > 0 && phase.elapsed_s() >= next_progress) {
      next_progress += progress_s;
      std::fprintf(stderr, "tandem-load: %s %.0f s: %lld%s requests done, %lld failed\n", name,
                   phase.elapsed_s(), static_cast<long long>(phase.finished()),
                   total < kMaxRequests ? absl::StrCat("/", total).c_str() : "",
                   static_cast<long long>(phase.failed()));
    }
  }
  phase.Join();
  return interrupted;
}

// This file's flags and their values, for the report.
nlohmann::ordered_json FlagsJson() {
  std::map<std::string, std::string> sorted;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), "load_generator.cc")) {
      sorted[std::string(name)] = flag->CurrentValue();
    }
  }
  return nlohmann::ordered_json(sorted);
}

int Fail(const absl::Status& status, int code) {
  std::fprintf(stderr, "tandem-load: %s\n", std::string(status.message()).c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "load_generator.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "load generator for tandem-gpu-worker (Generate streams; TTFT, ITL, TPOT, throughput).\n"
      "  tandem-load --target=HOST:PORT [--concurrency=N | --request_rate=R] "
      "[--num_requests=N | --duration_s=S] --prompt_tokens=N --output_tokens=N "
      "[--prompt_source=random|FILE] [--json_out=FILE]");
  const std::vector<char*> positional = tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "tandem-load: unexpected argument '%s'\n", positional[1]);
    return 2;
  }
  absl::StatusOr<Settings> settings = SettingsFromFlags();
  if (!settings.ok()) return Fail(settings.status(), 2);
  absl::StatusOr<tb::LengthSampler> prompt_lengths =
      tb::LengthSampler::Create(settings->prompt, "--prompt_tokens");
  if (!prompt_lengths.ok()) return Fail(prompt_lengths.status(), 2);
  absl::StatusOr<tb::LengthSampler> output_lengths =
      tb::LengthSampler::Create(settings->output, "--output_tokens");
  if (!output_lengths.ok()) return Fail(output_lengths.status(), 2);

  // The main thread takes SIGINT/SIGTERM (WaitForPhase); block them before gRPC starts threads.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  tb::LoadTarget target;
  target.address = settings->target;
  target.request_template = settings->request_template;
  target.deadline_s = settings->deadline_s;
  target.connect_timeout_s = absl::GetFlag(FLAGS_connect_timeout_s);
  for (int i = 0; i < settings->channels; ++i) {
    target.stubs.push_back(v1::Generation::NewStub(grpc::CreateCustomChannel(
        settings->target, grpc::InsecureChannelCredentials(), tb::LoadChannelArguments(i))));
  }
  absl::StatusOr<v1::ModelInfoResponse> info =
      tb::FetchModelInfo(*target.stubs[0], target.address, target.connect_timeout_s);
  if (!info.ok()) return Fail(info.status(), 1);
  target.max_context = info->max_context();
  if (settings->prompt.mean + settings->output.mean > target.max_context) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat(
            "--prompt_tokens + --output_tokens (", settings->prompt.mean, " + ",
            settings->output.mean, ") exceed the model's context (", target.max_context, ")")),
        2);
  }

  const std::string source = absl::GetFlag(FLAGS_prompt_source);
  absl::StatusOr<tb::PromptSource> prompts = absl::InternalError("unset");
  if (source == "random") {
    prompts = tb::PromptSource::Random(info->vocab_size());
  } else {
    absl::StatusOr<std::vector<int32_t>> ids = tb::TokenizeFile(*target.stubs[0], source);
    if (!ids.ok()) return Fail(ids.status(), 1);
    prompts = tb::PromptSource::Corpus(std::move(*ids));
  }
  if (!prompts.ok()) return Fail(prompts.status(), 1);
  const int64_t shared_prefix_tokens = absl::GetFlag(FLAGS_shared_prefix_tokens);
  if (shared_prefix_tokens < 0 ||
      shared_prefix_tokens + settings->prompt.mean + settings->output.mean > target.max_context) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--shared_prefix_tokens ", shared_prefix_tokens,
                    " must be >= 0 and leave room for --prompt_tokens + --output_tokens in the "
                    "model's context (", target.max_context, ")")),
                2);
  }
  const int64_t documents = absl::GetFlag(FLAGS_shared_prefixes);
  if (documents < 1 || documents > 1024) {
    return Fail(absl::InvalidArgumentError("--shared_prefixes must be in 1..1024"), 2);
  }
  std::mt19937_64 prefix_rng(absl::GetFlag(FLAGS_shared_prefix_seed));
  std::vector<std::vector<int32_t>> shared_prefixes;
  for (int64_t d = 0; d < documents && shared_prefix_tokens > 0; ++d) {
    // Corpus prompts: documents are slices far from the requests' own ones.
    shared_prefixes.push_back(prompts->Make(static_cast<uint64_t>(kMaxRequests + 1 + d),
                                            shared_prefix_tokens, prefix_rng));
  }
  const tb::LoadWorkload workload{&*prompts, &*prompt_lengths, &*output_lengths,
                                  absl::GetFlag(FLAGS_load_seed), &shared_prefixes};

  const bool open_loop = settings->request_rate > 0;
  const std::string loop =
      open_loop ? absl::StrCat("open loop ", settings->request_rate, " req/s, at most ",
                               settings->concurrency, " in flight")
                : absl::StrCat("closed loop, concurrency ", settings->concurrency);
  std::string length = absl::StrCat(settings->duration_s, " s");
  if (settings->num_requests < kMaxRequests) {
    length = absl::StrCat(settings->num_requests, " requests",
                          settings->duration_s > 0 ? absl::StrCat(" or ", length) : "");
  }
  const std::string prompt_kind =
      prompts->is_random() ? "random ids"
                           : absl::StrCat(source, ", ", prompts->corpus_tokens(), " tokens");
  std::printf("tandem-load: %s: %s on %s (%s), vocab %lld, context %lld\n",
              settings->target.c_str(), info->model_dir().c_str(), info->backend().c_str(),
              info->device().c_str(), static_cast<long long>(info->vocab_size()),
              static_cast<long long>(target.max_context));
  std::printf("tandem-load: %s, %s, prompts %s %lld tokens (%s), outputs %s %lld tokens\n",
              loop.c_str(), length.c_str(), tb::LengthDistName(settings->prompt.dist),
              static_cast<long long>(settings->prompt.mean), prompt_kind.c_str(),
              tb::LengthDistName(settings->output.dist),
              static_cast<long long>(settings->output.mean));
  std::fflush(stdout);

  bool interrupted = false;
  if (settings->warmup > 0) {
    tb::LoadPhase::Plan plan;
    plan.count = settings->warmup;
    plan.threads = std::min(settings->concurrency, settings->warmup);
    plan.first_index = static_cast<uint64_t>(kMaxRequests);  // prompts unlike the measured ones
    tb::LoadPhase warmup(target, workload, plan, nullptr);
    warmup.Start();
    interrupted = WaitForPhase(warmup, "warmup", settings->warmup);
    if (!warmup.lost().ok()) return Fail(warmup.lost(), 1);
    std::fprintf(stderr, "tandem-load: warmup: %lld requests, %lld failed\n",
                 static_cast<long long>(warmup.finished()),
                 static_cast<long long>(warmup.failed()));
  }

  tb::LoadCollector collector;
  absl::Status lost;
  if (!interrupted) {
    tb::LoadPhase::Plan plan;
    plan.count = settings->num_requests;
    plan.duration_s = settings->duration_s;
    plan.request_rate = settings->request_rate;
    plan.threads = std::min(settings->concurrency, settings->num_requests);
    tb::LoadPhase measured(target, workload, plan, &collector);
    measured.Start();
    interrupted = WaitForPhase(measured, "run", settings->num_requests);
    lost = measured.lost();
  }

  const tb::LoadCollector::Report report = collector.Finish();
  nlohmann::ordered_json config;
  config["flags"] = FlagsJson();
  config["loop"] = open_loop ? "open" : "closed";
  config["interrupted"] = interrupted;
  config["worker_lost"] = !lost.ok();
  config["worker"] = {{"model_dir", info->model_dir()},     {"backend", info->backend()},
                      {"device", info->device()},           {"vocab_size", info->vocab_size()},
                      {"max_context", info->max_context()}, {"kv_dtype", info->kv_dtype()},
                      {"cpu_nodes", info->cpu_nodes()}};
  const nlohmann::ordered_json json = tb::ReportJson(report, config);
  std::printf("%s", tb::ReportTable(report).c_str());
  // Error messages and paths may hold invalid UTF-8: replace it rather than throw.
  const std::string json_line =
      json.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  std::printf("%s\n", json_line.c_str());
  std::fflush(stdout);
  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (!json_out.empty()) {
    std::ofstream out(json_out);
    out << json_line << "\n";
    if (!out) return Fail(absl::UnavailableError(absl::StrCat("cannot write ", json_out)), 1);
  }
  if (!lost.ok()) return Fail(lost, 1);
  if (interrupted) return 130;
  if (report.ok == 0) {
    return Fail(absl::UnavailableError("no request succeeded (see the errors above)"), 1);
  }
  return 0;
}
