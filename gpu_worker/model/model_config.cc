#include "tandem/gpu_worker/model_config.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <numbers>
#include <string>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "json_fields.h"
#include "nlohmann/json.hpp"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

using internal::FindField;
using internal::JsonToBool;
using internal::JsonToDouble;
using internal::JsonToInt64;
using internal::JsonToString;
using nlohmann::json;

// The Llama family: same block (RMSNorm, GQA attention with half-split RoPE, SwiGLU MLP).
struct FamilyMember {
  absl::string_view model_type;
  absl::string_view architecture;
  int64_t default_max_position_embeddings;  // transformers' *Config default
};
// qwen3 adds an RMSNorm of every q and k head before RoPE (ModelConfig::qk_norm).
constexpr std::array<FamilyMember, 4> kFamily = {{
    {"llama", "LlamaForCausalLM", 2048},
    {"mistral", "MistralForCausalLM", 131072},
    {"qwen2", "Qwen2ForCausalLM", 32768},
    {"qwen3", "Qwen3ForCausalLM", 32768},
}};

// Upper bounds: far above any real Llama-family model, low enough that products of them
// (e.g. vocab * hidden) cannot overflow int64 and a corrupt config cannot ask for absurd memory.
constexpr int64_t kMaxHidden = 65536;
constexpr int64_t kMaxIntermediate = 1 << 20;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kMaxVocab = 4 << 20;
constexpr int64_t kMaxPositions = int64_t{1} << 30;

std::string Where(absl::string_view source, absl::string_view field) {
  return absl::StrCat(source, ": ", field);
}

absl::Status Invalid(absl::string_view source, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", message));
}

// Reads integer field `key` into *out, which keeps its value when the field is absent/null and
// `required` is false. Checks 1 <= value <= max.
absl::Status ReadSize(const json& obj, absl::string_view key, bool required, int64_t max,
                      absl::string_view source, int64_t* out) {
  const json* field = FindField(obj, key);
  if (field == nullptr) {
    if (required) return Invalid(source, absl::StrCat("missing required field \"", key, "\""));
    return absl::OkStatus();
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t value, JsonToInt64(*field, Where(source, key)));
  if (value < 1 || value > max) {
    return Invalid(source, absl::StrCat(key, " = ", value, " is out of range [1, ", max, "]"));
  }
  *out = value;
  return absl::OkStatus();
}

// Reads integer field `key` (0 <= value <= kMaxLayers) into *out, which keeps its value when
// the field is absent or null.
absl::Status ReadNonNegativeSize(const json& obj, absl::string_view key, absl::string_view source,
                                 int64_t* out) {
  const json* field = FindField(obj, key);
  if (field == nullptr) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(int64_t value, JsonToInt64(*field, Where(source, key)));
  if (value < 0 || value > kMaxLayers) {
    return Invalid(source,
                   absl::StrCat(key, " = ", value, " is out of range [0, ", kMaxLayers, "]"));
  }
  *out = value;
  return absl::OkStatus();
}

// Reads a positive finite number field; *out keeps its value when absent.
absl::Status ReadPositive(const json& obj, absl::string_view key, absl::string_view source,
                          double* out) {
  const json* field = FindField(obj, key);
  if (field == nullptr) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(double value, JsonToDouble(*field, Where(source, key)));
  if (!(value > 0)) return Invalid(source, absl::StrCat(key, " = ", value, " must be > 0"));
  *out = value;
  return absl::OkStatus();
}

absl::StatusOr<int32_t> ReadTokenId(const json& value, absl::string_view where) {
  TANDEM_ASSIGN_OR_RETURN(int64_t id, JsonToInt64(value, where));
  if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": token id ", id, " is out of range"));
  }
  return static_cast<int32_t>(id);
}

// eos_token_id is an int or a list of ints.
absl::StatusOr<std::vector<int32_t>> ReadTokenIds(const json& value, absl::string_view where) {
  std::vector<int32_t> ids;
  if (value.is_array()) {
    for (const json& item : value) {
      TANDEM_ASSIGN_OR_RETURN(int32_t id, ReadTokenId(item, where));
      ids.push_back(id);
    }
  } else {
    TANDEM_ASSIGN_OR_RETURN(int32_t id, ReadTokenId(value, where));
    ids.push_back(id);
  }
  return ids;
}

