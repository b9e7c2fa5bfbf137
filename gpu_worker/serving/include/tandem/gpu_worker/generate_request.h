// The engine's request and response types for text generation: what a caller asks
// (GenerateRequest), what it hears while the request runs (GenerateCallbacks with
// PrefillProgress and TokenEvent) and what it gets at the end (GenerateSummary).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/gpu_worker/page_selection.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {

struct SamplingOptions {
  float temperature = 0.0f;        // 0 = greedy
  float top_p = 1.0f;              // (0, 1]
  int32_t top_k = 0;               // 0 = no limit
  std::optional<uint64_t> seed;    // unset: a random seed
};

struct GenerateRequest {
  // Empty: a one-shot request (its session is closed at the end). Otherwise the session to
  // continue, or to create and keep when it does not exist (multi-turn; close with
  // CloseSession). Same rules as CPU node session ids: 1..128 of [A-Za-z0-9._:-].
  std::string session_id;
  // The prompt: token ids when prompt_ids is non-empty, else prompt_text (tokenized with BOS
  // on the first turn of a session when the tokenizer adds one).
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
  // prompt_text already tokenized off the scheduler thread (EncodePrompt with add_bos = false;
  // the worker's PromptEncoder); Begin adds BOS on a session's first turn as for prompt_text.
  // Unset: Begin checks prompt_text's size (CheckPromptTextFits) and tokenizes it itself.
  std::optional<std::vector<int32_t>> prompt_text_ids;
  int64_t max_tokens = 16;         // >= 1
  SamplingOptions sampling;
  std::vector<std::string> stop;   // stop strings (at most 16, each 1..256 bytes)
  bool ignore_eos = false;
  // Report each token's log-probability (logprobs.h: log-softmax of the raw logits, before
  // temperature / top_k / top_p) and, with top_logprobs in 1..kMaxTopLogprobs, that many most
  // likely tokens of the step. top_logprobs > 0 requires logprobs. Off: nothing is computed.
  bool logprobs = false;
  int32_t top_logprobs = 0;
  // tandem's fields; unset = the engine's defaults. A continued session keeps its mode, window
  // and sink (a different value is INVALID_ARGUMENT); a new beta re-selects its CPU entries.
  std::optional<AttentionMode> mode;
  std::optional<float> beta;       // >= 0, finite
  std::optional<int64_t> window;   // >= block_tokens
  std::optional<int64_t> sink;     // >= 0
  // Hybrid selection (page_selection.h); a continued session keeps its rule. Unset: kMaw when
  // beta is set, else the engine's default.
  std::optional<SelectionRule> selection;
  std::optional<int64_t> select_tokens;   // >= 1 (pages: whole pages, at least one)
  std::optional<int64_t> dense_layers;    // >= 0
  std::optional<double> centroid_share;   // in [0, 1] (PagePolicy::centroid_share)
  std::optional<bool> page_low_rank;      // PagePolicy::low_rank
  // Unset: no deadline. A request still running at its deadline ends with DEADLINE_EXCEEDED
  // (checked between steps).
  std::optional<std::chrono::steady_clock::time_point> deadline;
  // Prefix cache scope (prefix_cache.h) of a one-shot request: the caller's principal (the
  // service sets it from the call's credentials; ignored when the engine shares one scope) and
  // the request's cache_salt (at most 256 bytes). Only requests with equal scopes share KV.
  std::string principal;
  std::string cache_salt;
};

struct PrefillProgress {
  int64_t total = 0;               // prompt tokens to process
  int64_t processed = 0;
  double elapsed_s = 0.0;
};

// A log-probability candidate with its text (tokenizer.h DescribeToken).
struct TokenAlternative {
  int32_t token_id = 0;
  float logprob = 0.0f;            // natural log, <= 0
  std::string raw;                 // the token's exact bytes (may be a partial character)
  std::string text;                // raw as valid UTF-8 (U+FFFD for ill-formed bytes)
};

struct TokenEvent {
  int32_t token_id = 0;
  std::string text;                // UTF-8 text completed by this token (may be empty)
  int64_t index = 0;               // 0 for the first generated token
  std::optional<float> logprob;    // set iff the request asked for logprobs
  std::vector<TokenAlternative> top_logprobs;   // the request's top_logprobs, most likely first
};

enum class FinishReason { kLength, kStop, kEos, kContext, kCancelled };
std::string_view FinishReasonName(FinishReason reason);

struct GenerateSummary {
  std::string session_id;          // the session used (generated for one-shot requests)
  // Prompt tokens of the request (a session turn: its new tokens; a one-shot request: all of
  // them), of which cached_tokens came from the prefix cache instead of a prefill.
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t completion_tokens = 0;
  double time_to_first_token_s = 0.0;
  double total_s = 0.0;
  double mean_token_latency_s = 0.0;   // over generated tokens after the first
  double p50_token_latency_s = 0.0;
  double p99_token_latency_s = 0.0;
  FinishReason finish_reason = FinishReason::kLength;
  std::string text;                // the whole generated text (after stop-string truncation)
  std::vector<int32_t> token_ids;  // generated ids
  bool degraded = false;           // some step ran without a CPU node's answer
  uint64_t degraded_steps = 0;
  int64_t device_kv_entries = 0;   // per (layer, kv head), at the end
  int64_t cpu_kv_entries = 0;      // per (layer, kv head), at the end
  AttentionMode mode = AttentionMode::kHybrid;
  // mode exact: the split of the session's offloaded KV at the end (OffloadTier::split,
  // exact_planner.h; proto ExactSplit).
  std::optional<TierSplit> exact_split;
};

struct GenerateCallbacks {
  std::function<void(const PrefillProgress&)> on_prefill;   // after each prefill chunk
  // Each generated token; return false to stop generating (finish reason kCancelled).
  std::function<bool(const TokenEvent&)> on_token;
  // Polled between steps (also while the request waits or prefills); true ends it at once with
  // finish reason kCancelled (the client went away).
  std::function<bool()> cancelled;
};

}  // namespace tandem::gpu_worker
