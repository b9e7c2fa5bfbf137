// Model geometries without a checkpoint: named presets of real architectures, key=value
// overrides, and the synthetic ("random") weights that DeviceModel::CreateRandom puts on the
// device and tandem-geometry writes to disk, both from the same description below so the two
// hold bit-identical values for the same seed.
//
// Random weights: each tensor of the Hugging Face layout (model_weights.h) gets its own seed,
// TensorSeed(seed, index), where index is the tensor's fixed position in the enumeration
//   0 embed, 1 final norm, 2 lm_head, then 3 + 9·layer + {0 attn_norm, 1 q, 2 k, 3 v, 4 o,
//   5 ffn_norm, 6 gate, 7 up, 8 down}
// and, with q/k norms (qwen3), each layer's q_norm and k_norm ([head_dim] ones, no seed) listed
// after its down projection; with quantization "fp8", the seven projections are e4m3 codes
// (RandomSigned(seed, i, 448) rounded) and each layer's tensors end with their seven
// weight_scale tensors ([out, 1] f32, all sqrt(3 / in) / 448), q, k, v, o, gate, up, down
// (the lm_head index is kept free when embeddings are tied, so tying changes no other tensor).
// Element i of a matrix is RandomSigned(tensor_seed, i, scale) rounded to the weight dtype
// (random_values.h, the values of Backend::RandomFill), scale = sqrt(3 / in_features): the
// uniform distribution of standard deviation 1/sqrt(in_features), so every projection keeps its
// output O(1) for O(1) inputs. Norm weights are 1.
//
// Errors: INVALID_ARGUMENT naming the preset, key or value; nothing throws.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/dtype.h"
#include "tandem/gpu_worker/model_config.h"

namespace tandem::gpu_worker {

// Presets:
//   "llama3-8b": Llama-3.1-8B: 32 layers, hidden 4096, FFN 14336, 32 query / 8 kv heads of 128,
//                vocab 128256, rope_theta 500000 with the "llama3" rope scaling (factor 8,
//                low 1, high 4, original 8192), 131072 positions, rms_norm_eps 1e-5, untied
//                embeddings, bf16.
//   "llama3-70b": Llama-3.1-70B: the 8B's with 80 layers, hidden 8192, FFN 28672, 64 query heads.
//   "qwen3-8b":  Qwen3-8B: 36 layers, hidden 4096, FFN 12288, 32 query / 8 kv heads of 128 with
//                q/k norms, vocab 151936, rope_theta 1e6, 40960 positions, rms_norm_eps 1e-6,
//                untied embeddings, bf16.
//   "tiny":      2 layers, hidden 64, FFN 128, 4 query / 2 kv heads of 16, vocab 256,
//                4096 positions, bf16 (tests; same structure as llama3-8b: GQA, untied).
absl::StatusOr<ModelConfig> GeometryPreset(std::string_view name);
std::vector<std::string> GeometryPresetNames();

// Applies comma-separated key=value overrides to `config` and validates the result as a
// config.json would be (ParseModelConfig's ranges and rules). Keys:
//   layers, hidden, ffn, q_heads, kv_heads, head_dim, vocab, max_positions (integers),
//   rope_theta, rms_norm_eps (positive numbers), dtype (bf16 | f32), quantization (fp8 | none:
//   FP8 projections with row scales beside bf16 tables, as FP8 checkpoints),
//   tie_embeddings (true | false), rope_scaling (none: drop the preset's scaling).
// An empty string changes nothing. On error `config` is unchanged.
absl::Status ApplyGeometryOverrides(std::string_view overrides, ModelConfig& config);

// The Hugging Face config.json of `config` (LlamaForCausalLM or Qwen3ForCausalLM), which
// ParseModelConfig reads back to an equal config. INVALID_ARGUMENT for a config that could not be
// written faithfully (qkv biases, a model_type other than llama and qwen3, an integer weight
// dtype).
absl::StatusOr<std::string> GeometryConfigJson(const ModelConfig& config);

// One tensor of a random model, in the Hugging Face layout.
struct RandomTensorSpec {
  // kConstant: every element is `scale` (an FP8 projection's f32 row scales).
  enum class Init { kUniform, kOnes, kConstant };
  std::string name;            // e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // [out, in] for matrices, [H] for norms
  DType dtype = DType::kBF16;  // the config's weight dtype
  Init init = Init::kUniform;
  uint64_t seed = 0;   // TensorSeed(model seed, index); unused for kOnes
  float scale = 0.0f;  // kUniform: values in [-scale, scale)
  int64_t numel() const;
  uint64_t bytes() const { return static_cast<uint64_t>(numel()) * DTypeBytes(dtype); }
};

// The seed of tensor `index` of a model seeded with `seed`.
uint64_t TensorSeed(uint64_t seed, uint64_t index);

// Every tensor of the model in the enumeration order above (lm_head absent when tied).
// INVALID_ARGUMENT for configs random models do not support: qkv biases, and dtypes other than
// bf16 and f32 (f16 is left out: the host has no conversion bit-identical to the cuda one here).
absl::StatusOr<std::vector<RandomTensorSpec>> RandomModelTensors(const ModelConfig& config,
                                                                 uint64_t seed);

// Writes elements [first, first + count) of the tensor to dst_host ([count] of spec.dtype) on the
// calling thread: exactly what Backend::RandomFill writes for kUniform, 1.0 for kOnes. The
// caller keeps first + count <= numel().
void FillRandomTensorSlice(const RandomTensorSpec& spec, uint64_t first, uint64_t count,
                           void* dst_host);

}  // namespace tandem::gpu_worker