// Overrides config->bos_token_id with the non-null one in `obj` and adds its eos_token_id(s)
// to config->eos_token_ids (kept in order of first appearance, without repeats): chat models
// list their turn-end tokens in generation_config.json beside config.json's single EOS.
absl::Status ReadSpecialTokens(const json& obj, absl::string_view source, ModelConfig* config) {
  if (const json* bos = FindField(obj, "bos_token_id")) {
    TANDEM_ASSIGN_OR_RETURN(config->bos_token_id, ReadTokenId(*bos, Where(source, "bos_token_id")));
  }
  if (const json* eos = FindField(obj, "eos_token_id")) {
    TANDEM_ASSIGN_OR_RETURN(const std::vector<int32_t> ids,
                            ReadTokenIds(*eos, Where(source, "eos_token_id")));
    for (const int32_t id : ids) {
      std::vector<int32_t>& set = config->eos_token_ids;
      if (std::find(set.begin(), set.end(), id) == set.end()) set.push_back(id);
    }
  }
  return absl::OkStatus();
}

// generation_config.json's temperature (0..100), top_p ((0, 1]) and top_k (>= 0), as vLLM's
// --generation-config auto takes them; absent or null fields stay unset.
absl::Status ReadSamplingDefaults(const json& obj, absl::string_view source,
                                  SamplingDefaults* out) {
  if (const json* t = FindField(obj, "temperature")) {
    TANDEM_ASSIGN_OR_RETURN(double v, JsonToDouble(*t, Where(source, "temperature")));
    if (!(v >= 0 && v <= 100)) {
      return Invalid(source, absl::StrCat("temperature = ", v, " must be in 0..100"));
    }
    out->temperature = static_cast<float>(v);
  }
  if (const json* p = FindField(obj, "top_p")) {
    TANDEM_ASSIGN_OR_RETURN(double v, JsonToDouble(*p, Where(source, "top_p")));
    if (!(v > 0 && v <= 1)) {
      return Invalid(source, absl::StrCat("top_p = ", v, " must be in (0, 1]"));
    }
    out->top_p = static_cast<float>(v);
  }
  if (const json* k = FindField(obj, "top_k")) {
    TANDEM_ASSIGN_OR_RETURN(int64_t v, JsonToInt64(*k, Where(source, "top_k")));
    if (v < 0 || v > std::numeric_limits<int32_t>::max()) {
      return Invalid(source, absl::StrCat("top_k = ", v, " must be >= 0"));
    }
    out->top_k = static_cast<int32_t>(v);
  }
  return absl::OkStatus();
}

// Reads a non-negative number field into *out, which keeps its value when the field is absent
// or null. transformers treats 0 as "not set" for beta_fast, beta_slow, mscale, mscale_all_dim
// (`x or default`), so the caller's default of 0 or the field's default carries that meaning.
absl::Status ReadNonNegative(const json& obj, absl::string_view key, absl::string_view source,
                             double* out) {
  const json* field = FindField(obj, key);
  if (field == nullptr) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(double value, JsonToDouble(*field, Where(source, key)));
  if (!(value >= 0) || !std::isfinite(value)) {
    return Invalid(source, absl::StrCat(key, " = ", value, " must be a finite number >= 0"));
  }
  *out = value;
  return absl::OkStatus();
}

// The "yarn" fields of transformers 5's _compute_yarn_parameters / _validate_yarn_rope_parameters.
// `top` is the whole config.json, `max_positions` its max_position_embeddings.
absl::Status ReadYarn(const json& params, const json& top, absl::string_view source,
                      absl::string_view name, int64_t max_positions, RopeScaling* scaling) {
  const std::string where = Where(source, name);
  scaling->type = RopeScaling::Type::kYarn;
  if (!params.contains("factor")) {
    return Invalid(source, absl::StrCat("rope type \"yarn\" needs ", name, ".factor"));
  }
  // standardize_rope_params: a top-level original_max_position_embeddings (Phi-3 style) wins,
  // then the scaling's own, else max_position_embeddings.
  scaling->original_max_position_embeddings = max_positions;
  TANDEM_RETURN_IF_ERROR(ReadSize(params, "original_max_position_embeddings", false, kMaxPositions,
                                  where, &scaling->original_max_position_embeddings));
  TANDEM_RETURN_IF_ERROR(ReadSize(top, "original_max_position_embeddings", false, kMaxPositions,
                                  source, &scaling->original_max_position_embeddings));
  if (FindField(params, "factor") == nullptr) {  // "factor": null (DeepSeek-V3 style)
    scaling->factor = static_cast<double>(max_positions) /
                      static_cast<double>(scaling->original_max_position_embeddings);
  } else {
    TANDEM_RETURN_IF_ERROR(ReadPositive(params, "factor", where, &scaling->factor));
  }
  TANDEM_RETURN_IF_ERROR(
      ReadPositive(params, "attention_factor", where, &scaling->attention_factor));
  double beta_fast = 0, beta_slow = 0;
  TANDEM_RETURN_IF_ERROR(ReadNonNegative(params, "beta_fast", where, &beta_fast));
  TANDEM_RETURN_IF_ERROR(ReadNonNegative(params, "beta_slow", where, &beta_slow));
  if (beta_fast > 0) scaling->beta_fast = beta_fast;
  if (beta_slow > 0) scaling->beta_slow = beta_slow;
  TANDEM_RETURN_IF_ERROR(ReadNonNegative(params, "mscale", where, &scaling->mscale));
  TANDEM_RETURN_IF_ERROR(
      ReadNonNegative(params, "mscale_all_dim", where, &scaling->mscale_all_dim));
  if (const json* truncate = FindField(params, "truncate")) {
    TANDEM_ASSIGN_OR_RETURN(scaling->truncate, JsonToBool(*truncate, Where(where, "truncate")));
  }
  if (const json* partial = FindField(params, "partial_rotary_factor")) {
    TANDEM_ASSIGN_OR_RETURN(double value,
                            JsonToDouble(*partial, Where(where, "partial_rotary_factor")));
    if (value != 1.0) return Invalid(source, "partial_rotary_factor != 1 is not supported");
  }
  return absl::OkStatus();
}

