#include "tandem/gpu_worker/device_model.h"

#include <array>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "tandem/common/f16.h"
#include "tandem/common/f8e4m3.h"
#include "tandem/common/status_macros.h"
#include "tandem/gpu_worker/fp8_quantize.h"
#include "tandem/gpu_worker/model_geometry.h"

namespace tandem::gpu_worker {
namespace {

// Uploads the concatenation of `parts` (all of one dtype) into one device tensor.
absl::StatusOr<DeviceTensor> UploadStacked(Backend& backend,
                                           std::initializer_list<const TensorView*> parts,
                                           size_t* total_bytes) {
  size_t bytes = 0;
  DType dtype = (*parts.begin())->dtype;
  for (const TensorView* t : parts) {
    if (t->dtype != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", t->name, " has dtype ", std::string(DTypeName(t->dtype)), ", expected ",
          std::string(DTypeName(dtype)), " like the tensors it is stacked with"));
    }
    bytes += t->bytes;
  }
  DeviceTensor out;
  out.dtype = dtype;
  TANDEM_ASSIGN_OR_RETURN(out.buffer, backend.Allocate(bytes));
  size_t offset = 0;
  for (const TensorView* t : parts) {
    TANDEM_RETURN_IF_ERROR(
        backend.CopyToDevice(static_cast<char*>(out.buffer.data()) + offset, t->data, t->bytes));
    offset += t->bytes;
  }
  *total_bytes += bytes;
  return out;
}

void AppendAsFloat(const TensorView& t, std::vector<float>& dst) {
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case DType::kF32:
        dst.push_back(static_cast<const float*>(t.data)[i]);
        break;
      case DType::kBF16:
        dst.push_back(Bf16ToFloat(static_cast<const uint16_t*>(t.data)[i]));
        break;
      case DType::kF16:
        dst.push_back(F16ToFloat(static_cast<const uint16_t*>(t.data)[i]));
        break;
      case DType::kF8E4M3:
        dst.push_back(F8E4M3ToFloat(static_cast<const uint8_t*>(t.data)[i]));
        break;
      case DType::kI32:
        dst.push_back(0.0f);
        break;
    }
  }
}

// The scale of row `row` of an FP8 matrix: its entry of `scale` (per row) or the one value
// (per tensor).
float ScaleOfRow(const TensorView& scale, int64_t row) {
  const int64_t i = scale.numel() == 1 ? 0 : row;
  switch (scale.dtype) {
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(scale.data)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(scale.data)[i]);
    default:
      return static_cast<const float*>(scale.data)[i];
  }
}

// The f32 scale of every row of the FP8 `parts`, end to end.
absl::StatusOr<std::vector<float>> RowScales(const ModelWeights& w,
                                             std::initializer_list<const TensorView*> parts) {
  std::vector<float> scales;
  for (const TensorView* t : parts) {
    const auto scale = w.fp8_scales.find(t);
    if (scale == w.fp8_scales.end()) {
      return absl::InternalError(absl::StrCat("FP8 tensor ", t->name, " has no bound scale"));
    }
    for (int64_t r = 0; r < t->shape[0]; ++r) scales.push_back(ScaleOfRow(*scale->second, r));
  }
  return scales;
}

// The e4m3 codes and row scales of stacked projections on the host.
struct Fp8Rows {
  std::vector<std::span<const f8e4m3_t>> parts;  // each part's codes, [rows_i, cols] row-major
  std::vector<float> scales;                     // [Σ rows_i] f32, the parts' rows end to end
  std::vector<f8e4m3_t> quantized;               // the codes `parts` views when quantized here
  int64_t cols = 0;
};

// The codes and row scales of the projections `parts`: an FP8 checkpoint's as stored (views of
// the archive), or a float checkpoint's quantized per row here (ModelWeights::quantize_at_load).
// NOTE: quantizing holds the stacked parts' codes in host memory, 1 byte a weight (gate_up,
// [2·I, H], the largest), never the whole model's.
absl::StatusOr<Fp8Rows> Fp8RowsOf(const ModelWeights& w,
                                  std::initializer_list<const TensorView*> parts) {
  Fp8Rows out;
  out.cols = (*parts.begin())->shape[1];
  if (!w.quantize_at_load) {
    TANDEM_ASSIGN_OR_RETURN(out.scales, RowScales(w, parts));
    for (const TensorView* t : parts) {
      out.parts.emplace_back(static_cast<const f8e4m3_t*>(t->data),
                             static_cast<size_t>(t->numel()));
    }
    return out;
  }
  size_t elements = 0;
  size_t rows = 0;
  for (const TensorView* t : parts) {
    elements += static_cast<size_t>(t->numel());
    rows += static_cast<size_t>(t->shape[0]);
  }
  out.quantized.resize(elements);
  out.scales.resize(rows);
  size_t at = 0;         // elements of `quantized` written
  size_t first_row = 0;  // of this part in `scales`
  for (const TensorView* t : parts) {
    const absl::Status s =
        QuantizeFp8PerRow(*t, out.quantized.data() + at, out.scales.data() + first_row);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("--quantization fp8: ", s.message()));
    out.parts.emplace_back(out.quantized.data() + at, static_cast<size_t>(t->numel()));
    at += static_cast<size_t>(t->numel());
    first_row += static_cast<size_t>(t->shape[0]);
  }
  return out;
}

