#include "tandem/gateway/openai_request.h"

#include <cmath>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"
#include "tandem/gateway/api_error.h"
#include "tandem/gateway/bounded_json.h"

namespace tandem::gateway {
namespace {

using Json = nlohmann::ordered_json;

// Largest max_tokens accepted here (the worker caps it again at its context).
constexpr int64_t kMaxTokensLimit = 1 << 20;
// The worker takes 256 bytes of salt; the gateway prefixes the API key's principal.
constexpr size_t kMaxCacheSaltBytes = 128;
// top_p 0 as the worker reads it: a mass no token falls below, so only the most probable one
// is kept (the sampler always keeps it).
constexpr float kSmallestTopP = 1e-30f;

// Reads typed fields of one JSON object, remembering which keys were read so the rest can be
// reported as ignored. A null value reads as absent.
class Fields {
 public:
  explicit Fields(const Json& object) : object_(object) {}

  const Json* Find(const std::string& key) {
    seen_.insert(key);
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::StatusOr<std::optional<bool>> Bool(const std::string& key) {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<bool>();
    if (!v->is_boolean()) return InvalidField(key, absl::StrCat("'", key, "' must be a boolean"));
    return std::optional<bool>(v->get<bool>());
  }

  absl::StatusOr<std::optional<double>> Number(const std::string& key) {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<double>();
    if (!v->is_number()) return InvalidField(key, absl::StrCat("'", key, "' must be a number"));
    return std::optional<double>(v->get<double>());
  }

  // An integer (a float with an integral value, e.g. 16.0, is accepted as pydantic does).
  absl::StatusOr<std::optional<int64_t>> Int(const std::string& key) {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<int64_t>();
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() &&
          v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return InvalidField(key, absl::StrCat("'", key, "' is out of range"));
      }
      return std::optional<int64_t>(v->get<int64_t>());
    }
    if (v->is_number_float()) {
      const double d = v->get<double>();
      if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.0e15) {
        return std::optional<int64_t>(static_cast<int64_t>(d));
      }
    }
    return InvalidField(key, absl::StrCat("'", key, "' must be an integer"));
  }

  absl::StatusOr<std::optional<std::string>> String(const std::string& key) {
    const Json* v = Find(key);
    if (v == nullptr) return std::optional<std::string>();
    if (!v->is_string()) return InvalidField(key, absl::StrCat("'", key, "' must be a string"));
    return std::optional<std::string>(v->get<std::string>());
  }

  std::vector<std::string> Unread() const {
    std::vector<std::string> keys;
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (!seen_.contains(it.key())) keys.push_back(it.key());
    }
    return keys;
  }

 private:
  const Json& object_;
  std::set<std::string> seen_;
};

absl::StatusOr<Json> ParseBody(std::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(Json j, ParseBoundedJson(body));
  if (!j.is_object()) return absl::InvalidArgumentError("the request body must be a JSON object");
  return j;
}

// A list field over its bound: 400 naming it.
absl::Status CheckListSize(const std::string& field, size_t size, size_t limit) {
  if (size <= limit) return absl::OkStatus();
  return InvalidField(field, absl::StrCat("'", field, "' has ", size, " entries; at most ",
                                          limit));
}

absl::Status Unsupported(const std::string& field, absl::string_view what) {
  return InvalidField(field, absl::StrCat("'", field, "' ", what, " is not supported by tandem"));
}

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

// Fields both endpoints share: sampling, streaming, tandem's extras, refused options.
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

// A JSON integer that is a token id (0..int32 max); the worker checks it against its vocabulary.
bool IsTokenId(const Json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 &&
         v.get<int64_t>() <= std::numeric_limits<int32_t>::max();
}

absl::Status ReadPrompt(Fields& f, v1::GenerateRequest* g) {
  const Json* prompt = f.Find("prompt");
  if (prompt == nullptr) return InvalidField("prompt", "'prompt' is required");
  const Json* one = prompt;
  // A list of prompts: one element is that prompt; several are refused (one choice per request).
  if (prompt->is_array() && !prompt->empty() &&
      ((*prompt)[0].is_string() || (*prompt)[0].is_array())) {
    if (prompt->size() != 1) {
      return InvalidField("prompt", absl::StrCat("'prompt' holds ", prompt->size(),
                                                 " prompts; tandem takes one prompt per request"));
    }
    one = &(*prompt)[0];
  }
  if (one->is_string()) {
    if (one->get_ref<const std::string&>().empty()) {
      return InvalidField("prompt", "'prompt' must not be empty");
    }
    g->set_prompt_text(one->get<std::string>());
    return absl::OkStatus();
  }
  if (one->is_array()) {
    if (one->empty()) return InvalidField("prompt", "'prompt' must not be empty");
    v1::TokenIds* ids = g->mutable_prompt_ids();
    ids->mutable_ids()->Reserve(static_cast<int>(one->size()));
    for (const Json& id : *one) {
      if (!IsTokenId(id)) {
        return InvalidField("prompt", "'prompt' token ids must be integers in 0..2147483647");
      }
      ids->add_ids(static_cast<int32_t>(id.get<int64_t>()));
    }
    return absl::OkStatus();
  }
  return InvalidField("prompt", "'prompt' must be a string or a list of token ids");
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseCompletionRequest(std::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(Json j, ParseBody(body));
  OpenAiRequest r;
  r.endpoint = Endpoint::kCompletions;
  Fields f(j);
  TANDEM_RETURN_IF_ERROR(ReadCommon(f, &r));
  TANDEM_RETURN_IF_ERROR(ReadPrompt(f, &r.generate));
  if (const Json* lp = f.Find("logprobs"); lp != nullptr) {
    if (!lp->is_number_integer() || lp->get<int64_t>() < 0 || lp->get<int64_t>() > 5) {
      return InvalidField("logprobs", "'logprobs' must be an integer in 0..5 for completions");
    }
    r.logprobs = true;
    r.top_logprobs = static_cast<int>(lp->get<int64_t>());
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> echo, f.Bool("echo"));
  if (echo.value_or(false)) return Unsupported("echo", "true");
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> suffix, f.String("suffix"));
  if (suffix.has_value() && !suffix->empty()) return Unsupported("suffix", "(insertion)");
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> best_of, f.Int("best_of"));
  if (best_of.has_value() && *best_of != 1) return Unsupported("best_of", "other than 1");
  r.generate.set_logprobs(r.logprobs);
  r.generate.set_top_logprobs(r.top_logprobs);
  r.ignored_fields = f.Unread();
  return r;
}

