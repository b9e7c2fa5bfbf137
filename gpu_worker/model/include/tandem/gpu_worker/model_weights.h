// A Llama-family model on the host: its config and its mmap'ed safetensors weights, with every
// tensor the forward pass needs looked up and shape-checked once at load time.
//
// Tensor names and shapes are Hugging Face's (nn.Linear weights are [out_features, in_features],
// row-major): with H = hidden_size, I = intermediate_size, V = vocab_size, D = head_dim,
// Q = num_q_heads, K = num_kv_heads. q_proj/k_proj rows are in Hugging Face's half-split RoPE
// order (rotate_half pairs element j with j + D/2 within each head).
//
// Errors: LoadModel returns the config's and the archive's errors (NOT_FOUND for a missing
// config.json or weights file, INVALID_ARGUMENT for malformed ones), and INVALID_ARGUMENT naming
// the tensor, its expected and found shape when a tensor is missing or mis-shaped, when the
// matrices do not share one dtype in {F32, BF16, F16} (FP8 e4m3 projections beside float tables
// excepted, each with a per-row or per-tensor weight_scale; block-wise scales are refused), or
// when a norm or bias is not a float; INVALID_ARGUMENT for a bad LoadOptions::quantization.
//
// Lifetime: every TensorView* points into Model::archive and is valid while the Model lives.
// Thread safety: a loaded Model is immutable and may be read from any thread.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/dtype.h"
#include "tandem/gpu_worker/model_config.h"
#include "tandem/gpu_worker/safetensors.h"

namespace tandem::gpu_worker {

// model.layers.{i}.*
struct LayerWeights {
  const TensorView* attn_norm = nullptr;  // input_layernorm.weight           [H]
  const TensorView* q_proj = nullptr;     // self_attn.q_proj.weight          [Q*D, H]
  const TensorView* k_proj = nullptr;     // self_attn.k_proj.weight          [K*D, H]
  const TensorView* v_proj = nullptr;     // self_attn.v_proj.weight          [K*D, H]
  const TensorView* o_proj = nullptr;     // self_attn.o_proj.weight          [H, Q*D]
  const TensorView* q_bias = nullptr;     // self_attn.q_proj.bias [Q*D]; only if qkv_bias
  const TensorView* k_bias = nullptr;     // self_attn.k_proj.bias [K*D]; only if qkv_bias
  const TensorView* v_bias = nullptr;     // self_attn.v_proj.bias [K*D]; only if qkv_bias
  const TensorView* q_norm = nullptr;     // self_attn.q_norm.weight [D]; only if qk_norm
  const TensorView* k_norm = nullptr;     // self_attn.k_norm.weight [D]; only if qk_norm
  const TensorView* ffn_norm = nullptr;   // post_attention_layernorm.weight  [H]
  const TensorView* gate_proj = nullptr;  // mlp.gate_proj.weight             [I, H]
  const TensorView* up_proj = nullptr;    // mlp.up_proj.weight               [I, H]
  const TensorView* down_proj = nullptr;  // mlp.down_proj.weight             [H, I]
};

// The scale of each FP8 projection (by its view): f32, bf16 or f16, one per output row ([rows, 1]
// or [rows]) or one for the tensor ([1] or []); the matrix's values are its e4m3 codes times it.
using FP8Scales = std::unordered_map<const TensorView*, const TensorView*>;

struct ModelWeights {
  const TensorView* embed = nullptr;       // model.embed_tokens.weight [V, H]
  const TensorView* final_norm = nullptr;  // model.norm.weight [H]
  // lm_head.weight [V, H]; the same pointer as `embed` when tie_word_embeddings.
  const TensorView* lm_head = nullptr;
  std::vector<LayerWeights> layers;  // num_layers entries
  // The dtype the model computes in: its tables' (embed, lm_head) and every float projection's;
  // norms and biases may differ. FP8 projections become this dtype on upload (device_model.h).
  DType dtype = DType::kF32;
  // The projections' dtype in the files: `dtype`, or kF8E4M3 for an FP8 checkpoint (with
  // fp8_scales holding each FP8 projection's scale). An FP8 checkpoint may leave some projections
  // float (its ignore list): those are `dtype`, and IsFp8 tells them apart.
  DType stored_projection_dtype = DType::kF32;
  FP8Scales fp8_scales;
  // True when the config's quantization is "fp8" (--quantization fp8) but the files hold the
  // projections as floats: Upload quantizes each one per output row (QuantizeFp8PerRow) as it
  // goes and takes the codes and scales as it takes an FP8 checkpoint's.
  bool quantize_at_load = false;

  // Some projections run as FP8 codes with scales: stored so, or quantized at load.
  bool fp8_projections() const {
    return stored_projection_dtype == DType::kF8E4M3 || quantize_at_load;
  }
  // True when the projection `t` (one of layers' *_proj) runs as FP8: stored FP8, or every
  // projection of a float checkpoint quantized at load.
  bool IsFp8(const TensorView* t) const { return quantize_at_load || t->dtype == DType::kF8E4M3; }
};

// A loaded model: config + mmap'ed weights (the views stay valid while Model lives).
struct Model {
  std::filesystem::path dir;
  ModelConfig config;
  std::unique_ptr<SafetensorsArchive> archive;
  ModelWeights weights;
};

// Resolves and checks every weight of `config` in `archive` (tensors the model does not use,
// such as rotary_emb.inv_freq, are ignored). With config.quantization "fp8" and float
// projections it sets quantize_at_load; INVALID_ARGUMENT when those are beside f16 tables
// (FP8 projections run beside bf16 or f32 tables).
absl::StatusOr<ModelWeights> BindModelWeights(const ModelConfig& config,
                                              const SafetensorsArchive& archive);

struct LoadOptions {
  // --quantization: "", "none" or "fp8" (ApplyQuantizationOption, model_config.h).
  std::string quantization;
};

// LoadModelConfig(model_dir) + ApplyQuantizationOption(options.quantization) +
// SafetensorsArchive::Open(model_dir) + BindModelWeights. Nothing is quantized here: the
// weights stay mmap'ed and Upload quantizes them one projection at a time.
absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::filesystem::path& model_dir,
                                                 const LoadOptions& options = {});

}  // namespace tandem::gpu_worker