// FP8 rows kept as codes (one device tensor) with their row scales as f32 [rows] beside.
absl::StatusOr<DeviceTensor> UploadFp8(Backend& backend, const Fp8Rows& rows, size_t* total_bytes) {
  size_t bytes = 0;
  for (const std::span<const f8e4m3_t> part : rows.parts) bytes += part.size();
  DeviceTensor out;
  out.dtype = DType::kF8E4M3;
  TANDEM_ASSIGN_OR_RETURN(out.buffer, backend.Allocate(bytes));
  size_t offset = 0;
  for (const std::span<const f8e4m3_t> part : rows.parts) {
    TANDEM_RETURN_IF_ERROR(backend.CopyToDevice(static_cast<char*>(out.buffer.data()) + offset,
                                                part.data(), part.size()));
    offset += part.size();
  }
  const size_t scale_bytes = rows.scales.size() * sizeof(float);
  TANDEM_ASSIGN_OR_RETURN(out.scale, backend.Allocate(scale_bytes));
  TANDEM_RETURN_IF_ERROR(backend.CopyToDevice(out.scale.data(), rows.scales.data(), scale_bytes));
  *total_bytes += bytes + scale_bytes;
  return out;
}

// FP8 rows dequantized on the host, code × scale of its row rounded to `dtype` (bf16 or f32),
// as one device tensor.
absl::StatusOr<DeviceTensor> UploadDequantized(Backend& backend, const Fp8Rows& rows, DType dtype,
                                               size_t* total_bytes) {
  const size_t cols = static_cast<size_t>(rows.cols);
  const size_t elem_bytes = DTypeBytes(dtype);
  std::vector<char> host(rows.scales.size() * cols * elem_bytes);
  size_t row = 0;  // of all parts
  for (const std::span<const f8e4m3_t> part : rows.parts) {
    for (size_t r = 0; r < part.size() / cols; ++r, ++row) {
      // The 256 code values once per row scale: a lookup per element.
      std::array<float, 256> value;
      const float s = rows.scales[row];
      for (int c = 0; c < 256; ++c) value[c] = F8E4M3ToFloat(static_cast<f8e4m3_t>(c)) * s;
      const f8e4m3_t* codes = part.data() + r * cols;
      if (dtype == DType::kBF16) {
        auto* dst = reinterpret_cast<bf16_t*>(host.data()) + row * cols;
        for (size_t c = 0; c < cols; ++c) dst[c] = FloatToBf16(value[codes[c]]);
      } else {
        auto* dst = reinterpret_cast<float*>(host.data()) + row * cols;
        for (size_t c = 0; c < cols; ++c) dst[c] = value[codes[c]];
      }
    }
  }
  DeviceTensor out;
  out.dtype = dtype;
  TANDEM_ASSIGN_OR_RETURN(out.buffer, backend.Allocate(host.size()));
  TANDEM_RETURN_IF_ERROR(backend.CopyToDevice(out.buffer.data(), host.data(), host.size()));
  *total_bytes += host.size();
  return out;
}