// Sets config->sliding_window from Mistral's `sliding_window` (transformers' MistralConfig
// default 4096 when the key is absent, none when null) or Qwen2's (only with
// use_sliding_window true, and only when some layer, those from max_window_layers on, uses it).
absl::Status ReadSlidingWindow(const json& obj, absl::string_view source, ModelConfig* config) {
  config->sliding_window = 0;
  if (config->model_type == "llama") return absl::OkStatus();
  int64_t window = 0;
  const bool present = obj.is_object() && obj.contains("sliding_window");
  if (config->model_type == "mistral") {
    if (!present) window = 4096;
  } else {  // qwen2, qwen3: the same switch and first windowed layer
    const json* use = FindField(obj, "use_sliding_window");
    bool used = false;
    if (use != nullptr) {
      TANDEM_ASSIGN_OR_RETURN(used, JsonToBool(*use, Where(source, "use_sliding_window")));
    }
    if (!used) return absl::OkStatus();
    int64_t first_layer = 28;  // Qwen2Config's max_window_layers default
    TANDEM_RETURN_IF_ERROR(ReadNonNegativeSize(obj, "max_window_layers", source, &first_layer));
    if (first_layer >= config->num_layers) return absl::OkStatus();
    if (!present) window = 4096;
  }
  if (FindField(obj, "sliding_window") != nullptr) {
    TANDEM_RETURN_IF_ERROR(ReadSize(obj, "sliding_window", true, kMaxPositions, source, &window));
  }
  config->sliding_window = window;
  return absl::OkStatus();
}

// quantization_config: FP8 weight schemes (e4m3 matrices with per-row or per-tensor scales,
// model_weights.h) set config->quantization to "fp8"; every other method or scheme is refused by
// name, so a quantized checkpoint never loads as garbage. Activation settings are not read:
// activations stay in the compute dtype (weight-only FP8).
absl::Status ReadQuantization(const json& obj, absl::string_view source, ModelConfig* config) {
  const json* q = FindField(obj, "quantization_config");
  if (q == nullptr) return absl::OkStatus();
  const std::string where = Where(source, "quantization_config");
  if (!q->is_object()) return internal::TypeError(where, "an object", *q);
  const json* method_field = FindField(*q, "quant_method");
  if (method_field == nullptr) return Invalid(source, "quantization_config has no quant_method");
  TANDEM_ASSIGN_OR_RETURN(std::string method,
                          JsonToString(*method_field, absl::StrCat(where, ".quant_method")));
  const std::string refused =
      absl::StrCat("quantization_config: ", method,
                   " is not supported (FP8 e4m3 weights with per-channel or per-tensor scales are: "
                   "fbgemm_fp8, fp8 without weight_block_size, compressed-tensors float 8-bit)");
  if (method == "fbgemm_fp8") {
    config->quantization = "fp8";
    return absl::OkStatus();
  }
  if (method == "fp8") {
    const json* block = FindField(*q, "weight_block_size");
    if (block != nullptr) {
      return Invalid(source, absl::StrCat(refused,
                                          "; block-wise scales (weight_block_size) are "
                                          "not supported"));
    }
    config->quantization = "fp8";
    return absl::OkStatus();
  }
  if (method != "compressed-tensors") return Invalid(source, refused);
  const json* groups = FindField(*q, "config_groups");
  if (groups == nullptr || !groups->is_object() || groups->empty()) {
    return Invalid(source, absl::StrCat(refused, "; config_groups is missing"));
  }
  for (const auto& [name, group] : groups->items()) {
    const json* weights = group.is_object() ? FindField(group, "weights") : nullptr;
    const json* bits =
        weights != nullptr && weights->is_object() ? FindField(*weights, "num_bits") : nullptr;
    const json* type =
        weights != nullptr && weights->is_object() ? FindField(*weights, "type") : nullptr;
    const json* strategy =
        weights != nullptr && weights->is_object() ? FindField(*weights, "strategy") : nullptr;
    const bool fp8 = bits != nullptr && bits->is_number_integer() && bits->get<int64_t>() == 8 &&
                     type != nullptr && type->is_string() && type->get<std::string>() == "float";
    const bool scaled = strategy == nullptr ||
                        (strategy->is_string() && (strategy->get<std::string>() == "channel" ||
                                                   strategy->get<std::string>() == "tensor"));
    if (!fp8 || !scaled) {
      return Invalid(source, absl::StrCat(refused, "; config group \"", name,
                                          "\" quantizes weights otherwise"));
    }
  }
  config->quantization = "fp8";
  return absl::OkStatus();
}

