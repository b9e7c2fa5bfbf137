// tandem-ppl-bench: perplexity of hybrid attention against full attention (HGCA's accuracy
// claim), on the eval books of a model such as gutenberg-14m.
//
// For each book: the first --tokens tokens (no BOS, as golden.json's perplexity is computed),
// teacher-forced through the model. Runs `gpu` mode (full attention: the reference), then
// `hybrid` with a --window-token device window + --sink sink tokens for each beta in --betas.
// The hybrid runs feed --chunk tokens per forward pass (1 = exactly like decoding: every query
// sees the window and the CPU node's selection as of that step, and MAW advances per token); the
// full-attention reference, exact whatever the chunk, runs in chunks of 512.
// With --pages, hybrid runs also use query-aware page selection (selection = pages) at each
// budget; --window_only adds the window alone (MAW with a beta no weight can pass, so no
// offloaded entry is ever attended).
// Prints one JSON line per configuration, then a table with the perplexity, its ratio to full
// attention and the mean share of offloaded entries selected per layer (mean over Attend calls
// of selected / held, summed over the layer's kv heads).
//
//   tandem-ppl-bench --model ../shared/models/gutenberg-14m
//       --books ../shared/data/gutenberg-eval --tokens 8192 --window 512 --betas 0.5,1,2
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "page_policy_list.h"
#include "parse_flags.h"
#include "tandem/gpu_worker/engine.h"
#include "tandem/gpu_worker/model_config.h"

ABSL_FLAG(std::string, model, "", "model directory");
ABSL_FLAG(std::string, books, "", "directory of .txt books (all of them, sorted by name)");
ABSL_FLAG(int64_t, max_books, 0, "use only the first N books (0 = all)");
ABSL_FLAG(int64_t, tokens, 8192, "tokens per book");
ABSL_FLAG(int64_t, window, 512, "hybrid: recent tokens on the device");
ABSL_FLAG(int64_t, sink, 4, "hybrid: sink tokens on the device");
ABSL_FLAG(std::string, betas, "0.5,1,2", "hybrid: comma-separated betas");
ABSL_FLAG(int64_t, chunk, 1, "tokens per forward pass");
ABSL_FLAG(std::string, backend, "auto", "auto, cpu or cuda");
ABSL_FLAG(std::string, quantization, "",
          "fp8: the checkpoint's projections quantized to FP8 per output row at load (its "
          "perplexity cost); none or \"\": as stored");
ABSL_FLAG(std::string, prefill_attention, "fast",
          "cuda prefill attention kernel: fast (bf16 q and softmax weights) or exact "
          "(f32-accurate, about 2.3x the prefill attention time); the cpu backend ignores it");
ABSL_FLAG(unsigned, node_threads, 0, "embedded CPU node attention threads (0 = all cores)");
ABSL_FLAG(std::string, node_kv_dtype, "bf16",
          "embedded CPU node KV storage: bf16 (as sent) or int8 (8-bit rows, per-row scale)");
ABSL_FLAG(float, maw_alpha, 0.1f, "MAW moving-average factor");
ABSL_FLAG(bool, skip_full, false, "skip the full-attention reference run");
ABSL_FLAG(std::string, pages, "",
          "hybrid with selection=pages: comma-separated budgets (offloaded tokens per layer, "
          "kv head and query), each optionally with :dN for N dense first layers (512:d1)");
ABSL_FLAG(int64_t, page_tokens, 16, "selection=pages: tokens per page");
ABSL_FLAG(bool, page_speculate, true,
          "selection=pages: choose each layer's pages from a guess of its queries made from the "
          "layer before, while the CPU nodes attend the previous layer (off the serial path); "
          "false: from the true queries");
ABSL_FLAG(int64_t, page_key_rank, -1,
          "selection=pages: coordinates kept per offloaded key for the low-rank page score "
          "(-1 = head_dim / 2, 0 = none: the second score is q·mean)");
ABSL_FLAG(int64_t, page_key_calib_tokens, 4096,
          "selection=pages: offloaded keys per (layer, kv head) whose K^T K gives the low-rank "
          "basis");
ABSL_FLAG(bool, captured_mass, true,
          "pages runs: also measure the share of the offloaded softmax mass the chosen pages "
          "capture, per layer (a second, dense Attend per layer)");
ABSL_FLAG(bool, window_only, false, "also run hybrid with nothing offloaded attended");

