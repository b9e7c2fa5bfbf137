// The architecture of a Hugging Face Llama-family model (llama, mistral, qwen2), read from its
// config.json (and generation_config.json), plus the RoPE inverse frequencies it implies.
//
// Both config generations are understood: transformers <= 4.x writes `rope_theta` at the top
// level and an optional `rope_scaling` object; transformers 5 writes `rope_parameters`
// {rope_theta, rope_type, ...}. Only the rope types "default", "llama3" and "linear" are supported;
// any other (dynamic, yarn, longrope, ...) is rejected rather than silently run unscaled.
// NOTE: `sliding_window` (Mistral v0.1, some Qwen2) is not represented: tandem runs full
// attention, which matches such models only up to their window length.
//
// Errors: every function returns INVALID_ARGUMENT for malformed JSON, missing or mistyped fields,
// out-of-range sizes or a model type outside the Llama family (the message names the file and
// field); NOT_FOUND when config.json does not exist. Nothing throws.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker {

struct RopeScaling {
  enum class Type { kNone, kLlama3, kLinear };
  Type type = Type::kNone;
  double factor = 1.0;                              // llama3 / linear
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3, tokens
};

struct ModelConfig {
  std::string model_type;  // "llama", "mistral" or "qwen2"
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // SwiGLU width
  int64_t num_layers = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;  // divides num_q_heads (GQA group = num_q_heads / num_kv_heads)
  int64_t head_dim = 0;      // even; need not equal hidden_size / num_q_heads
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;  // tokens
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;  // lm_head shares model.embed_tokens.weight
  bool qkv_bias = false;  // q/k/v projections have biases (always for qwen2, else attention_bias)
  int32_t bos_token_id = -1;           // -1 when absent or null
  std::vector<int32_t> eos_token_ids;  // several for e.g. Llama-3 instruct; empty when absent
  DType weight_dtype = DType::kF32;    // from "dtype" / "torch_dtype"; kF32 if absent
};

// Parses the text of a config.json. Fields absent from the file take transformers' defaults for
// the model type (rope_theta 10000, rms_norm_eps 1e-6, head_dim hidden_size / num_attention_heads,
// num_key_value_heads num_attention_heads, tie_word_embeddings false).
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view config_json);

// Reads model_dir/config.json; if model_dir/generation_config.json exists, its non-null
// bos_token_id overrides the config's and its eos_token_id (an int or a list) is added to the
// config's (the EOS set is the union, config.json's first).
absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& model_dir);

// RoPE inverse frequencies, [head_dim / 2] f32, bit-for-bit the computation of transformers
// (float32 math): inv_freq[i] = 1 / theta^(2i / head_dim), then "linear" divides by factor and
// "llama3" applies `_compute_llama3_parameters` (keep wavelengths below
// original_max_position_embeddings / high_freq_factor, divide those above
// original_max_position_embeddings / low_freq_factor by factor, interpolate smoothly between).
// Rotation angle of pair i at position p is p * inv_freq[i].
std::vector<float> RopeInvFreq(const ModelConfig& config);

}  // namespace tandem::gpu_worker
