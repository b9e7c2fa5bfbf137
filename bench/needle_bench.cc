// tandem-needle-bench: needle retrieval (RULER-style multi-key needle in a haystack) per
// attention configuration, on a model tuned for it (../shared/models/gutenberg-14m-niah).
//
// Each prompt is ~--prompt_tokens tokens of one eval book with --needles sentences
// "The secret code of the <animal> is <7 digits>." inserted at random sentence boundaries, every
// one more than --min_distance tokens before the question (so beyond a device window of that
// size), then the model's question format:
//   Question: what is the secret code of the <animal>? Answer: the secret code of the <animal> is
// A prompt counts as retrieved when the greedy continuation starts with " <the 7 digits>".
// Prompts are built from a seeded generator (--seed): the same flags give the same prompts.
// Configurations: gpu (full attention), window only, MAW at each of --betas, pages at each of
// --pages (TOKENS[:dN][:cF], see tandem-ppl-bench). Prints one JSON line per configuration,
// then a table.
//
// --settle_first (default): the answer is decoded with every offloaded entry on the tier, as in
// a chat over a document sent earlier. Each prompt goes twice: first without its last token
// (max_tokens 1), a one-shot request whose session the prefix cache keeps and the engine settles
// whole when the request ends (the device prefill's widened window moves to the tier); then
// whole, which continues that session, so the last prompt token and every answer token attend
// through the window and the tier's selection. Without it, a device prefill leaves the prompt's
// KV on the device while the first tokens decode (settle_tokens_per_step a step), and a long
// prompt's answer never reaches the selection.
//
//   tandem-needle-bench --model ../shared/models/gutenberg-14m-niah
//       --books ../shared/data/gutenberg-eval --prompts_per_book 4 --pages 256,512
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "parse_flags.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "page_policy_list.h"
#include "tandem/gpu_worker/engine.h"

ABSL_FLAG(std::string, model, "", "model directory (a needle-tuned model)");
ABSL_FLAG(std::string, books, "", "directory of .txt books (all of them, sorted by name)");
ABSL_FLAG(int64_t, prompts_per_book, 4, "prompts built from each book (from disjoint parts)");
ABSL_FLAG(int64_t, prompt_tokens, 7000, "approximate prompt length, tokens");
ABSL_FLAG(int64_t, needles, 4, "needles per prompt (distinct animals)");
ABSL_FLAG(int64_t, min_distance, 640, "every needle starts more than this many tokens before the end");
ABSL_FLAG(uint64_t, seed, 1234, "seed of the prompt builder");
ABSL_FLAG(int64_t, window, 512, "hybrid: recent tokens on the device");
ABSL_FLAG(int64_t, sink, 4, "hybrid: sink tokens on the device");
ABSL_FLAG(std::string, betas, "1", "hybrid MAW: comma-separated betas");
ABSL_FLAG(std::string, pages, "256,512", "hybrid pages: budgets, TOKENS or TOKENS:dN");
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
ABSL_FLAG(std::string, backend, "auto", "auto, cpu or cuda");
ABSL_FLAG(unsigned, node_threads, 0, "embedded CPU node attention threads (0 = all cores)");
ABSL_FLAG(bool, settle_first, true,
          "decode each answer with all offloaded KV on the tier (see the file comment)");
ABSL_FLAG(int64_t, node_pool_gib, 4, "embedded CPU node KV pool, GiB");
ABSL_FLAG(std::string, node_kv_dtype, "bf16",
          "embedded CPU node KV storage: bf16 (as sent) or int8 (8-bit rows, per-row scale)");

