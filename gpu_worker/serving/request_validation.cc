#include "tandem/gpu_worker/request_validation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "tandem/gpu_worker/logprobs.h"

namespace tandem::gpu_worker {

absl::Status ValidateSessionId(const std::string& id) {
  if (id.size() > kMaxSessionIdLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_id is longer than ", kMaxSessionIdLength, " characters"));
  }
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError("session_id may contain only letters, digits and . _ : -");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateGenerateRequest(const GenerateRequest& request, int64_t max_context) {
  if (request.prompt_text.empty() && request.prompt_ids.empty() &&
      !request.prompt_text_ids.has_value()) {
    return absl::InvalidArgumentError("prompt: empty; set prompt_text or prompt_ids");
  }
  const int64_t max_tokens_limit =
      max_context > 0 ? std::min(kMaxRequestTokens, max_context) : kMaxRequestTokens;
  if (request.max_tokens < 1 || request.max_tokens > max_tokens_limit) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be in 1..", max_tokens_limit,
                                                   ", got ", request.max_tokens));
  }
  const SamplingOptions& sampling = request.sampling;
  if (!std::isfinite(sampling.temperature) || sampling.temperature < 0 ||
      sampling.temperature > kMaxRequestTemperature) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be in 0..",
                                                   kMaxRequestTemperature, ", got ",
                                                   sampling.temperature));
  }
  if (!(sampling.top_p > 0 && sampling.top_p <= 1)) {   // also rejects NaN
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1], got ", sampling.top_p));
  }
  if (sampling.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be >= 0 (0 = no limit), got ", sampling.top_k));
  }
  if (request.stop.size() > kMaxRequestStops) {
    return absl::InvalidArgumentError(absl::StrCat("stop: at most ", kMaxRequestStops,
                                                   " strings, got ", request.stop.size()));
  }
  for (size_t i = 0; i < request.stop.size(); ++i) {
    const size_t bytes = request.stop[i].size();
    if (bytes == 0 || bytes > kMaxRequestStopBytes) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] must be 1..",
                                                     kMaxRequestStopBytes, " bytes, got ", bytes));
    }
  }
  if (request.top_logprobs < 0 || request.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("top_logprobs must be in 0..", kMaxTopLogprobs,
                                                   ", got ", request.top_logprobs));
  }
  if (request.top_logprobs > 0 && !request.logprobs) {
    return absl::InvalidArgumentError("top_logprobs > 0 requires logprobs");
  }
  if (request.beta.has_value() && !(std::isfinite(*request.beta) && *request.beta >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("beta must be finite and >= 0, got ", *request.beta));
  }
  if (request.window.has_value() && *request.window < 0) {
    return absl::InvalidArgumentError(absl::StrCat("window must be >= 0, got ", *request.window));
  }
  if (request.sink.has_value() && *request.sink < 0) {
    return absl::InvalidArgumentError(absl::StrCat("sink must be >= 0, got ", *request.sink));
  }
  if (request.select_tokens.has_value() && *request.select_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("select_tokens must be >= 1, got ", *request.select_tokens));
  }
  if (request.dense_layers.has_value() && *request.dense_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense_layers must be >= 0, got ", *request.dense_layers));
  }
  if (request.centroid_share.has_value() &&
      !(*request.centroid_share >= 0.0 && *request.centroid_share <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("centroid_share must be in [0, 1], got ", *request.centroid_share));
  }
  // Exact mode attends every offloaded entry (on the nodes and from host pages): the selection
  // knobs of hybrid mode would silently mean nothing, so they are refused.
  if (request.mode == AttentionMode::kExact &&
      (request.beta.has_value() || request.selection.has_value() ||
       request.select_tokens.has_value() || request.dense_layers.has_value() ||
       request.centroid_share.has_value() || request.page_low_rank.has_value())) {
    return absl::InvalidArgumentError(
        "mode exact attends every offloaded entry: beta, selection, select_tokens, "
        "dense_layers, centroid_share and page_low_rank do not apply (leave them unset)");
  }
  return ValidateSessionId(request.session_id);
}

}  // namespace tandem::gpu_worker
