#include "tandem/gpu_worker/model_geometry.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"
#include "tandem/common/bf16.h"
#include "tandem/common/f8e4m3.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/random_values.h"

namespace tandem::gpu_worker {
namespace {

using nlohmann::json;

// Debian's abseil has its own string_view type.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

ModelConfig Llama3_8B() {
  ModelConfig c;
  c.model_type = "llama";
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_layers = 32;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.vocab_size = 128256;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.rope_scaling.type = RopeScaling::Type::kLlama3;
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  c.tie_word_embeddings = false;
  c.bos_token_id = 128000;
  c.eos_token_ids = {128001};
  c.weight_dtype = DType::kBF16;
  return c;
}

ModelConfig Tiny() {
  ModelConfig c;
  c.model_type = "llama";
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 256;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = false;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  c.weight_dtype = DType::kBF16;
  return c;
}

// Llama-3.1-70B: the 8B's structure at 80 layers, hidden 8192, 64 query heads.
ModelConfig Llama3_70B() {
  ModelConfig c = Llama3_8B();
  c.hidden_size = 8192;
  c.intermediate_size = 28672;
  c.num_layers = 80;
  c.num_q_heads = 64;
  return c;
}

ModelConfig Qwen3_8B() {
  ModelConfig c;
  c.model_type = "qwen3";
  c.qk_norm = true;
  c.hidden_size = 4096;
  c.intermediate_size = 12288;
  c.num_layers = 36;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.vocab_size = 151936;
  c.max_position_embeddings = 40960;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.tie_word_embeddings = false;
  c.bos_token_id = 151643;
  c.eos_token_ids = {151645};
  c.weight_dtype = DType::kBF16;
  return c;
}

struct Preset {
  std::string_view name;
  ModelConfig (*make)();
};
constexpr Preset kPresets[] = {{"llama3-8b", &Llama3_8B},
                               {"llama3-70b", &Llama3_70B},
                               {"qwen3-8b", &Qwen3_8B},
                               {"tiny", &Tiny}};

// Fields a parsed config leaves at their defaults for the other rope types compare equal too.
bool SameRope(const RopeScaling& a, const RopeScaling& b) {
  return a.type == b.type &&
         (a.type == RopeScaling::Type::kNone ||
          (a.factor == b.factor && a.low_freq_factor == b.low_freq_factor &&
           a.high_freq_factor == b.high_freq_factor &&
           a.original_max_position_embeddings == b.original_max_position_embeddings &&
           a.beta_fast == b.beta_fast && a.beta_slow == b.beta_slow &&
           a.attention_factor == b.attention_factor && a.mscale == b.mscale &&
           a.mscale_all_dim == b.mscale_all_dim && a.truncate == b.truncate));
}

// The fields a config.json carries; two configs equal here describe the same model.
bool SameGeometry(const ModelConfig& a, const ModelConfig& b) {
  return a.model_type == b.model_type && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_layers == b.num_layers &&
         a.num_q_heads == b.num_q_heads && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.vocab_size == b.vocab_size &&
         a.max_position_embeddings == b.max_position_embeddings &&
         a.rms_norm_eps == b.rms_norm_eps && a.rope_theta == b.rope_theta &&
         SameRope(a.rope_scaling, b.rope_scaling) && a.sliding_window == b.sliding_window &&
         a.tie_word_embeddings == b.tie_word_embeddings && a.qkv_bias == b.qkv_bias &&
         a.qk_norm == b.qk_norm && a.bos_token_id == b.bos_token_id &&
         a.eos_token_ids == b.eos_token_ids && a.weight_dtype == b.weight_dtype &&
         a.quantization == b.quantization;
}

absl::Status BadOverride(absl::string_view item, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("geometry override \"", item, "\": ", why));
}

absl::Status SetInt(absl::string_view item, absl::string_view value, int64_t* out) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < 1) return BadOverride(item, "expected an integer >= 1");
  *out = v;
  return absl::OkStatus();
}

