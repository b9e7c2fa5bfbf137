#include "request_fields.h"

#include "tandem/common/status_macros.h"
#include "tandem/gateway/bounded_json.h"

namespace tandem::gateway::internal {
namespace {

// Sampling parameters tandem does not implement (OpenAI's penalties, vLLM's extras and
// structured output): a client that sends one expects it honoured, so a value other than the
// neutral one is refused (400 naming it) rather than ignored with only a line in the log.
absl::Status RefuseUnhonouredSampling(Fields& f) {
  const struct {
    const char* name;
    double neutral;
  } numbers[] = {{"presence_penalty", 0.0}, {"frequency_penalty", 0.0},
                 {"repetition_penalty", 1.0}, {"length_penalty", 1.0}, {"min_p", 0.0},
                 {"min_tokens", 0.0}};
  for (const auto& n : numbers) {
    TANDEM_ASSIGN_OR_RETURN(std::optional<double> v, f.Number(n.name));
    if (v.has_value() && *v != n.neutral) {
      return Unsupported(n.name, absl::StrCat("other than ", n.neutral));
    }
  }
  if (const Json* bias = f.Find("logit_bias"); bias != nullptr) {
    if (!bias->is_object()) return InvalidField("logit_bias", "'logit_bias' must be an object");
    TANDEM_RETURN_IF_ERROR(CheckListSize("logit_bias", bias->size(), kMaxLogitBiasEntries));
    if (!bias->empty()) return Unsupported("logit_bias", "with entries");
  }
  for (const char* constrained : {"guided_json", "guided_regex", "guided_choice",
                                  "guided_grammar", "guided_whitespace_pattern",
                                  "structured_outputs"}) {
    if (f.Find(constrained) != nullptr) {
      return Unsupported(constrained, "(constrained decoding)");
    }
  }
  f.Find("guided_decoding_backend");   // meaningless without the above
  if (const Json* ids = f.Find("stop_token_ids"); ids != nullptr) {
    if (!ids->is_array()) return InvalidField("stop_token_ids", "'stop_token_ids' must be a list");
    TANDEM_RETURN_IF_ERROR(CheckListSize("stop_token_ids", ids->size(), kMaxStopStrings));
    if (!ids->empty()) return Unsupported("stop_token_ids", "with entries (use 'stop')");
  }
  for (const char* flag : {"use_beam_search", "continue_final_message"}) {
    TANDEM_ASSIGN_OR_RETURN(std::optional<bool> v, f.Bool(flag));
    if (v.value_or(false)) return Unsupported(flag, "true");
  }
  return absl::OkStatus();
}

absl::Status ReadStop(Fields& f, v1::GenerateRequest* g) {
  const Json* stop = f.Find("stop");
  if (stop == nullptr) return absl::OkStatus();
  auto add = [g](const Json& s) {
    if (!s.is_string()) return InvalidField("stop", "'stop' must be a string or a list of strings");
    const std::string& text = s.get_ref<const std::string&>();
    if (text.size() > kMaxStopBytes) {
      return InvalidField("stop", absl::StrCat("a 'stop' string has ", text.size(),
                                               " bytes; at most ", kMaxStopBytes));
    }
    g->add_stop(text);
    return absl::OkStatus();
  };
  if (!stop->is_array()) return add(*stop);
  TANDEM_RETURN_IF_ERROR(CheckListSize("stop", stop->size(), kMaxStopStrings));
  for (const Json& s : *stop) TANDEM_RETURN_IF_ERROR(add(s));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Json> ParseBody(std::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(Json j, ParseBoundedJson(body));
  if (!j.is_object()) return absl::InvalidArgumentError("the request body must be a JSON object");
  return j;
}

absl::Status CheckListSize(const std::string& field, size_t size, size_t limit) {
  if (size <= limit) return absl::OkStatus();
  return InvalidField(field, absl::StrCat("'", field, "' has ", size, " entries; at most ",
                                          limit));
}

absl::Status Unsupported(const std::string& field, absl::string_view what) {
  return InvalidField(field, absl::StrCat("'", field, "' ", what, " is not supported by tandem"));
}

absl::Status ReadCommon(Fields& f, OpenAiRequest* r) {
  v1::GenerateRequest& g = r->generate;
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> model, f.String("model"));
  r->model = model.value_or("");
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> stream, f.Bool("stream"));
  r->stream = stream.value_or(false);
  if (const Json* options = f.Find("stream_options"); options != nullptr) {
    if (!options->is_object()) {
      return InvalidField("stream_options", "'stream_options' must be an object");
    }
    if (!r->stream) {
      return InvalidField("stream_options", "'stream_options' is only allowed with stream: true");
    }
    Fields of(*options);
    absl::StatusOr<std::optional<bool>> usage = of.Bool("include_usage");
    if (!usage.ok()) {
      return InvalidField("stream_options.include_usage",
                          "'stream_options.include_usage' must be a boolean");
    }
    r->include_usage = usage->value_or(false);
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> max_tokens, f.Int("max_tokens"));
  if (max_tokens.has_value()) {
    if (*max_tokens < 1 || *max_tokens > kMaxTokensLimit) {
      return InvalidField("max_tokens", absl::StrCat("'max_tokens' must be in 1..", kMaxTokensLimit,
                                                     ", got ", *max_tokens));
    }
    r->max_tokens = *max_tokens;
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<double> temperature, f.Number("temperature"));
  if (temperature.has_value() && !(*temperature >= 0 && *temperature <= 100)) {
    // The worker's range (OpenAI's is 0..2, vLLM takes more).
    return InvalidField("temperature",
                        absl::StrCat("'temperature' must be in 0..100, got ", *temperature));
  }
  g.set_temperature(static_cast<float>(temperature.value_or(1.0)));
  r->temperature_given = temperature.has_value();
  TANDEM_ASSIGN_OR_RETURN(std::optional<double> top_p, f.Number("top_p"));
  if (top_p.has_value()) {
    if (!(*top_p >= 0 && *top_p <= 1)) {
      return InvalidField("top_p", absl::StrCat("'top_p' must be in 0..1, got ", *top_p));
    }
    // 0 keeps only the most probable token (OpenAI's meaning), not "unset" (the proto's 0).
    g.set_top_p(*top_p > 0 ? static_cast<float>(*top_p) : kSmallestTopP);
    r->top_p_given = true;
  }
  TANDEM_RETURN_IF_ERROR(ReadStop(f, &g));
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> seed, f.Int("seed"));
  // Any integer, as OpenAI and vLLM take it (a negative one is its two's complement).
  if (seed.has_value()) g.set_seed(static_cast<uint64_t>(*seed));
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> n, f.Int("n"));
  if (n.has_value() && *n != 1) {
    return InvalidField("n", absl::StrCat("'n' must be 1 (one choice per request), got ", *n,
                                          "; send several requests instead"));
  }
  f.Find("user");  // accepted and ignored, as vLLM does
  TANDEM_RETURN_IF_ERROR(RefuseUnhonouredSampling(f));

  // tandem's fields.
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> mode, f.String("mode"));
  if (mode.has_value()) g.set_mode(*mode);
  TANDEM_ASSIGN_OR_RETURN(std::optional<double> beta, f.Number("beta"));
  if (beta.has_value()) g.set_beta(static_cast<float>(*beta));
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> window, f.Int("window"));
  if (window.has_value()) g.set_window(*window);
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> sink, f.Int("sink"));
  if (sink.has_value()) g.set_sink(*sink);
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> selection, f.String("selection"));
  if (selection.has_value()) g.set_selection(*selection);
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> select_tokens, f.Int("select_tokens"));
  if (select_tokens.has_value()) g.set_select_tokens(*select_tokens);
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> dense_layers, f.Int("dense_layers"));
  if (dense_layers.has_value()) g.set_dense_layers(*dense_layers);
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> session_id, f.String("session_id"));
  if (session_id.has_value()) g.set_session_id(*session_id);
  // vLLM's field: requests share cached prefixes only with the same salt (and API key).
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> cache_salt, f.String("cache_salt"));
  if (cache_salt.has_value()) {
    if (cache_salt->size() > kMaxCacheSaltBytes) {
      return InvalidField("cache_salt", absl::StrCat("cache_salt: ", cache_salt->size(),
                                                     " bytes; at most ", kMaxCacheSaltBytes));
    }
    g.set_cache_salt(*cache_salt);
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> ignore_eos, f.Bool("ignore_eos"));
  g.set_ignore_eos(ignore_eos.value_or(false));
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> top_k, f.Int("top_k"));
  if (top_k.has_value()) {
    if (*top_k < -1 || *top_k > std::numeric_limits<int32_t>::max()) {
      return InvalidField("top_k", "'top_k' must be -1 (no limit), 0 (no limit) or positive");
    }
    g.set_top_k(*top_k == -1 ? 0 : static_cast<int32_t>(*top_k));
    r->top_k_given = true;
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> progress, f.Bool("return_progress"));
  r->return_progress = progress.value_or(false);
  return absl::OkStatus();
}


}  // namespace tandem::gateway::internal
