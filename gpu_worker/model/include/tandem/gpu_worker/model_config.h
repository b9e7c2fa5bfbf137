// The architecture of a Hugging Face Llama-family model (llama, mistral, qwen2, qwen3), read from
// its config.json (and generation_config.json), plus the RoPE inverse frequencies it implies.
//
// Both config generations are understood: transformers <= 4.x writes `rope_theta` at the top
// level and an optional `rope_scaling` object; transformers 5 writes `rope_parameters`
// {rope_theta, rope_type, ...}. The rope types "default", "linear", "llama3", "yarn" and
// "dynamic" are supported, computed as transformers 5 does (modeling_rope_utils); any other
// (longrope, ...) is rejected rather than silently run unscaled.
//
// Sliding-window attention (Mistral's `sliding_window`, Qwen2's with `use_sliding_window`) is not
// implemented; within the window it equals full attention, so such a model gets
// `sliding_window` set and ModelContextLimit() caps its context there (the caller logs it).
// Mistral's `sliding_window: null` (v0.2 and later) and Qwen2's `use_sliding_window: false` mean
// full attention, as in transformers.
//
// Errors: every function returns INVALID_ARGUMENT for malformed JSON, missing or mistyped fields,
// out-of-range sizes or a model type outside the Llama family (the message names the file and
// field); NOT_FOUND when config.json does not exist. Nothing throws.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker {

struct RopeScaling {
  enum class Type { kNone, kLlama3, kLinear, kYarn, kDynamic };
  Type type = Type::kNone;
  double factor = 1.0;                              // llama3 / linear / yarn / dynamic
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3, yarn: pretraining length, tokens
  // yarn (transformers' _compute_yarn_parameters): rotations bounding the ramp between
  // extrapolated (fast) and interpolated (slow) frequencies, the cos/sin scale (0 = derive it:
  // from mscale / mscale_all_dim when both are non-zero, else 0.1·ln(factor) + 1), and whether
  // the ramp's ends are rounded to whole dimensions.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double attention_factor = 0.0;
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  bool truncate = true;
};

// The sampling the model's authors recommend, from generation_config.json (vLLM's
// --generation-config auto): used by the OpenAI gateway where a request leaves it unset.
struct SamplingDefaults {
  std::optional<float> temperature;   // 0..100
  std::optional<float> top_p;         // (0, 1]
  std::optional<int32_t> top_k;       // >= 0 (0: no limit)
};

struct ModelConfig {
  std::string model_type;  // "llama", "mistral", "qwen2" or "qwen3"
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
  // Each q and k head is RMS-normalised over head_dim (weights q_norm / k_norm, [head_dim],
  // eps rms_norm_eps) after the projection and before RoPE: qwen3.
  bool qk_norm = false;
  int32_t bos_token_id = -1;           // -1 when absent or null
  std::vector<int32_t> eos_token_ids;  // several for e.g. Llama-3 instruct; empty when absent
  DType weight_dtype = DType::kF32;    // from "dtype" / "torch_dtype"; kF32 if absent
  // Sliding-window attention length in tokens (0: full attention); see the top of this file.
  int64_t sliding_window = 0;
  SamplingDefaults sampling_defaults;  // generation_config.json's; unset when absent
  // "fp8" when the projections run as FP8 e4m3 with per-row or per-tensor scales: an FP8
  // checkpoint's quantization_config (fbgemm_fp8, fp8 without blocks, compressed-tensors float
  // 8-bit), or --quantization fp8 (ApplyQuantizationOption), which quantizes a float checkpoint's
  // projections at load (fp8_quantize.h); "" for none. Any other quantization_config is refused
  // at parse. The one switch: BindModelWeights derives the upload from it
  // (ModelWeights::quantize_at_load), and the memory plan and random weights read it.
  std::string quantization;
};

// Parses the text of a config.json. Fields absent from the file take transformers' defaults for
// the model type (rope_theta 10000, rms_norm_eps 1e-6, head_dim hidden_size / num_attention_heads
// (qwen3: 128), num_key_value_heads num_attention_heads, tie_word_embeddings false).
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view config_json);

// Reads model_dir/config.json; if model_dir/generation_config.json exists, its non-null
// bos_token_id overrides the config's and its eos_token_id (an int or a list) is added to the
// config's (the EOS set is the union, config.json's first); its temperature, top_p and top_k
// become sampling_defaults (INVALID_ARGUMENT naming the field when out of range).
absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& model_dir);

// A --quantization value applied to `config` (after LoadModelConfig): "" and "none" leave it as
// the checkpoint has it (an FP8 checkpoint stays FP8), "fp8" sets quantization to "fp8" (a no-op
// for an FP8 checkpoint; a float checkpoint's projections are then quantized at load). Any other
// value: INVALID_ARGUMENT naming it.
absl::Status ApplyQuantizationOption(std::string_view quantization, ModelConfig* config);

// RoPE inverse frequencies, [head_dim / 2] f32, bit-for-bit the computation of transformers
// (float32 math): inv_freq[i] = 1 / theta^(2i / head_dim), then "linear" divides by factor,
// "llama3" applies `_compute_llama3_parameters` (keep wavelengths below
// original_max_position_embeddings / high_freq_factor, divide those above
// original_max_position_embeddings / low_freq_factor by factor, interpolate smoothly between),
// "yarn" `_compute_yarn_parameters` (a linear ramp over the dimensions between extrapolated
// theta^(-2i/D) and interpolated theta^(-2i/D) / factor) and "dynamic" the NTK-aware
// `_compute_dynamic_ntk_parameters` for a forward whose largest position is seq_len - 1:
// theta' = theta · (factor · L / max_position_embeddings - (factor - 1))^(D / (D - 2)) with
// L = max(seq_len, max_position_embeddings), so up to max_position_embeddings it is the plain
// table. seq_len matters to "dynamic" only.
// Rotation angle of pair i at position p is p * inv_freq[i].
std::vector<float> RopeInvFreq(const ModelConfig& config, int64_t seq_len = 0);

// The factor both cos and sin are multiplied by (so q·k scales by its square): yarn's
// attention_factor (see RopeScaling), 1 for every other rope type.
float RopeAttentionScaling(const ModelConfig& config);

// True when the inverse frequencies depend on the sequence length ("dynamic"). transformers
// recomputes them in every forward from that forward's max position + 1 while cached keys keep
// the rotation they got; tandem does the same per sequence: each sequence's rows of a forward
// (a prefill chunk or a decode step) use RopeInvFreq(config, its last position + 1), which is
// exactly transformers' generate() with a cache for one sequence. (In a batch transformers uses
// the batch's max position for every row; vLLM instead fixes the scaling for
// max_position_embeddings · factor from the start.)
bool RopeDependsOnLength(const ModelConfig& config);

// The most positions tandem runs the model for faithfully: max_position_embeddings, times
// factor for the context-extending rope types "linear", "dynamic" and "yarn" (yarn from
// original_max_position_embeddings, as vLLM derives max_model_len), and at most
// sliding_window when the model has one.
int64_t ModelContextLimit(const ModelConfig& config);

}  // namespace tandem::gpu_worker