// Uploads the concatenation of the projections `parts` as one device tensor. FP8 projections
// (w.IsFp8: an FP8 checkpoint's, or a float one's quantized here) stay FP8 where
// DeviceModel::KeepsFp8 (the backend multiplies FP8 weights, beside bf16 tables); elsewhere they
// are dequantized on the host on the way, rounded to w.dtype (bf16 or f32), and cost the device
// what the float original does.
absl::StatusOr<DeviceTensor> UploadProjection(Backend& backend, const ModelWeights& w,
                                              std::initializer_list<const TensorView*> parts,
                                              size_t* total_bytes) {
  const bool fp8 = w.IsFp8(*parts.begin());
  for (const TensorView* t : parts) {
    if (w.IsFp8(t) != fp8) {  // the binder refuses such checkpoints; a guard for other callers
      return absl::InvalidArgumentError(absl::StrCat("projections fused into one matrix mix FP8 ",
                                                     "and float: ", (*parts.begin())->name, " and ",
                                                     t->name));
    }
  }
  if (!fp8) return UploadStacked(backend, parts, total_bytes);
  const bool keep = DeviceModel::KeepsFp8(w, backend);
  if (!keep && w.dtype != DType::kBF16 && w.dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 projections beside ", std::string(DTypeName(w.dtype)),
                     " tables: dequantizing to that dtype is not supported (bf16 or f32 tables)"));
  }
  TANDEM_ASSIGN_OR_RETURN(const Fp8Rows rows, Fp8RowsOf(w, parts));
  if (keep) return UploadFp8(backend, rows, total_bytes);
  return UploadDequantized(backend, rows, w.dtype, total_bytes);
}

// The f32 row scales of FP8 parts (constant specs), end to end.
absl::StatusOr<DeviceBuffer> CreateScales(Backend& backend,
                                          std::initializer_list<const RandomTensorSpec*> parts,
                                          size_t* total_bytes) {
  size_t count = 0;
  for (const RandomTensorSpec* s : parts) count += static_cast<size_t>(s->numel());
  TANDEM_ASSIGN_OR_RETURN(DeviceBuffer out, backend.Allocate(count * 4));
  float* dst = out.as<float>();
  for (const RandomTensorSpec* s : parts) {
    TANDEM_RETURN_IF_ERROR(backend.Fill(dst, s->scale, static_cast<size_t>(s->numel())));
    dst += s->numel();
  }
  *total_bytes += count * 4;
  return out;
}

// Allocates one device tensor holding `parts` (all of one dtype) end to end and writes each
// part's values on the device: RandomFill for uniform parts, ones for norms.
absl::StatusOr<DeviceTensor> CreateStacked(Backend& backend,
                                           std::initializer_list<const RandomTensorSpec*> parts,
                                           size_t* total_bytes) {
  size_t bytes = 0;
  for (const RandomTensorSpec* s : parts) bytes += s->bytes();
  DeviceTensor out;
  out.dtype = (*parts.begin())->dtype;
  TANDEM_ASSIGN_OR_RETURN(out.buffer, backend.Allocate(bytes));
  char* dst = static_cast<char*>(out.buffer.data());
  for (const RandomTensorSpec* s : parts) {
    const size_t count = static_cast<size_t>(s->numel());
    if (s->init == RandomTensorSpec::Init::kUniform) {
      RandomFillParams fill;
      fill.dst = dst;
      fill.dtype = s->dtype;
      fill.count = count;
      fill.seed = s->seed;
      fill.scale = s->scale;
      TANDEM_RETURN_IF_ERROR(backend.RandomFill(fill));
    } else if (s->dtype == DType::kF32) {
      TANDEM_RETURN_IF_ERROR(backend.Fill(reinterpret_cast<float*>(dst), 1.0f, count));
    } else {
      // A norm vector ([H], a few KiB): built on the host, where ones of any dtype are easy.
      std::vector<char> ones(s->bytes());
      FillRandomTensorSlice(*s, 0, count, ones.data());
      TANDEM_RETURN_IF_ERROR(backend.CopyToDevice(dst, ones.data(), ones.size()));
    }
    dst += s->bytes();
  }
  *total_bytes += bytes;
  return out;
}

}  // namespace

bool DeviceModel::KeepsFp8(const ModelWeights& w, const Backend& backend) {
  return w.fp8_projections() && backend.SupportsFp8Weights() && w.dtype == DType::kBF16;
}

size_t DeviceModel::WeightBytes(const ModelWeights& w, const Backend& backend) {
  const bool keeps_fp8 = KeepsFp8(w, backend);
  // Upload's tensors: embed, final norm, lm_head unless tied, then per layer its norms and
  // matrices (FP8 projections, stored or quantized at load, as codes + f32 row scales where
  // kept, else as their dequantized w.dtype; float ones as stored) and the qkv biases converted
  // to f32 (AppendAsFloat).
  size_t bytes = w.embed->bytes + w.final_norm->bytes;
  if (w.lm_head != w.embed) bytes += w.lm_head->bytes;
  for (const LayerWeights& lw : w.layers) {
    for (const TensorView* t : {lw.attn_norm, lw.ffn_norm}) bytes += t->bytes;
    for (const TensorView* t :
         {lw.q_proj, lw.k_proj, lw.v_proj, lw.o_proj, lw.gate_proj, lw.up_proj, lw.down_proj}) {
      if (!w.IsFp8(t)) {
        bytes += t->bytes;
      } else if (keeps_fp8) {
        // 1-byte codes (also of a float projection quantized at load) + f32 row scales
        bytes += static_cast<size_t>(t->numel()) + static_cast<size_t>(t->shape[0]) * 4;
      } else {
        bytes += static_cast<size_t>(t->numel()) * DTypeBytes(w.dtype);
      }
    }
    for (const TensorView* b : {lw.q_bias, lw.k_bias, lw.v_bias}) {
      if (b != nullptr) bytes += static_cast<size_t>(b->numel()) * 4;
    }
    for (const TensorView* n : {lw.q_norm, lw.k_norm}) {
      if (n != nullptr) bytes += n->bytes;
    }
  }
  return bytes;
}