namespace tandem::gpu_worker {
namespace {

constexpr const char* kAnimals[] = {"cat",   "dog",   "horse", "eagle", "whale", "tiger",
                                    "rabbit", "fox",  "owl",   "bear",  "wolf",  "lion",
                                    "goat",  "sheep", "mouse", "snake", "frog",  "crow",
                                    "duck",  "deer",  "seal",  "shark", "camel", "zebra"};

struct NeedlePrompt {
  std::string text;
  std::string answer;   // " 1234567"
  int64_t tokens = 0;
};

struct Config {
  std::string label;
  AttentionMode mode = AttentionMode::kGpu;
  float beta = 0.0f;
  SelectionRule selection = SelectionRule::kMaw;
  PagePolicy policy;
};

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Offsets just after ". " in text[from, to): candidate needle places.
std::vector<size_t> SentenceEnds(const std::string& text, size_t from, size_t to) {
  std::vector<size_t> ends;
  for (size_t i = from; i + 1 < to; ++i) {
    if (text[i] == '.' && text[i + 1] == ' ') ends.push_back(i + 2);
  }
  return ends;
}

// Builds a prompt from text[begin, begin + chars) (chars chosen for ~target tokens). Returns
// false when the needles cannot be placed far enough from the end.
bool BuildPrompt(const Engine& engine, const std::string& book, size_t begin, size_t chars,
                 std::mt19937_64& rng, NeedlePrompt* out) {
  const int64_t needles = absl::GetFlag(FLAGS_needles);
  const size_t end = std::min(book.size(), begin + chars);
  std::vector<size_t> places = SentenceEnds(book, begin, end - (end - begin) / 6);
  if (static_cast<int64_t>(places.size()) < needles) return false;
  std::shuffle(places.begin(), places.end(), rng);
  places.resize(needles);
  std::sort(places.begin(), places.end());
  std::vector<int> animals(std::size(kAnimals));
  for (size_t i = 0; i < animals.size(); ++i) animals[i] = static_cast<int>(i);
  std::shuffle(animals.begin(), animals.end(), rng);
  std::uniform_int_distribution<int> digit_dist(1000000, 9999999);
  std::string text;
  std::string last_needle_prefix;
  size_t at = begin;
  std::vector<std::string> codes;
  for (int64_t i = 0; i < needles; ++i) {
    text.append(book, at, places[i] - at);
    const std::string code = std::to_string(digit_dist(rng));
    codes.push_back(code);
    text += absl::StrFormat("The secret code of the %s is %s. ", kAnimals[animals[i]], code);
    at = places[i];
    if (i + 1 == needles) last_needle_prefix = text;
  }
  text.append(book, at, end - at);
  // Newlines and a trailing partial word are harmless; the question starts a new line.
  const int asked = std::uniform_int_distribution<int>(0, needles - 1)(rng);
  const char* animal = kAnimals[animals[asked]];
  text += absl::StrFormat(
      "\nQuestion: what is the secret code of the %s? Answer: the secret code of the %s is",
      animal, animal);
  auto all = engine.Tokenize(text, /*add_bos=*/false);
  auto head = engine.Tokenize(last_needle_prefix, /*add_bos=*/false);
  if (!all.ok() || !head.ok()) return false;
  // The last needle ends at about head->size(); every needle precedes it.
  if (static_cast<int64_t>(all->size() - head->size()) <= absl::GetFlag(FLAGS_min_distance)) {
    return false;
  }
  out->text = std::move(text);
  out->answer = " " + codes[asked];
  out->tokens = static_cast<int64_t>(all->size());
  return true;
}

int Main() {
  EngineOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.backend = absl::GetFlag(FLAGS_backend);
  options.nodes.embedded.pool_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_node_pool_gib))
                                      << 30;
  options.prefix_cache = absl::GetFlag(FLAGS_settle_first);
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
  if (!engine.ok()) {
    std::fprintf(stderr, "tandem-needle-bench: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  std::vector<std::filesystem::path> books;
  for (const auto& entry : std::filesystem::directory_iterator(absl::GetFlag(FLAGS_books))) {
    if (entry.path().extension() == ".txt") books.push_back(entry.path());
  }
  std::sort(books.begin(), books.end());
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const int64_t target = absl::GetFlag(FLAGS_prompt_tokens);
  const int64_t per_book = absl::GetFlag(FLAGS_prompts_per_book);
  std::vector<NeedlePrompt> prompts;
  for (const auto& path : books) {
    const std::string book = ReadFile(path);
    auto ids = (*engine)->Tokenize(book, false);
    if (!ids.ok() || ids->empty()) continue;
    // Characters per token of this book, to cut ~target-token slices.
    const double chars_per_token = static_cast<double>(book.size()) / ids->size();
    const size_t chars = static_cast<size_t>(target * chars_per_token);
    if (book.size() < chars * per_book) {
      std::fprintf(stderr, "skipping %s (too short for %lld prompts)\n", path.c_str(),
                   static_cast<long long>(per_book));
      continue;
    }
    const size_t stride = book.size() / per_book;
    for (int64_t p = 0; p < per_book; ++p) {
      NeedlePrompt prompt;
      bool ok = false;
      for (int attempt = 0; attempt < 8 && !ok; ++attempt) {
        ok = BuildPrompt(**engine, book, p * stride, chars, rng, &prompt);
      }
      if (ok && prompt.tokens + 16 < (*engine)->info().max_context) {
        prompts.push_back(std::move(prompt));
      } else {
        std::fprintf(stderr, "%s: prompt %lld not built\n", path.c_str(),
                     static_cast<long long>(p));
      }
    }
  }
  if (prompts.empty()) {
    std::fprintf(stderr, "tandem-needle-bench: no prompts\n");
    return 1;
  }

  std::vector<Config> configs = {
      {"gpu", AttentionMode::kGpu, 0.0f, SelectionRule::kMaw, {}},
      {"window only", AttentionMode::kHybrid, 1e9f, SelectionRule::kMaw, {}}};
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_betas), ',', absl::SkipEmpty())) {
    float beta = 0;
    if (!absl::SimpleAtof(b, &beta)) return 2;
    configs.push_back(
        {absl::StrFormat("maw b=%g", beta), AttentionMode::kHybrid, beta, SelectionRule::kMaw, {}});
  }
  auto page_policies = bench::ParsePagePolicies(absl::GetFlag(FLAGS_pages));
  if (!page_policies.ok()) {
    std::fprintf(stderr, "%s\n", std::string(page_policies.status().message()).c_str());
    return 2;
  }
  for (const bench::LabelledPagePolicy& p : *page_policies) {
    configs.push_back({p.label, AttentionMode::kHybrid, 0.0f, SelectionRule::kPages, p.policy});
  }

  int64_t total_tokens = 0;
  for (const NeedlePrompt& p : prompts) total_tokens += p.tokens;
  const bool settle_first = absl::GetFlag(FLAGS_settle_first);
  std::vector<std::pair<std::string, int64_t>> table;
  for (const Config& config : configs) {
    int64_t retrieved = 0;
    int64_t unsettled = 0;   // settle_first: prompts whose second request missed the cache
    std::vector<int> per_prompt;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const NeedlePrompt& p = prompts[i];
      GenerateRequest request;
      request.max_tokens = 6;
      request.ignore_eos = true;
      request.mode = config.mode;
      request.beta = config.beta;
      request.window = absl::GetFlag(FLAGS_window);
      request.sink = absl::GetFlag(FLAGS_sink);
      request.selection = config.selection;
      request.select_tokens = config.policy.select_tokens;
      request.dense_layers = config.policy.dense_layers;
      request.centroid_share = config.policy.centroid_share;
      request.page_low_rank = config.policy.low_rank;
      // Only this configuration's two requests of this prompt share a cache scope.
      request.cache_salt = absl::StrFormat("%s/%d", config.label, i);
      std::vector<std::string> sessions;
      if (settle_first) {
        auto ids = (*engine)->Tokenize(p.text, /*add_bos=*/true);
        if (!ids.ok()) {
          std::fprintf(stderr, "tandem-needle-bench: %s\n", ids.status().ToString().c_str());
          return 1;
        }
        GenerateRequest head = request;
        head.prompt_ids.assign(ids->begin(), ids->end() - 1);
        head.max_tokens = 1;
        auto first = (*engine)->Generate(head);
        if (!first.ok()) {
          std::fprintf(stderr, "tandem-needle-bench: %s: %s\n", config.label.c_str(),
                       first.status().ToString().c_str());
          return 1;
        }
        sessions.push_back(first->session_id);
        request.prompt_ids = *std::move(ids);
      } else {
        request.prompt_text = p.text;
      }
      auto summary = (*engine)->Generate(request);
      if (!summary.ok()) {
        std::fprintf(stderr, "tandem-needle-bench: %s: %s\n", config.label.c_str(),
                     summary.status().ToString().c_str());
        return 1;
      }
      sessions.push_back(summary->session_id);
      if (settle_first && summary->cached_tokens + 1 != summary->prompt_tokens) ++unsettled;
      for (const std::string& id : sessions) (void)(*engine)->CloseSession(id);
      const bool ok = summary->text.rfind(p.answer, 0) == 0;
      retrieved += ok;
      per_prompt.push_back(ok);
    }
    nlohmann::json j = {{"config", config.label},
                        {"node_kv_dtype", absl::GetFlag(FLAGS_node_kv_dtype)},
                        {"page_speculate", absl::GetFlag(FLAGS_page_speculate)},
                        {"prompts", prompts.size()},
                        {"retrieved", retrieved},
                        {"settle_first", settle_first},
                        {"unsettled", unsettled},
                        {"mean_prompt_tokens", total_tokens / static_cast<int64_t>(prompts.size())},
                        {"window", absl::GetFlag(FLAGS_window)},
                        {"sink", absl::GetFlag(FLAGS_sink)},
                        {"page_tokens", absl::GetFlag(FLAGS_page_tokens)},
                        {"per_prompt", per_prompt}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
    table.push_back({config.label, retrieved});
  }
  std::printf("\n%-16s %10s\n", "config", "retrieved");
  for (const auto& [label, n] : table) {
    std::printf("%-16s %5lld/%-4zu\n", label.c_str(), static_cast<long long>(n), prompts.size());
  }
  return 0;
}

}  // namespace
}  // namespace tandem::gpu_worker

int main(int argc, char** argv) {
  tandem::services::ParseCommandLineOrExitTwo(argc, argv);
  return tandem::gpu_worker::Main();
}