// The largest magnitude a RoPE scaling parameter may have. Real models stay far below it
// (Llama-4 factor 16, YaRN 40, dynamic NTK 2-8, beta_fast 32); the formulas run in f32, where a
// factor near FLT_MAX makes `factor·L/max - (factor - 1)` inf - inf and every frequency NaN
// (found by model_config_fuzzer).
constexpr double kMaxRopeParameter = 1e6;

// RoPE's base: frequencies base^(-2i/d) only fall with i for a base above 1, and YaRN divides by
// ln(base); a base at or below 1 made the frequencies inf or NaN (model_config_fuzzer: 1e-300 and
// 1.0). Real bases run from 1e4 to ~1e8; the cap keeps base^(2i/d) finite in f32.
constexpr double kMaxRopeTheta = 1e12;

absl::Status CheckRopeTheta(double rope_theta, absl::string_view source) {
  if (rope_theta > 1.0 && rope_theta <= kMaxRopeTheta) return absl::OkStatus();
  return Invalid(source, absl::StrCat("rope_theta = ", rope_theta, " must be in (1, ",
                                      kMaxRopeTheta, "] (real models use 1e4 to ~1e8)"));
}

absl::Status CheckRopeParameters(const RopeScaling& s, absl::string_view source,
                                 absl::string_view name) {
  const std::pair<const char*, double> values[] = {
      {"factor", s.factor},           {"low_freq_factor", s.low_freq_factor},
      {"high_freq_factor", s.high_freq_factor}, {"beta_fast", s.beta_fast},
      {"beta_slow", s.beta_slow},     {"attention_factor", s.attention_factor},
      {"mscale", s.mscale},           {"mscale_all_dim", s.mscale_all_dim}};
  for (const auto& [key, value] : values) {
    if (!(std::abs(value) <= kMaxRopeParameter)) {
      return Invalid(source, absl::StrCat(name, ".", key, " = ", value, " is beyond ",
                                          kMaxRopeParameter, " (no model scales RoPE so far)"));
    }
  }
  return absl::OkStatus();
}