absl::StatusOr<size_t> DeviceModel::WeightBytes(const ModelConfig& config) {
  TANDEM_ASSIGN_OR_RETURN(const std::vector<RandomTensorSpec> specs, RandomModelTensors(config, 0));
  size_t bytes = 0;
  for (const RandomTensorSpec& s : specs) bytes += s.bytes();  // CreateStacked's sum
  return bytes;
}

absl::StatusOr<std::unique_ptr<DeviceModel>> DeviceModel::CreateRandom(const ModelConfig& config,
                                                                       Backend& backend,
                                                                       uint64_t seed) {
  TANDEM_ASSIGN_OR_RETURN(const std::vector<RandomTensorSpec> specs,
                          RandomModelTensors(config, seed));
  auto dm = std::unique_ptr<DeviceModel>(new DeviceModel());
  dm->config_ = config;
  size_t* total = &dm->weight_bytes_;
  // specs: embed, final norm, [lm_head], then 9 tensors per layer, 11 with q/k norms
  // (model_geometry.h).
  TANDEM_ASSIGN_OR_RETURN(dm->embed_, CreateStacked(backend, {&specs[0]}, total));
  TANDEM_ASSIGN_OR_RETURN(dm->final_norm_, CreateStacked(backend, {&specs[1]}, total));
  dm->tied_ = config.tie_word_embeddings;
  size_t next = 2;
  if (!dm->tied_) {
    TANDEM_ASSIGN_OR_RETURN(dm->lm_head_, CreateStacked(backend, {&specs[next++]}, total));
  }
  dm->layers_.reserve(static_cast<size_t>(config.num_layers));
  const bool fp8 = config.quantization == "fp8";
  if (fp8 && !backend.SupportsFp8Weights()) {
    return absl::InvalidArgumentError(
        absl::StrCat("random FP8 weights need a backend that multiplies FP8 (cuda), not ",
                     std::string(backend.name())));
  }
  const size_t norms = config.qk_norm ? 2 : 0;
  const size_t per_layer = 9 + norms + (fp8 ? 7 : 0);
  for (int64_t l = 0; l < config.num_layers; ++l, next += per_layer) {
    // attn_norm, q, k, v, o, ffn_norm, gate, up, down[, q_norm, k_norm][, the 7 fp8 scales]
    const RandomTensorSpec* s = &specs[next];
    const RandomTensorSpec* scale = s + 9 + norms;  // q, k, v, o, gate, up, down
    DeviceLayer layer;
    TANDEM_ASSIGN_OR_RETURN(layer.attn_norm, CreateStacked(backend, {&s[0]}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.qkv, CreateStacked(backend, {&s[1], &s[2], &s[3]}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.o_proj, CreateStacked(backend, {&s[4]}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.ffn_norm, CreateStacked(backend, {&s[5]}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.gate_up, CreateStacked(backend, {&s[6], &s[7]}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.down_proj, CreateStacked(backend, {&s[8]}, total));
    if (fp8) {
      TANDEM_ASSIGN_OR_RETURN(layer.qkv.scale,
                              CreateScales(backend, {&scale[0], &scale[1], &scale[2]}, total));
      TANDEM_ASSIGN_OR_RETURN(layer.o_proj.scale, CreateScales(backend, {&scale[3]}, total));
      TANDEM_ASSIGN_OR_RETURN(layer.gate_up.scale,
                              CreateScales(backend, {&scale[4], &scale[5]}, total));
      TANDEM_ASSIGN_OR_RETURN(layer.down_proj.scale, CreateScales(backend, {&scale[6]}, total));
    }
    if (config.qk_norm) {
      TANDEM_ASSIGN_OR_RETURN(layer.q_norm, CreateStacked(backend, {&s[9]}, total));
      TANDEM_ASSIGN_OR_RETURN(layer.k_norm, CreateStacked(backend, {&s[10]}, total));
    }
    dm->layers_.push_back(std::move(layer));
  }
  const std::vector<float> inv_freq = RopeInvFreq(config);
  dm->rope_attention_scaling_ = RopeAttentionScaling(config);
  TANDEM_ASSIGN_OR_RETURN(dm->inv_freq_, backend.Allocate(inv_freq.size() * 4));
  TANDEM_RETURN_IF_ERROR(
      backend.CopyToDevice(dm->inv_freq_.data(), inv_freq.data(), inv_freq.size() * 4));
  TANDEM_RETURN_IF_ERROR(backend.Synchronize());
  return dm;
}

absl::StatusOr<std::unique_ptr<DeviceModel>> DeviceModel::Upload(const Model& model,
                                                                 Backend& backend) {
  auto dm = std::unique_ptr<DeviceModel>(new DeviceModel());
  dm->config_ = model.config;
  const ModelWeights& w = model.weights;
  size_t* total = &dm->weight_bytes_;
  TANDEM_ASSIGN_OR_RETURN(dm->embed_, UploadStacked(backend, {w.embed}, total));
  TANDEM_ASSIGN_OR_RETURN(dm->final_norm_, UploadStacked(backend, {w.final_norm}, total));
  dm->tied_ = w.lm_head == w.embed;
  if (!dm->tied_) {
    TANDEM_ASSIGN_OR_RETURN(dm->lm_head_, UploadStacked(backend, {w.lm_head}, total));
  }
  dm->layers_.reserve(w.layers.size());
  for (const LayerWeights& lw : w.layers) {
    DeviceLayer layer;
    TANDEM_ASSIGN_OR_RETURN(layer.attn_norm, UploadStacked(backend, {lw.attn_norm}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.qkv,
                            UploadProjection(backend, w, {lw.q_proj, lw.k_proj, lw.v_proj}, total));
    if (lw.q_bias != nullptr) {
      std::vector<float> bias;
      for (const TensorView* b : {lw.q_bias, lw.k_bias, lw.v_bias}) AppendAsFloat(*b, bias);
      layer.qkv_bias.dtype = DType::kF32;
      TANDEM_ASSIGN_OR_RETURN(layer.qkv_bias.buffer, backend.Allocate(bias.size() * 4));
      TANDEM_RETURN_IF_ERROR(
          backend.CopyToDevice(layer.qkv_bias.buffer.data(), bias.data(), bias.size() * 4));
      *total += bias.size() * 4;
    }
    TANDEM_ASSIGN_OR_RETURN(layer.o_proj, UploadProjection(backend, w, {lw.o_proj}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.ffn_norm, UploadStacked(backend, {lw.ffn_norm}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.gate_up,
                            UploadProjection(backend, w, {lw.gate_proj, lw.up_proj}, total));
    TANDEM_ASSIGN_OR_RETURN(layer.down_proj, UploadProjection(backend, w, {lw.down_proj}, total));
    if (lw.q_norm != nullptr) {
      TANDEM_ASSIGN_OR_RETURN(layer.q_norm, UploadStacked(backend, {lw.q_norm}, total));
      TANDEM_ASSIGN_OR_RETURN(layer.k_norm, UploadStacked(backend, {lw.k_norm}, total));
    }
    dm->layers_.push_back(std::move(layer));
  }
  const std::vector<float> inv_freq = RopeInvFreq(model.config);
  dm->rope_attention_scaling_ = RopeAttentionScaling(model.config);
  TANDEM_ASSIGN_OR_RETURN(dm->inv_freq_, backend.Allocate(inv_freq.size() * 4));
  TANDEM_RETURN_IF_ERROR(
      backend.CopyToDevice(dm->inv_freq_.data(), inv_freq.data(), inv_freq.size() * 4));
  TANDEM_RETURN_IF_ERROR(backend.Synchronize());
  return dm;
}

absl::Status NormHeads(Backend& backend, const DeviceTensor& weight, float* x, int64_t rows,
                       int64_t heads, int64_t head_dim, int64_t token_stride, double eps) {
  if (!weight.buffer) return absl::OkStatus();
  RmsNormParams p;
  p.x = x;
  p.weight = weight.data();
  p.weight_dtype = weight.dtype;
  p.out = x;
  p.num_tokens = rows;
  p.hidden = head_dim;
  p.eps = static_cast<float>(eps);
  p.vectors_per_token = heads;
  p.token_stride = token_stride;
  return backend.RmsNorm(p);
}

}  // namespace tandem::gpu_worker