absl::Status SetPositive(absl::string_view item, absl::string_view value, double* out) {
  double v = 0;
  if (!absl::SimpleAtod(value, &v) || !std::isfinite(v) || !(v > 0)) {
    return BadOverride(item, "expected a positive number");
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ApplyOne(absl::string_view item, ModelConfig& c) {
  const size_t eq = item.find('=');
  if (eq == absl::string_view::npos) return BadOverride(item, "expected key=value");
  const absl::string_view key = absl::StripAsciiWhitespace(item.substr(0, eq));
  const absl::string_view value = absl::StripAsciiWhitespace(item.substr(eq + 1));
  if (key == "layers") return SetInt(item, value, &c.num_layers);
  if (key == "hidden") return SetInt(item, value, &c.hidden_size);
  if (key == "ffn") return SetInt(item, value, &c.intermediate_size);
  if (key == "q_heads") return SetInt(item, value, &c.num_q_heads);
  if (key == "kv_heads") return SetInt(item, value, &c.num_kv_heads);
  if (key == "head_dim") return SetInt(item, value, &c.head_dim);
  if (key == "vocab") return SetInt(item, value, &c.vocab_size);
  if (key == "max_positions") return SetInt(item, value, &c.max_position_embeddings);
  if (key == "rope_theta") return SetPositive(item, value, &c.rope_theta);
  if (key == "rms_norm_eps") return SetPositive(item, value, &c.rms_norm_eps);
  if (key == "dtype") {
    if (value == "bf16") {
      c.weight_dtype = DType::kBF16;
    } else if (value == "f32") {
      c.weight_dtype = DType::kF32;
    } else {
      return BadOverride(item, "dtype must be bf16 or f32");
    }
    return absl::OkStatus();
  }
  if (key == "quantization") {
    if (value != "fp8" && value != "none") return BadOverride(item, "expected fp8 or none");
    c.quantization = value == "fp8" ? "fp8" : "";
    return absl::OkStatus();
  }
  if (key == "tie_embeddings") {
    if (value != "true" && value != "false") return BadOverride(item, "expected true or false");
    c.tie_word_embeddings = value == "true";
    return absl::OkStatus();
  }
  if (key == "rope_scaling") {
    if (value != "none") return BadOverride(item, "only rope_scaling=none is supported");
    c.rope_scaling = RopeScaling{};
    return absl::OkStatus();
  }
  return BadOverride(item,
                     "unknown key (layers, hidden, ffn, q_heads, kv_heads, head_dim, vocab, "
                     "max_positions, rope_theta, rms_norm_eps, dtype, tie_embeddings, "
                     "rope_scaling, quantization)");
}

const char* TorchDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kI32:
    case DType::kF8E4M3:
      return nullptr;
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<ModelConfig> GeometryPreset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (p.name == name) return p.make();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown geometry preset \"", Av(name),
                   "\" (known: ", absl::StrJoin(GeometryPresetNames(), ", "), ")"));
}

std::vector<std::string> GeometryPresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

absl::StatusOr<std::string> GeometryConfigJson(const ModelConfig& c) {
  // The architecture of each model type written (a qwen3 config adds nothing else: its q/k
  // norms follow from the type).
  const char* architecture = c.model_type == "llama"   ? "LlamaForCausalLM"
                             : c.model_type == "qwen3" ? "Qwen3ForCausalLM"
                                                       : nullptr;
  if (architecture == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry: model_type \"", c.model_type, "\" is not written (llama, qwen3)"));
  }
  if (c.qkv_bias) return absl::InvalidArgumentError("geometry: qkv biases are not supported");
  const char* dtype = TorchDTypeName(c.weight_dtype);
  if (dtype == nullptr) {
    return absl::InvalidArgumentError("geometry: the weight dtype must be a float type");
  }
  json j = {
      {"architectures", {architecture}},
      {"model_type", c.model_type},
      {"hidden_act", "silu"},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_q_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"torch_dtype", dtype},
  };
  const RopeScaling& s = c.rope_scaling;
  switch (s.type) {
    case RopeScaling::Type::kNone:
      j["rope_scaling"] = nullptr;
      break;
    case RopeScaling::Type::kLinear:
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", s.factor}};
      break;
    case RopeScaling::Type::kLlama3:
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", s.factor},
          {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor},
          {"original_max_position_embeddings", s.original_max_position_embeddings}};
      break;
    case RopeScaling::Type::kDynamic:
      j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", s.factor}};
      break;
    case RopeScaling::Type::kYarn: {
      json yarn = {{"rope_type", "yarn"},
                   {"factor", s.factor},
                   {"original_max_position_embeddings", s.original_max_position_embeddings},
                   {"beta_fast", s.beta_fast},
                   {"beta_slow", s.beta_slow},
                   {"truncate", s.truncate}};
      if (s.attention_factor > 0) yarn["attention_factor"] = s.attention_factor;
      if (s.mscale > 0) yarn["mscale"] = s.mscale;
      if (s.mscale_all_dim > 0) yarn["mscale_all_dim"] = s.mscale_all_dim;
      j["rope_scaling"] = std::move(yarn);
      break;
    }
  }
  if (c.quantization == "fp8") {
    j["quantization_config"] = {{"quant_method", "fbgemm_fp8"},
                                {"modules_to_not_convert", {"lm_head"}}};
  }
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) {
    j["eos_token_id"] = c.eos_token_ids[0];
  } else if (!c.eos_token_ids.empty()) {
    j["eos_token_id"] = c.eos_token_ids;
  }
  return j.dump(2) + "\n";
}