// `params` is a rope_scaling or rope_parameters object: {rope_type|type, factor, ...}.
// `top` is the whole config.json, `max_positions` its max_position_embeddings (yarn's defaults).
absl::Status ReadRopeScaling(const json& params, const json& top, absl::string_view source,
                             absl::string_view name, int64_t max_positions, RopeScaling* scaling) {
  if (!params.is_object()) {
    return internal::TypeError(Where(source, name), "an object", params);
  }
  const json* type_field = FindField(params, "rope_type");
  if (type_field == nullptr) type_field = FindField(params, "type");
  std::string type = "default";
  if (type_field != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(type, JsonToString(*type_field, Where(source, name)));
  }
  const std::string prefix = absl::StrCat(name, ".");
  auto require_positive = [&](absl::string_view key, double* out) -> absl::Status {
    if (FindField(params, key) == nullptr) {
      return Invalid(source, absl::StrCat("rope type \"", type, "\" needs ", prefix, key));
    }
    return ReadPositive(params, key, Where(source, name), out);
  };
  *scaling = RopeScaling{};
  if (type == "default") return absl::OkStatus();
  if (type == "linear") {
    scaling->type = RopeScaling::Type::kLinear;
    return require_positive("factor", &scaling->factor);
  }
  if (type == "dynamic") {
    scaling->type = RopeScaling::Type::kDynamic;
    return require_positive("factor", &scaling->factor);
  }
  if (type == "yarn") return ReadYarn(params, top, source, name, max_positions, scaling);
  if (type == "llama3") {
    scaling->type = RopeScaling::Type::kLlama3;
    TANDEM_RETURN_IF_ERROR(require_positive("factor", &scaling->factor));
    TANDEM_RETURN_IF_ERROR(require_positive("low_freq_factor", &scaling->low_freq_factor));
    TANDEM_RETURN_IF_ERROR(require_positive("high_freq_factor", &scaling->high_freq_factor));
    if (FindField(params, "original_max_position_embeddings") == nullptr) {
      return Invalid(source, absl::StrCat("rope type \"llama3\" needs ", prefix,
                                          "original_max_position_embeddings"));
    }
    TANDEM_RETURN_IF_ERROR(ReadSize(params, "original_max_position_embeddings", true, kMaxPositions,
                                    Where(source, name),
                                    &scaling->original_max_position_embeddings));
    // transformers rejects this too: the interpolation divides by (high - low).
    if (!(scaling->high_freq_factor > scaling->low_freq_factor)) {
      return Invalid(source, absl::StrCat(prefix, "high_freq_factor must exceed low_freq_factor"));
    }
    return absl::OkStatus();
  }
  return Invalid(source, absl::StrCat("unsupported rope type \"", type, "\" in ", name,
                                      " (supported: default, linear, llama3, yarn, dynamic)"));
}

absl::StatusOr<DType> ReadDType(const json& obj, absl::string_view source) {
  // transformers 5 writes "dtype", older versions "torch_dtype".
  absl::string_view key = "dtype";
  const json* field = FindField(obj, key);
  if (field == nullptr) {
    key = "torch_dtype";
    field = FindField(obj, key);
  }
  if (field == nullptr) return DType::kF32;
  TANDEM_ASSIGN_OR_RETURN(std::string name, JsonToString(*field, Where(source, key)));
  if (name == "float32" || name == "float") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16" || name == "half") return DType::kF16;
  return Invalid(
      source, absl::StrCat(key, " \"", name, "\" is not supported (float32, bfloat16, float16)"));
}