namespace tandem::gpu_worker {
namespace {

struct Config {
  AttentionMode mode = AttentionMode::kGpu;
  float beta = 0.0f;
  SelectionRule selection = SelectionRule::kMaw;
  PagePolicy policy;
  std::string label;
};

struct RunResult {
  std::string mode;
  std::string label;
  float beta = 0.0f;
  double nll = 0.0;
  int64_t predictions = 0;
  std::vector<double> share_sum;   // per layer, summed over books
  std::vector<double> captured_sum;   // pages: per layer, summed over books
  double seconds = 0.0;
  uint64_t degraded = 0;
  double ppl() const { return std::exp(nll / predictions); }
};

int Main() {
  EngineOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.quantization = absl::GetFlag(FLAGS_quantization);
  if (ModelConfig scratch; !ApplyQuantizationOption(options.quantization, &scratch).ok()) {
    std::fprintf(stderr, "--quantization must be fp8, none or \"\", got \"%s\"\n",
                 options.quantization.c_str());
    return 2;
  }
  {
    auto prefill = ParsePrefillAttention(absl::GetFlag(FLAGS_prefill_attention));
    if (!prefill.ok()) {
      std::fprintf(stderr, "--%s\n", std::string(prefill.status().message()).c_str());
      return 2;
    }
    options.backend_options.prefill_attention = *prefill;
  }
  options.prefill_chunk = absl::GetFlag(FLAGS_chunk);
  options.maw_alpha = absl::GetFlag(FLAGS_maw_alpha);
  options.measure_captured_mass = absl::GetFlag(FLAGS_captured_mass);
  options.nodes.embedded.pool_bytes = 2ull << 30;
  options.nodes.embedded.threads = absl::GetFlag(FLAGS_node_threads);
  {
    auto kv_dtype = cpu_attention::ParseNodeKvDType(absl::GetFlag(FLAGS_node_kv_dtype));
    if (!kv_dtype.ok()) {
      std::fprintf(stderr, "--%s\n", std::string(kv_dtype.status().message()).c_str());
      return 2;
    }
    options.nodes.embedded.kv_dtype = *kv_dtype;
  }
  options.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  options.page_low_rank = {absl::GetFlag(FLAGS_page_key_rank),
                           absl::GetFlag(FLAGS_page_key_calib_tokens)};
  options.page_speculate = absl::GetFlag(FLAGS_page_speculate);
  options.block_tokens = std::max<int64_t>(16, options.page_tokens);
  auto engine = Engine::Create(options);
  // Full attention is exact whatever the chunk, so the reference runs in 512-token chunks.
  options.prefill_chunk = 512;
  auto reference = Engine::Create(options);
  if (!engine.ok() || !reference.ok()) {
    std::fprintf(stderr, "tandem-ppl-bench: %s\n",
                 (engine.ok() ? reference.status() : engine.status()).ToString().c_str());
    return 1;
  }
  std::vector<std::filesystem::path> books;
  for (const auto& entry : std::filesystem::directory_iterator(absl::GetFlag(FLAGS_books))) {
    if (entry.path().extension() == ".txt") books.push_back(entry.path());
  }
  std::sort(books.begin(), books.end());
  if (absl::GetFlag(FLAGS_max_books) > 0 &&
      books.size() > static_cast<size_t>(absl::GetFlag(FLAGS_max_books))) {
    books.resize(absl::GetFlag(FLAGS_max_books));
  }
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  std::vector<std::vector<int32_t>> book_ids;
  for (const auto& path : books) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    auto ids = (*engine)->Tokenize(ss.str(), /*add_bos=*/false);
    if (!ids.ok() || static_cast<int64_t>(ids->size()) < tokens) {
      std::fprintf(stderr, "skipping %s (fewer than %lld tokens)\n", path.c_str(),
                   static_cast<long long>(tokens));
      continue;
    }
    ids->resize(tokens);
    book_ids.push_back(std::move(*ids));
  }
  if (book_ids.empty()) {
    std::fprintf(stderr, "tandem-ppl-bench: no usable books\n");
    return 1;
  }
  std::vector<Config> configs;
  if (!absl::GetFlag(FLAGS_skip_full)) {
    configs.push_back({AttentionMode::kGpu, 0.0f, SelectionRule::kMaw, {}, "full"});
  }
  if (absl::GetFlag(FLAGS_window_only)) {
    // MAW weights are at most 1, so beta = window selects nothing: the window alone.
    configs.push_back({AttentionMode::kHybrid, 1e9f, SelectionRule::kMaw, {}, "window only"});
  }
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_betas), ',', absl::SkipEmpty())) {
    float beta = 0.0f;
    if (!absl::SimpleAtof(b, &beta)) {
      std::fprintf(stderr, "bad beta '%s'\n", std::string(b).c_str());
      return 2;
    }
    configs.push_back({AttentionMode::kHybrid, beta, SelectionRule::kMaw, {},
                       absl::StrFormat("maw b=%g", beta)});
  }
  auto page_policies = bench::ParsePagePolicies(absl::GetFlag(FLAGS_pages));
  if (!page_policies.ok()) {
    std::fprintf(stderr, "%s\n", std::string(page_policies.status().message()).c_str());
    return 2;
  }
  for (const bench::LabelledPagePolicy& p : *page_policies) {
    configs.push_back({AttentionMode::kHybrid, 0.0f, SelectionRule::kPages, p.policy, p.label});
  }
  const int64_t layers = (*engine)->info().num_layers;
  std::vector<RunResult> results;
  for (const Config& config : configs) {
    const AttentionMode mode = config.mode;
    RunResult r;
    r.mode = std::string(AttentionModeName(mode));
    r.label = config.label;
    r.beta = config.beta;
    r.share_sum.assign(layers, 0.0);
    r.captured_sum.assign(layers, 0.0);
    const auto start = std::chrono::steady_clock::now();
    for (const auto& ids : book_ids) {
      EvaluateRequest request;
      request.ids = ids;
      request.mode = mode;
      request.beta = config.beta;
      request.selection = config.selection;
      request.page_policy = config.policy;
      request.window = absl::GetFlag(FLAGS_window);
      request.sink = absl::GetFlag(FLAGS_sink);
      auto result = (mode == AttentionMode::kGpu ? *reference : *engine)->Evaluate(request);
      if (!result.ok()) {
        std::fprintf(stderr, "tandem-ppl-bench: %s\n", result.status().ToString().c_str());
        return 1;
      }
      r.nll += result->nll_sum;
      r.predictions += result->predictions;
      r.degraded += result->degraded_steps;
      for (size_t l = 0; l < result->selected_share.size() && l < r.share_sum.size(); ++l) {
        r.share_sum[l] += result->selected_share[l];
      }
      for (size_t l = 0; l < result->captured_mass.size() && l < r.captured_sum.size(); ++l) {
        r.captured_sum[l] += result->captured_mass[l];
      }
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (double& s : r.share_sum) s /= book_ids.size();
    for (double& s : r.captured_sum) s /= book_ids.size();
    nlohmann::json j = {{"config", r.label},
                        {"mode", r.mode},
                        {"beta", r.beta},
                        {"selection", SelectionRuleName(config.selection)},
                        {"select_tokens", config.policy.select_tokens},
                        {"dense_layers", config.policy.dense_layers},
                        {"centroid_share", config.policy.centroid_share},
                        {"low_rank", config.policy.low_rank},
                        {"page_speculate", absl::GetFlag(FLAGS_page_speculate)},
                        {"page_tokens", absl::GetFlag(FLAGS_page_tokens)},
                        {"books", book_ids.size()},
                        {"tokens", tokens},
                        {"window", absl::GetFlag(FLAGS_window)},
                        {"sink", absl::GetFlag(FLAGS_sink)},
                        {"chunk", absl::GetFlag(FLAGS_chunk)},
                        {"node_kv_dtype", absl::GetFlag(FLAGS_node_kv_dtype)},
                        {"quantization", options.quantization},
                        {"perplexity", r.ppl()},
                        {"predictions", r.predictions},
                        {"selected_share_per_layer", r.share_sum},
                        {"captured_mass_per_layer", r.captured_sum},
                        {"degraded_steps", r.degraded},
                        {"seconds", r.seconds}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
    results.push_back(std::move(r));
  }
  const double full = results.front().mode == "gpu" ? results.front().ppl() : 0.0;
  std::printf("\n%-16s %10s %9s  selected share per layer (%%) | captured mass (%%)\n", "config",
              "ppl", "vs full");
  for (const RunResult& r : results) {
    std::vector<std::string> shares;
    for (double s : r.share_sum) shares.push_back(absl::StrFormat("%.1f", 100.0 * s));
    if (r.label.rfind("pages", 0) == 0 && absl::GetFlag(FLAGS_captured_mass)) {
      shares.push_back("|");
      for (double s : r.captured_sum) shares.push_back(absl::StrFormat("%.1f", 100.0 * s));
    }
    std::printf("%-16s %10.4f %+8.2f%%  %s\n", r.label.c_str(), r.ppl(),
                full > 0 ? 100.0 * (r.ppl() / full - 1.0) : 0.0,
                r.mode == "gpu" ? "-" : absl::StrJoin(shares, " ").c_str());
  }
  return 0;
}

}  // namespace
}  // namespace tandem::gpu_worker

int main(int argc, char** argv) {
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  return tandem::gpu_worker::Main();
}