absl::Status ApplyGeometryOverrides(std::string_view overrides, ModelConfig& config) {
  ModelConfig c = config;
  for (absl::string_view item : absl::StrSplit(Av(overrides), ',', absl::SkipWhitespace())) {
    TANDEM_RETURN_IF_ERROR(ApplyOne(absl::StripAsciiWhitespace(item), c));
  }
  // Validate exactly as a checkpoint's config.json would be, and check the round trip.
  TANDEM_ASSIGN_OR_RETURN(std::string text, GeometryConfigJson(c));
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry overrides \"", Av(overrides),
                     "\" give an invalid model: ", parsed.status().message()));
  }
  if (!SameGeometry(*parsed, c)) {
    return absl::InvalidArgumentError(absl::StrCat("geometry overrides \"", Av(overrides),
                                                   "\": config.json does not round-trip"));
  }
  config = std::move(c);
  return absl::OkStatus();
}

int64_t RandomTensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t TensorSeed(uint64_t seed, uint64_t index) {
  return SplitMix64(SplitMix64(seed) ^ SplitMix64(index + 1));
}

absl::StatusOr<std::vector<RandomTensorSpec>> RandomModelTensors(const ModelConfig& c,
                                                                 uint64_t seed) {
  if (c.qkv_bias) {
    return absl::InvalidArgumentError("random model: qkv biases are not supported");
  }
  if (c.weight_dtype != DType::kBF16 && c.weight_dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("random model: weight dtype ",
                                                   Av(DTypeName(c.weight_dtype)),
                                                   " is not supported (bf16, f32)"));
  }
  if (c.quantization == "fp8" && c.weight_dtype != DType::kBF16) {
    return absl::InvalidArgumentError("random model: FP8 projections go with bf16 tables");
  }
  if (!c.quantization.empty() && c.quantization != "fp8") {
    return absl::InvalidArgumentError(
        absl::StrCat("random model: quantization \"", c.quantization, "\" (fp8 or none)"));
  }
  // The bounds of ParseModelConfig, so no product of sizes overflows.
  auto in_range = [](int64_t v, int64_t max) { return v >= 1 && v <= max; };
  if (!in_range(c.hidden_size, 65536) || !in_range(c.intermediate_size, 1 << 20) ||
      !in_range(c.num_layers, 1024) || !in_range(c.num_q_heads, 1024) ||
      !in_range(c.num_kv_heads, 1024) || !in_range(c.head_dim, 1024) ||
      !in_range(c.vocab_size, 4 << 20)) {
    return absl::InvalidArgumentError(
        "random model: a size is out of range (hidden <= 65536, ffn <= 2^20, layers, heads and "
        "head_dim <= 1024, vocab <= 2^22, all >= 1)");
  }
  if (c.head_dim % 2 != 0 || c.num_q_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        "random model: head_dim must be even and q_heads a multiple of kv_heads");
  }
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const int64_t QD = c.num_q_heads * c.head_dim, KD = c.num_kv_heads * c.head_dim;
  std::vector<RandomTensorSpec> specs;
  auto matrix = [&](std::string name, int64_t out, int64_t in, uint64_t index) {
    RandomTensorSpec s;
    s.name = std::move(name);
    s.shape = {out, in};
    s.dtype = c.weight_dtype;
    s.init = RandomTensorSpec::Init::kUniform;
    s.seed = TensorSeed(seed, index);
    s.scale = static_cast<float>(std::sqrt(3.0 / static_cast<double>(in)));
    specs.push_back(std::move(s));
  };
  // FP8 (quantization "fp8"): the projections are e4m3 codes uniform over ±448 with one scale
  // per output row, sqrt(3 / in) / 448: the bf16 model's distribution.
  const bool fp8 = c.quantization == "fp8";
  std::vector<RandomTensorSpec> scales;  // the layer's, listed after its other tensors
  auto projection = [&](std::string name, int64_t out, int64_t in, uint64_t index) {
    matrix(name, out, in, index);
    if (!fp8) return;
    RandomTensorSpec& m = specs.back();
    m.dtype = DType::kF8E4M3;
    m.scale = kF8E4M3Max;
    RandomTensorSpec s;
    s.name = name.substr(0, name.size() - std::string(".weight").size()) + ".weight_scale";
    s.shape = {out, 1};
    s.dtype = DType::kF32;
    s.init = RandomTensorSpec::Init::kConstant;
    s.scale = static_cast<float>(std::sqrt(3.0 / static_cast<double>(in)) / kF8E4M3Max);
    scales.push_back(std::move(s));
  };
  auto norm = [&](std::string name, int64_t width) {
    RandomTensorSpec s;
    s.name = std::move(name);
    s.shape = {width};
    s.dtype = c.weight_dtype;
    s.init = RandomTensorSpec::Init::kOnes;
    specs.push_back(std::move(s));
  };
  matrix("model.embed_tokens.weight", V, H, 0);
  norm("model.norm.weight", H);
  if (!c.tie_word_embeddings) matrix("lm_head.weight", V, H, 2);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const uint64_t base = 3 + 9 * static_cast<uint64_t>(l);
    norm(p + "input_layernorm.weight", H);
    projection(p + "self_attn.q_proj.weight", QD, H, base + 1);
    projection(p + "self_attn.k_proj.weight", KD, H, base + 2);
    projection(p + "self_attn.v_proj.weight", KD, H, base + 3);
    projection(p + "self_attn.o_proj.weight", H, QD, base + 4);
    norm(p + "post_attention_layernorm.weight", H);
    projection(p + "mlp.gate_proj.weight", I, H, base + 6);
    projection(p + "mlp.up_proj.weight", I, H, base + 7);
    projection(p + "mlp.down_proj.weight", H, I, base + 8);
    if (c.qk_norm) {
      norm(p + "self_attn.q_norm.weight", c.head_dim);
      norm(p + "self_attn.k_norm.weight", c.head_dim);
    }
    for (RandomTensorSpec& s : scales) specs.push_back(std::move(s));
    scales.clear();
  }
  return specs;
}