// Sets config->model_type from model_type and/or architectures, rejecting non-Llama models.
absl::Status ReadModelType(const json& obj, absl::string_view source, ModelConfig* config) {
  const FamilyMember* member = nullptr;
  if (const json* type_field = FindField(obj, "model_type")) {
    TANDEM_ASSIGN_OR_RETURN(std::string type,
                            JsonToString(*type_field, Where(source, "model_type")));
    for (const FamilyMember& m : kFamily) {
      if (m.model_type == type) member = &m;
    }
    if (member == nullptr) {
      return Invalid(source, absl::StrCat("model_type \"", type,
                                          "\" is not a Llama-family model (supported: llama, "
                                          "mistral, qwen2, qwen3)"));
    }
  }
  if (const json* archs = FindField(obj, "architectures")) {
    if (!archs->is_array()) {
      return internal::TypeError(Where(source, "architectures"), "a list", *archs);
    }
    for (const json& arch_field : *archs) {
      TANDEM_ASSIGN_OR_RETURN(std::string arch,
                              JsonToString(arch_field, Where(source, "architectures")));
      const FamilyMember* arch_member = nullptr;
      for (const FamilyMember& m : kFamily) {
        if (m.architecture == arch) arch_member = &m;
      }
      if (arch_member == nullptr) {
        return Invalid(source, absl::StrCat("architecture \"", arch,
                                            "\" is not a Llama-family causal LM (supported: "
                                            "LlamaForCausalLM, MistralForCausalLM, "
                                            "Qwen2ForCausalLM, Qwen3ForCausalLM)"));
      }
      if (member == nullptr) member = arch_member;
    }
  }
  if (member == nullptr) return Invalid(source, "neither model_type nor architectures is given");
  config->model_type.assign(member->model_type.data(), member->model_type.size());
  config->max_position_embeddings = member->default_max_position_embeddings;
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseConfigText(std::string_view text, absl::string_view source) {
  TANDEM_ASSIGN_OR_RETURN(json obj, internal::ParseJsonObject(text, source));
  ModelConfig config;
  TANDEM_RETURN_IF_ERROR(ReadModelType(obj, source, &config));

  if (const json* act = FindField(obj, "hidden_act")) {
    TANDEM_ASSIGN_OR_RETURN(std::string name, JsonToString(*act, Where(source, "hidden_act")));
    if (name != "silu") {
      return Invalid(source, absl::StrCat("hidden_act \"", name, "\" is not supported (silu)"));
    }
  }

  TANDEM_RETURN_IF_ERROR(
      ReadSize(obj, "hidden_size", true, kMaxHidden, source, &config.hidden_size));
  TANDEM_RETURN_IF_ERROR(ReadSize(obj, "intermediate_size", true, kMaxIntermediate, source,
                                  &config.intermediate_size));
  TANDEM_RETURN_IF_ERROR(
      ReadSize(obj, "num_hidden_layers", true, kMaxLayers, source, &config.num_layers));
  TANDEM_RETURN_IF_ERROR(
      ReadSize(obj, "num_attention_heads", true, kMaxHeads, source, &config.num_q_heads));
  config.num_kv_heads = config.num_q_heads;
  TANDEM_RETURN_IF_ERROR(
      ReadSize(obj, "num_key_value_heads", false, kMaxHeads, source, &config.num_kv_heads));
  if (config.num_q_heads % config.num_kv_heads != 0) {
    return Invalid(source, absl::StrCat("num_attention_heads (", config.num_q_heads,
                                        ") is not a multiple of num_key_value_heads (",
                                        config.num_kv_heads, ")"));
  }
  if (FindField(obj, "head_dim") != nullptr) {
    TANDEM_RETURN_IF_ERROR(ReadSize(obj, "head_dim", true, kMaxHeadDim, source, &config.head_dim));
  } else if (config.model_type == "qwen3") {
    config.head_dim = 128;  // Qwen3Config's default, whatever hidden_size / heads is
  } else {
    if (config.hidden_size % config.num_q_heads != 0) {
      return Invalid(
          source,
          absl::StrCat("head_dim is absent and hidden_size (", config.hidden_size,
                       ") is not a multiple of num_attention_heads (", config.num_q_heads, ")"));
    }
    config.head_dim = config.hidden_size / config.num_q_heads;
    if (config.head_dim > kMaxHeadDim) {
      return Invalid(source, absl::StrCat("head_dim ", config.head_dim, " exceeds ", kMaxHeadDim));
    }
  }
  if (config.head_dim % 2 != 0) {
    return Invalid(source,
                   absl::StrCat("head_dim ", config.head_dim, " must be even (RoPE pairs)"));
  }
  TANDEM_RETURN_IF_ERROR(ReadSize(obj, "vocab_size", true, kMaxVocab, source, &config.vocab_size));
  TANDEM_RETURN_IF_ERROR(ReadSize(obj, "max_position_embeddings", false, kMaxPositions, source,
                                  &config.max_position_embeddings));

  TANDEM_RETURN_IF_ERROR(ReadPositive(obj, "rms_norm_eps", source, &config.rms_norm_eps));

  // RoPE: rope_parameters (transformers 5) or top-level rope_theta + rope_scaling (older).
  config.rope_theta = 10000.0;
  TANDEM_RETURN_IF_ERROR(ReadPositive(obj, "rope_theta", source, &config.rope_theta));
  if (const json* params = FindField(obj, "rope_parameters")) {
    TANDEM_RETURN_IF_ERROR(ReadRopeScaling(*params, obj, source, "rope_parameters",
                                           config.max_position_embeddings, &config.rope_scaling));
    TANDEM_RETURN_IF_ERROR(
        ReadPositive(*params, "rope_theta", Where(source, "rope_parameters"), &config.rope_theta));
    TANDEM_RETURN_IF_ERROR(CheckRopeParameters(config.rope_scaling, source, "rope_parameters"));
  } else if (const json* scaling = FindField(obj, "rope_scaling")) {
    TANDEM_RETURN_IF_ERROR(ReadRopeScaling(*scaling, obj, source, "rope_scaling",
                                           config.max_position_embeddings, &config.rope_scaling));
    TANDEM_RETURN_IF_ERROR(CheckRopeParameters(config.rope_scaling, source, "rope_scaling"));
  }
  TANDEM_RETURN_IF_ERROR(CheckRopeTheta(config.rope_theta, source));

  if (const json* tie = FindField(obj, "tie_word_embeddings")) {
    TANDEM_ASSIGN_OR_RETURN(config.tie_word_embeddings,
                            JsonToBool(*tie, Where(source, "tie_word_embeddings")));
  }
  config.qk_norm = config.model_type == "qwen3";
  if (config.model_type == "qwen2") {
    config.qkv_bias = true;  // Qwen2Attention hard-codes bias=True for q/k/v
  } else if (const json* bias = FindField(obj, "attention_bias")) {
    TANDEM_ASSIGN_OR_RETURN(config.qkv_bias, JsonToBool(*bias, Where(source, "attention_bias")));
  }
  if (const json* mlp_bias = FindField(obj, "mlp_bias")) {
    TANDEM_ASSIGN_OR_RETURN(bool has_mlp_bias, JsonToBool(*mlp_bias, Where(source, "mlp_bias")));
    if (has_mlp_bias) return Invalid(source, "mlp_bias = true is not supported");
  }
  TANDEM_RETURN_IF_ERROR(ReadSpecialTokens(obj, source, &config));
  TANDEM_ASSIGN_OR_RETURN(config.weight_dtype, ReadDType(obj, source));
  TANDEM_RETURN_IF_ERROR(ReadSlidingWindow(obj, source, &config));
  TANDEM_RETURN_IF_ERROR(ReadQuantization(obj, source, &config));
  return config;
}

// NOT_FOUND if absent; INVALID_ARGUMENT if unreadable or larger than `max_bytes`.
absl::StatusOr<std::string> ReadSmallFile(const std::filesystem::path& path, uintmax_t max_bytes) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path.string(), ": no such file"));
  }
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec || size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": cannot be read or is larger than ", max_bytes, " bytes"));
  }
  std::ifstream in(path, std::ios::binary);
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(size))) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": read failed"));
  }
  return text;
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view config_json) {
  return ParseConfigText(config_json, "config.json");
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& model_dir) {
  constexpr uintmax_t kMaxConfigBytes = 16 << 20;
  const std::filesystem::path config_path = model_dir / "config.json";
  TANDEM_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(config_path, kMaxConfigBytes));
  TANDEM_ASSIGN_OR_RETURN(ModelConfig config, ParseConfigText(text, config_path.string()));

  const std::filesystem::path gen_path = model_dir / "generation_config.json";
  std::error_code ec;
  if (std::filesystem::exists(gen_path, ec)) {
    TANDEM_ASSIGN_OR_RETURN(std::string gen_text, ReadSmallFile(gen_path, kMaxConfigBytes));
    TANDEM_ASSIGN_OR_RETURN(json gen, internal::ParseJsonObject(gen_text, gen_path.string()));
    TANDEM_RETURN_IF_ERROR(ReadSpecialTokens(gen, gen_path.string(), &config));
    TANDEM_RETURN_IF_ERROR(ReadSamplingDefaults(gen, gen_path.string(), &config.sampling_defaults));
  }
  return config;
}

