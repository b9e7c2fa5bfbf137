// DeviceModel: a loaded Model's weights copied into backend memory in the layout the forward
// pass wants. Matrices keep their dtype (f32/bf16/f16; FP8 projections: see Upload); the
// projections that read the same input are stacked so one GEMM computes them:
//   qkv     [(Q + 2K)·D, H]   rows of q_proj, then k_proj, then v_proj
//   gate_up [2·I, H]          rows of gate_proj, then up_proj (SwiGluParams' layout)
// Biases (Qwen2) are converted to f32 and stacked the same way. lm_head aliases embed when the
// embeddings are tied (no second copy).
//
// Not thread-safe; owned by the engine's executor thread. The Model must outlive Upload() only.
// Both constructors synchronize the backend before returning.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"
#include "tandem/gpu_worker/model_weights.h"

namespace tandem::gpu_worker {

// A weight tensor in backend memory.
struct DeviceTensor {
  DeviceBuffer buffer;
  DType dtype = DType::kF32;
  // FP8 matrices (dtype kF8E4M3): f32 [rows], each row's scale (MatMulParams::w_scale).
  DeviceBuffer scale;
  const void* data() const { return buffer.data(); }
  const float* scale_data() const { return scale ? scale.as<float>() : nullptr; }
};

struct DeviceLayer {
  DeviceTensor attn_norm;   // [H]
  DeviceTensor qkv;         // [(Q + 2K)·D, H]
  DeviceTensor qkv_bias;    // [(Q + 2K)·D] f32, empty without biases
  DeviceTensor o_proj;      // [H, Q·D]
  DeviceTensor ffn_norm;    // [H]
  DeviceTensor gate_up;     // [2·I, H]
  DeviceTensor down_proj;   // [H, I]
  DeviceTensor q_norm;      // [D], empty without q/k norms (qwen3)
  DeviceTensor k_norm;      // [D], empty without q/k norms
};

// Qwen3's per-head norm (ModelConfig::qk_norm), in place: each of `heads` vectors of head_dim
// floats per row, rows token_stride floats apart starting at x, RMS-normalised with `weight`
// (a layer's q_norm or k_norm). Nothing when `weight` is empty (a model without the norms).
absl::Status NormHeads(Backend& backend, const DeviceTensor& weight, float* x, int64_t rows,
                       int64_t heads, int64_t head_dim, int64_t token_stride, double eps);

class DeviceModel {
 public:
  // FP8 projections (an FP8 checkpoint's, or a float checkpoint's that it quantizes per row as
  // it goes when ModelWeights::quantize_at_load: --quantization fp8) stay codes + f32 row scales
  // where KeepsFp8, else are dequantized on the host to the tables' dtype (the cpu backend: the
  // numerics of FP8 at the bytes of bf16/f32). RESOURCE_EXHAUSTED when the device cannot hold the
  // weights; INVALID_ARGUMENT naming the tensor when a weight to quantize is NaN or infinite.
  static absl::StatusOr<std::unique_ptr<DeviceModel>> Upload(const Model& model,
                                                             Backend& backend);

  // A model of `config`'s geometry with synthetic weights (model_geometry.h:
  // RandomModelTensors(config, seed)) generated on the device with Backend::RandomFill: the
  // layout, dtypes and bytes of Upload, and bit for bit the weights that Upload gives for the
  // directory tandem-geometry writes with the same config and seed. No weight passes through
  // host memory (norms, [H] each, are copied up). INVALID_ARGUMENT for a config random models
  // do not support; RESOURCE_EXHAUSTED when the device cannot hold the weights.
  static absl::StatusOr<std::unique_ptr<DeviceModel>> CreateRandom(const ModelConfig& config,
                                                                   Backend& backend,
                                                                   uint64_t seed);

  // Device bytes Upload() / CreateRandom() allocate for the weights (weight_bytes() after
  // them), without allocating: every tensor as stored, qkv biases as f32. The memory estimator
  // (memory_plan.h) reads them before any weight is loaded. CreateRandom's form fails as it
  // does for an unsupported config.
  static size_t WeightBytes(const ModelWeights& weights, const Backend& backend);
  // True when Upload keeps FP8 projections (weights.fp8_projections()) FP8 on `backend` (it
  // multiplies FP8 weights and the tables are bf16); else it dequantizes them.
  static bool KeepsFp8(const ModelWeights& weights, const Backend& backend);
  static absl::StatusOr<size_t> WeightBytes(const ModelConfig& config);

  const ModelConfig& config() const { return config_; }
  const DeviceTensor& embed() const { return embed_; }
  const DeviceTensor& final_norm() const { return final_norm_; }
  // The lm_head matrix [V, H] (embed's buffer when tied).
  const void* lm_head() const { return tied_ ? embed_.data() : lm_head_.data(); }
  DType lm_head_dtype() const { return tied_ ? embed_.dtype : lm_head_.dtype; }
  const DeviceLayer& layer(int64_t i) const { return layers_[i]; }
  // RoPE: RopeInvFreq(config) [D/2] (for "dynamic" the table of sequences up to
  // max_position_embeddings; longer ones need RopeInvFreq(config, length)) and the factor cos
  // and sin are scaled by (RopeAttentionScaling).
  const float* inv_freq() const { return inv_freq_.as<float>(); }
  float rope_attention_scaling() const { return rope_attention_scaling_; }
  size_t weight_bytes() const { return weight_bytes_; }

 private:
  DeviceModel() = default;

  ModelConfig config_;
  DeviceTensor embed_;
  DeviceTensor final_norm_;
  DeviceTensor lm_head_;
  bool tied_ = false;
  std::vector<DeviceLayer> layers_;
  DeviceBuffer inv_freq_;
  float rope_attention_scaling_ = 1.0f;
  size_t weight_bytes_ = 0;
};

}  // namespace tandem::gpu_worker
