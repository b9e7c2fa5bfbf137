// tandem-ppl-bench: perplexity of hybrid attention against full attention (HGCA's accuracy
// claim), on the eval books of a model such as gutenberg-14m.
//
// For each book: the first --tokens tokens (no BOS, as golden.json's perplexity is computed),
// teacher-forced through the model. Runs `gpu` mode (full attention: the reference), then
// `hybrid` with a --window-token device window + --sink sink tokens for each beta in --betas.
// The hybrid runs feed --chunk tokens per forward pass (1 = exactly like decoding: every query
// sees the window and the CPU node's selection as of that step, and MAW advances per token); the
// full-attention reference, exact whatever the chunk, runs in chunks of 512.
// Prints one JSON line per configuration, then a table with the perplexity, its ratio to full
// attention and the mean share of offloaded entries selected per layer (mean over Attend calls
// of selected / held, summed over the layer's kv heads).
//
//   tandem-ppl-bench --model ../shared/models/gutenberg-14m \
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
#include "absl/strings/str_join.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "tandem/gpu_worker/engine.h"

ABSL_FLAG(std::string, model, "", "model directory");
ABSL_FLAG(std::string, books, "", "directory of .txt books (all of them, sorted by name)");
ABSL_FLAG(int64_t, max_books, 0, "use only the first N books (0 = all)");
ABSL_FLAG(int64_t, tokens, 8192, "tokens per book");
ABSL_FLAG(int64_t, window, 512, "hybrid: recent tokens on the device");
ABSL_FLAG(int64_t, sink, 4, "hybrid: sink tokens on the device");
ABSL_FLAG(std::string, betas, "0.5,1,2", "hybrid: comma-separated betas");
ABSL_FLAG(int64_t, chunk, 1, "tokens per forward pass");
ABSL_FLAG(std::string, backend, "auto", "auto, cpu or cuda");
ABSL_FLAG(float, maw_alpha, 0.1f, "MAW moving-average factor");
ABSL_FLAG(bool, skip_full, false, "skip the full-attention reference run");

namespace tandem::gpu_worker {
namespace {

struct RunResult {
  std::string mode;
  float beta = 0.0f;
  double nll = 0.0;
  int64_t predictions = 0;
  std::vector<double> share_sum;   // per layer, summed over books
  double seconds = 0.0;
  uint64_t degraded = 0;
  double ppl() const { return std::exp(nll / predictions); }
};

int Main() {
  EngineOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.prefill_chunk = absl::GetFlag(FLAGS_chunk);
  options.maw_alpha = absl::GetFlag(FLAGS_maw_alpha);
  options.nodes.embedded.pool_bytes = 2ull << 30;
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
  std::vector<std::pair<AttentionMode, float>> configs;
  if (!absl::GetFlag(FLAGS_skip_full)) configs.push_back({AttentionMode::kGpu, 0.0f});
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_betas), ',', absl::SkipEmpty())) {
    float beta = 0.0f;
    if (!absl::SimpleAtof(b, &beta)) {
      std::fprintf(stderr, "bad beta '%s'\n", std::string(b).c_str());
      return 2;
    }
    configs.push_back({AttentionMode::kHybrid, beta});
  }
  const int64_t layers = (*engine)->info().num_layers;
  std::vector<RunResult> results;
  for (const auto& [mode, beta] : configs) {
    RunResult r;
    r.mode = std::string(AttentionModeName(mode));
    r.beta = beta;
    r.share_sum.assign(layers, 0.0);
    const auto start = std::chrono::steady_clock::now();
    for (const auto& ids : book_ids) {
      EvaluateRequest request;
      request.ids = ids;
      request.mode = mode;
      request.beta = beta;
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
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (double& s : r.share_sum) s /= book_ids.size();
    nlohmann::json j = {{"mode", r.mode},           {"beta", r.beta},
                        {"books", book_ids.size()}, {"tokens", tokens},
                        {"window", absl::GetFlag(FLAGS_window)},
                        {"sink", absl::GetFlag(FLAGS_sink)},
                        {"chunk", absl::GetFlag(FLAGS_chunk)},
                        {"perplexity", r.ppl()},    {"predictions", r.predictions},
                        {"selected_share_per_layer", r.share_sum},
                        {"degraded_steps", r.degraded}, {"seconds", r.seconds}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
    results.push_back(std::move(r));
  }
  const double full = results.front().mode == "gpu" ? results.front().ppl() : 0.0;
  std::printf("\n%-8s %6s %10s %9s  selected share per layer (%%)\n", "mode", "beta", "ppl",
              "vs full");
  for (const RunResult& r : results) {
    std::vector<std::string> shares;
    for (double s : r.share_sum) shares.push_back(absl::StrFormat("%.1f", 100.0 * s));
    std::printf("%-8s %6.2f %10.4f %+8.2f%%  %s\n", r.mode.c_str(), r.beta, r.ppl(),
                full > 0 ? 100.0 * (r.ppl() / full - 1.0) : 0.0,
                r.mode == "gpu" ? "-" : absl::StrJoin(shares, " ").c_str());
  }
  return 0;
}

}  // namespace
}  // namespace tandem::gpu_worker

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return tandem::gpu_worker::Main();
}