absl::StatusOr<OpenAiRequest> ParseChatRequest(std::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(Json j, ParseBody(body));
  OpenAiRequest r;
  r.endpoint = Endpoint::kChatCompletions;
  Fields f(j);
  TANDEM_RETURN_IF_ERROR(ReadCommon(f, &r));
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> max_completion, f.Int("max_completion_tokens"));
  if (max_completion.has_value()) {
    if (*max_completion < 1 || *max_completion > kMaxTokensLimit) {
      return InvalidField("max_completion_tokens",
                          absl::StrCat("'max_completion_tokens' must be in 1..", kMaxTokensLimit));
    }
    r.max_tokens = *max_completion;
  }
  const Json* messages = f.Find("messages");
  if (messages == nullptr) return InvalidField("messages", "'messages' is required");
  if (!messages->is_array() || messages->empty()) {
    return InvalidField("messages", "'messages' must be a non-empty list of messages");
  }
  TANDEM_RETURN_IF_ERROR(CheckListSize("messages", messages->size(), kMaxMessages));
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& m = (*messages)[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return InvalidField(where, absl::StrCat("'", where, "' must be an object"));
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return InvalidField(where + ".role", absl::StrCat("'", where, ".role' must be a string"));
    }
    auto content = m.find("content");
    if (content != m.end() && !content->is_string() && !content->is_array() &&
        !content->is_null()) {
      return InvalidField(where + ".content", absl::StrCat("'", where,
                                                           ".content' must be a string, a list "
                                                           "of parts or null"));
    }
  }
  r.messages = *messages;
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> logprobs, f.Bool("logprobs"));
  r.logprobs = logprobs.value_or(false);
  TANDEM_ASSIGN_OR_RETURN(std::optional<int64_t> top, f.Int("top_logprobs"));
  if (top.has_value()) {
    if (*top < 0 || *top > 20)
      return InvalidField("top_logprobs", "'top_logprobs' must be in 0..20");
    if (*top > 0 && !r.logprobs) {
      return InvalidField("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    }
    r.top_logprobs = static_cast<int>(*top);
  }
  if (const Json* tools = f.Find("tools"); tools != nullptr) {
    if (!tools->is_array()) return InvalidField("tools", "'tools' must be a list");
    TANDEM_RETURN_IF_ERROR(CheckListSize("tools", tools->size(), kMaxTools));
    if (!tools->empty()) r.tools = *tools;
  }
  const Json* choice = f.Find("tool_choice");
  if (choice != nullptr && (!choice->is_string() || (*choice != "none" && *choice != "auto"))) {
    return Unsupported("tool_choice", "other than \"none\" or \"auto\"");
  }
  // With tools, OpenAI's default choice is "auto": the model may call one, and the client waits
  // for `tool_calls`. tandem renders the tools into the prompt but does not parse calls out of
  // the model's text, so it takes tools only with tool_choice "none" (as vLLM without
  // --enable-auto-tool-choice).
  if (!r.tools.is_null() && (choice == nullptr || *choice == "auto")) {
    return InvalidField("tool_choice",
                        "'tools' with tool_choice \"auto\" (the default) is not supported by "
                        "tandem: it does not parse tool calls from the model's output; send "
                        "\"tool_choice\": \"none\" to have the tools rendered into the prompt only");
  }
  f.Find("parallel_tool_calls");
  if (const Json* format = f.Find("response_format"); format != nullptr) {
    if (!format->is_object() || !format->contains("type") || (*format)["type"] != "text") {
      return Unsupported("response_format", "other than {\"type\": \"text\"}");
    }
  }
  if (const Json* kwargs = f.Find("chat_template_kwargs"); kwargs != nullptr) {
    if (!kwargs->is_object()) {
      return InvalidField("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    }
    r.template_kwargs = *kwargs;
  }
  TANDEM_ASSIGN_OR_RETURN(std::optional<bool> add_prompt, f.Bool("add_generation_prompt"));
  r.add_generation_prompt = add_prompt.value_or(true);
  r.generate.set_logprobs(r.logprobs);
  r.generate.set_top_logprobs(r.top_logprobs);
  r.ignored_fields = f.Unread();
  return r;
}

void ApplyModelDefaults(const v1::ModelInfoResponse& info, OpenAiRequest* r) {
  v1::GenerateRequest& g = r->generate;
  if (!r->temperature_given && info.has_default_temperature()) {
    g.set_temperature(info.default_temperature());
  }
  if (!r->top_p_given && info.has_default_top_p()) g.set_top_p(info.default_top_p());
  if (!r->top_k_given && info.has_default_top_k()) g.set_top_k(info.default_top_k());
}

}  // namespace tandem::gateway