void FillRandomTensorSlice(const RandomTensorSpec& spec, uint64_t first, uint64_t count,
                           void* dst_host) {
  if (spec.init == RandomTensorSpec::Init::kConstant) {  // f32 (FP8 row scales)
    float* d = static_cast<float*>(dst_host);
    for (uint64_t i = 0; i < count; ++i) d[i] = spec.scale;
    return;
  }
  if (spec.dtype == DType::kF8E4M3) {
    auto* d = static_cast<f8e4m3_t*>(dst_host);
    for (uint64_t i = 0; i < count; ++i) {
      d[i] = FloatToF8E4M3(RandomSigned(spec.seed, first + i, spec.scale));
    }
    return;
  }
  const bool ones = spec.init == RandomTensorSpec::Init::kOnes;
  if (spec.dtype == DType::kBF16) {
    bf16_t* d = static_cast<bf16_t*>(dst_host);
    for (uint64_t i = 0; i < count; ++i) {
      d[i] = FloatToBf16(ones ? 1.0f : RandomSigned(spec.seed, first + i, spec.scale));
    }
  } else {  // kF32 (RandomModelTensors admits no other dtype)
    float* d = static_cast<float*>(dst_host);
    for (uint64_t i = 0; i < count; ++i) {
      d[i] = ones ? 1.0f : RandomSigned(spec.seed, first + i, spec.scale);
    }
  }
}

}  // namespace tandem::gpu_worker