absl::Status ApplyQuantizationOption(std::string_view quantization, ModelConfig* config) {
  if (quantization.empty() || quantization == "none") return absl::OkStatus();
  if (quantization == "fp8") {
    config->quantization = "fp8";
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--quantization \"", absl::string_view(quantization.data(), quantization.size()),
      "\" is not supported: use \"fp8\" (projections as FP8 e4m3 with per-row scales, quantized "
      "at load from a float checkpoint) or \"none\" (the checkpoint's own weights)"));
}

namespace {

// 1 / theta^(2i / dim) for i < dim / 2, in f32 as torch computes `base ** (arange(0, dim, 2) /
// dim)` (Python scalars meet f32 tensors as f32).
std::vector<float> PlainInvFreq(float base, int64_t head_dim) {
  std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
  const float dim = static_cast<float>(head_dim);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float exponent = static_cast<float>(2 * i) / dim;
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }
  return inv_freq;
}

// _compute_llama3_parameters; the wavelength thresholds are Python floats (f64).
void ApplyLlama3(const RopeScaling& s, std::vector<float>& inv_freq) {
  const double old_context = static_cast<double>(s.original_max_position_embeddings);
  const float low_freq_wavelen = static_cast<float>(old_context / s.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_context / s.high_freq_factor);
  const float factor = static_cast<float>(s.factor);
  const float low = static_cast<float>(s.low_freq_factor);
  const float span = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  const float two_pi = static_cast<float>(2 * std::numbers::pi);
  for (float& f : inv_freq) {
    const float wavelen = two_pi / f;
    float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    const bool is_medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (is_medium) {
      const float smooth = (static_cast<float>(old_context) / wavelen - low) / span;
      scaled = (1 - smooth) * scaled / factor + smooth * scaled;
    }
    f = scaled;
  }
}

// _compute_yarn_parameters: the correction range is Python f64 math, the tensors f32.
std::vector<float> YarnInvFreq(const ModelConfig& config) {
  const RopeScaling& s = config.rope_scaling;
  const double base = config.rope_theta;
  const int64_t dim = config.head_dim;
  // The (fractional) dimension whose wavelength fits num_rotations times in the original
  // context: dim · ln(L / (2π·rotations)) / (2 ln base).
  auto correction_dim = [&](double num_rotations) {
    const double context = static_cast<double>(s.original_max_position_embeddings);
    return (static_cast<double>(dim) * std::log(context / (num_rotations * 2 * std::numbers::pi))) /
           (2 * std::log(base));
  };
  double low = correction_dim(s.beta_fast);
  double high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // transformers: "prevent singularity"
  const float ramp_low = static_cast<float>(low);
  const float ramp_span = static_cast<float>(high - low);
  const float factor = static_cast<float>(s.factor);
  std::vector<float> inv_freq(static_cast<size_t>(dim / 2));
  const float fdim = static_cast<float>(dim);
  const float fbase = static_cast<float>(base);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float pos_freq = std::pow(fbase, static_cast<float>(2 * i) / fdim);
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (factor * pos_freq);
    const float ramp = std::clamp((static_cast<float>(i) - ramp_low) / ramp_span, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv_freq[i] =
        interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return inv_freq;
}

// transformers' get_mscale.
double YarnMscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

}  // namespace

std::vector<float> RopeInvFreq(const ModelConfig& config, int64_t seq_len) {
  const RopeScaling& s = config.rope_scaling;
  float base = static_cast<float>(config.rope_theta);
  switch (s.type) {
    case RopeScaling::Type::kNone:
      return PlainInvFreq(base, config.head_dim);
    case RopeScaling::Type::kLinear: {
      std::vector<float> inv_freq = PlainInvFreq(base, config.head_dim);
      for (float& f : inv_freq) f /= static_cast<float>(s.factor);
      return inv_freq;
    }
    case RopeScaling::Type::kLlama3: {
      std::vector<float> inv_freq = PlainInvFreq(base, config.head_dim);
      ApplyLlama3(s, inv_freq);
      return inv_freq;
    }
    case RopeScaling::Type::kYarn:
      return YarnInvFreq(config);
    case RopeScaling::Type::kDynamic:
      if (seq_len > config.max_position_embeddings) {
        // _compute_dynamic_ntk_parameters with seq_len an int64 tensor: every step in f32.
        const float ratio = static_cast<float>(s.factor) * static_cast<float>(seq_len) /
                            static_cast<float>(config.max_position_embeddings);
        const float growth = ratio - static_cast<float>(s.factor - 1);
        const float exponent = static_cast<float>(static_cast<double>(config.head_dim) /
                                                  static_cast<double>(config.head_dim - 2));
        base = base * std::pow(growth, exponent);
      }
      return PlainInvFreq(base, config.head_dim);
  }
  return PlainInvFreq(base, config.head_dim);
}

float RopeAttentionScaling(const ModelConfig& config) {
  const RopeScaling& s = config.rope_scaling;
  if (s.type != RopeScaling::Type::kYarn) return 1.0f;
  if (s.attention_factor > 0) return static_cast<float>(s.attention_factor);
  if (s.mscale > 0 && s.mscale_all_dim > 0) {
    return static_cast<float>(YarnMscale(s.factor, s.mscale) /
                              YarnMscale(s.factor, s.mscale_all_dim));
  }
  return static_cast<float>(YarnMscale(s.factor, 1.0));
}

bool RopeDependsOnLength(const ModelConfig& config) {
  return config.rope_scaling.type == RopeScaling::Type::kDynamic;
}

int64_t ModelContextLimit(const ModelConfig& config) {
  const RopeScaling& s = config.rope_scaling;
  double limit = static_cast<double>(config.max_position_embeddings);
  switch (s.type) {
    case RopeScaling::Type::kLinear:
    case RopeScaling::Type::kDynamic:
      limit *= s.factor;
      break;
    case RopeScaling::Type::kYarn:
      limit = std::max(limit, static_cast<double>(s.original_max_position_embeddings) * s.factor);
      break;
    case RopeScaling::Type::kNone:
    case RopeScaling::Type::kLlama3:
      break;
  }
  limit = std::clamp(std::floor(limit), 1.0, static_cast<double>(kMaxPositions));
  int64_t positions = static_cast<int64_t>(limit);
  if (config.sliding_window > 0) positions = std::min(positions, config.sliding_window);
  return positions;
}

}  // namespace tandem::gpu_worker
