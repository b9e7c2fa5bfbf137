#include "tandem/gpu_worker/model_weights.h"

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {
namespace {

bool IsFloat(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

// DTypeName as an absl::string_view (Debian's absl::StrCat does not take std::string_view).
absl::string_view Name(DType dtype) {
  const std::string_view name = DTypeName(dtype);
  return absl::string_view(name.data(), name.size());
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Looks up tensors by name and checks shapes and dtypes; the first matrix fixes the dtype.
class Binder {
 public:
  explicit Binder(const SafetensorsArchive& archive) : archive_(archive) {}

  // A float tensor of exactly `shape`.
  absl::StatusOr<const TensorView*> Vector(const std::string& name,
                                           const std::vector<int64_t>& shape) {
    const TensorView* view = archive_.Find(name);
    if (view == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weights: tensor \"", name, "\" (expected shape ", ShapeString(shape), ") is missing"));
    }
    if (view->shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat("weights: tensor \"", name, "\" has shape ",
                                                     ShapeString(view->shape), ", expected ",
                                                     ShapeString(shape)));
    }
    if (!IsFloat(view->dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("weights: tensor \"", name, "\" has dtype ",
                                                     Name(view->dtype),
                                                     ", expected f32, bf16 or f16"));
    }
    return view;
  }

  // An embedding table or lm_head [rows, cols]: float, one dtype for every table and every
  // float projection. Bind the tables first.
  absl::StatusOr<const TensorView*> Table(const std::string& name, int64_t rows, int64_t cols) {
    TANDEM_ASSIGN_OR_RETURN(const TensorView* view, Vector(name, {rows, cols}));
    TANDEM_RETURN_IF_ERROR(SameDType(view, first_table_));
    if (first_table_ == nullptr) first_table_ = view;
    return view;
  }

  // A projection [rows, cols]: a float matrix of the tables' dtype, or FP8 (e4m3) with a
  // `*.weight_scale` (per output row [rows, 1] or [rows], or per tensor [1] or []), recorded in
  // *scales. FP8 and float projections may be mixed (a checkpoint's `ignore` /
  // `modules_to_not_convert` leave some modules float); the caller checks that the projections
  // fused on the device share a dtype (SameFusedDType).
  absl::StatusOr<const TensorView*> Projection(const std::string& name, int64_t rows, int64_t cols,
                                               FP8Scales* scales) {
    const TensorView* view = archive_.Find(name);
    if (view == nullptr || view->dtype != DType::kF8E4M3) {
      TANDEM_ASSIGN_OR_RETURN(view, Vector(name, {rows, cols}));
      TANDEM_RETURN_IF_ERROR(SameDType(view, first_table_));
    } else {
      if (view->shape != std::vector<int64_t>{rows, cols}) {
        return absl::InvalidArgumentError(absl::StrCat("weights: tensor \"", name, "\" has shape ",
                                                       ShapeString(view->shape), ", expected ",
                                                       ShapeString({rows, cols})));
      }
      TANDEM_ASSIGN_OR_RETURN((*scales)[view], Scale(name, rows, cols));
      any_fp8_ = true;
    }
    return view;
  }

  // The dtype the model computes in: the tables'.
  DType matrix_dtype() const { return first_table_->dtype; }
  // kF8E4M3 when any projection is stored FP8, else the tables' dtype.
  DType projection_dtype() const { return any_fp8_ ? DType::kF8E4M3 : matrix_dtype(); }

  // INVALID_ARGUMENT unless the projections `fused` (q/k/v, or gate/up: one matrix on the
  // device) share a dtype.
  static absl::Status SameFusedDType(std::initializer_list<const TensorView*> fused) {
    const TensorView* first = *fused.begin();
    for (const TensorView* t : fused) {
      if (t->dtype == first->dtype) continue;
      return absl::InvalidArgumentError(
          absl::StrCat("weights: \"", t->name, "\" is ", Name(t->dtype), " but \"", first->name,
                       "\" is ", Name(first->dtype),
                       ": projections fused into one matrix (q/k/v, gate/up) must share a "
                       "dtype (FP8 or not)"));
    }
    return absl::OkStatus();
  }

 private:
  // INVALID_ARGUMENT unless `view` has the dtype of `first` (or first is null).
  static absl::Status SameDType(const TensorView* view, const TensorView* first) {
    if (first == nullptr || view->dtype == first->dtype) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("weights: tensor \"", view->name, "\" has dtype ", Name(view->dtype),
                     " but \"", first->name, "\" has ", Name(first->dtype),
                     ": all matrices must share one dtype (FP8 projections beside float tables "
                     "excepted)"));
  }

  // The weight_scale of the FP8 matrix `name` ([rows, cols]).
  absl::StatusOr<const TensorView*> Scale(const std::string& name, int64_t rows, int64_t cols) {
    constexpr absl::string_view kSuffix = ".weight";
    const std::string base =
        absl::EndsWith(name, kSuffix) ? name.substr(0, name.size() - kSuffix.size()) : name;
    const std::string scale_name = base + ".weight_scale";
    const TensorView* scale = archive_.Find(scale_name);
    if (scale == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights: FP8 tensor \"", name, "\" has no \"", scale_name, "\""));
    }
    if (!IsFloat(scale->dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("weights: tensor \"", scale_name,
                                                     "\" has dtype ", Name(scale->dtype),
                                                     ", expected f32, bf16 or f16"));
    }
    const std::vector<int64_t>& s = scale->shape;
    const bool per_row = s == std::vector<int64_t>{rows, 1} || s == std::vector<int64_t>{rows};
    const bool per_tensor = scale->numel() == 1 && s.size() <= 2;
    if (!per_row && !per_tensor) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights: tensor \"", scale_name, "\" has shape ", ShapeString(s),
                       " for a [", rows, ", ", cols, "] matrix: FP8 scales per output row ([", rows,
                       ", 1]) or per tensor ([1]) are supported, not block-wise ones"));
    }
    return scale;
  }

  const SafetensorsArchive& archive_;
  const TensorView* first_table_ = nullptr;
  bool any_fp8_ = false;  // a projection is stored FP8
};

}  // namespace

absl::StatusOr<ModelWeights> BindModelWeights(const ModelConfig& config,
                                              const SafetensorsArchive& archive) {
  const int64_t hidden = config.hidden_size;
  const int64_t q_dim = config.num_q_heads * config.head_dim;
  const int64_t kv_dim = config.num_kv_heads * config.head_dim;
  const int64_t ffn = config.intermediate_size;
  const int64_t vocab = config.vocab_size;

  Binder bind(archive);
  ModelWeights weights;
  TANDEM_ASSIGN_OR_RETURN(weights.embed, bind.Table("model.embed_tokens.weight", vocab, hidden));
  TANDEM_ASSIGN_OR_RETURN(weights.final_norm, bind.Vector("model.norm.weight", {hidden}));
  if (config.tie_word_embeddings) {
    // transformers ties lm_head to the embedding even if a checkpoint also stores lm_head.weight.
    weights.lm_head = weights.embed;
  } else {
    TANDEM_ASSIGN_OR_RETURN(weights.lm_head, bind.Table("lm_head.weight", vocab, hidden));
  }

  weights.layers.resize(static_cast<size_t>(config.num_layers));
  for (int64_t i = 0; i < config.num_layers; ++i) {
    LayerWeights& layer = weights.layers[static_cast<size_t>(i)];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    TANDEM_ASSIGN_OR_RETURN(layer.attn_norm,
                            bind.Vector(absl::StrCat(p, "input_layernorm.weight"), {hidden}));
    TANDEM_ASSIGN_OR_RETURN(
        layer.q_proj, bind.Projection(absl::StrCat(p, "self_attn.q_proj.weight"), q_dim, hidden,
                                      &weights.fp8_scales));
    TANDEM_ASSIGN_OR_RETURN(
        layer.k_proj, bind.Projection(absl::StrCat(p, "self_attn.k_proj.weight"), kv_dim, hidden,
                                      &weights.fp8_scales));
    TANDEM_ASSIGN_OR_RETURN(
        layer.v_proj, bind.Projection(absl::StrCat(p, "self_attn.v_proj.weight"), kv_dim, hidden,
                                      &weights.fp8_scales));
    TANDEM_ASSIGN_OR_RETURN(
        layer.o_proj, bind.Projection(absl::StrCat(p, "self_attn.o_proj.weight"), hidden, q_dim,
                                      &weights.fp8_scales));
    if (config.qkv_bias) {
      TANDEM_ASSIGN_OR_RETURN(layer.q_bias,
                              bind.Vector(absl::StrCat(p, "self_attn.q_proj.bias"), {q_dim}));
      TANDEM_ASSIGN_OR_RETURN(layer.k_bias,
                              bind.Vector(absl::StrCat(p, "self_attn.k_proj.bias"), {kv_dim}));
      TANDEM_ASSIGN_OR_RETURN(layer.v_bias,
                              bind.Vector(absl::StrCat(p, "self_attn.v_proj.bias"), {kv_dim}));
    }
    if (config.qk_norm) {
      const int64_t d = config.head_dim;
      TANDEM_ASSIGN_OR_RETURN(layer.q_norm,
                              bind.Vector(absl::StrCat(p, "self_attn.q_norm.weight"), {d}));
      TANDEM_ASSIGN_OR_RETURN(layer.k_norm,
                              bind.Vector(absl::StrCat(p, "self_attn.k_norm.weight"), {d}));
    }
    TANDEM_ASSIGN_OR_RETURN(
        layer.ffn_norm, bind.Vector(absl::StrCat(p, "post_attention_layernorm.weight"), {hidden}));
    TANDEM_ASSIGN_OR_RETURN(
        layer.gate_proj,
        bind.Projection(absl::StrCat(p, "mlp.gate_proj.weight"), ffn, hidden, &weights.fp8_scales));
    TANDEM_ASSIGN_OR_RETURN(layer.up_proj, bind.Projection(absl::StrCat(p, "mlp.up_proj.weight"),
                                                           ffn, hidden, &weights.fp8_scales));
    TANDEM_ASSIGN_OR_RETURN(
        layer.down_proj,
        bind.Projection(absl::StrCat(p, "mlp.down_proj.weight"), hidden, ffn, &weights.fp8_scales));
    TANDEM_RETURN_IF_ERROR(Binder::SameFusedDType({layer.q_proj, layer.k_proj, layer.v_proj}));
    TANDEM_RETURN_IF_ERROR(Binder::SameFusedDType({layer.gate_proj, layer.up_proj}));
  }
  weights.dtype = bind.matrix_dtype();
  weights.stored_projection_dtype = bind.projection_dtype();
  weights.quantize_at_load =
      config.quantization == "fp8" && weights.stored_projection_dtype != DType::kF8E4M3;
  if (weights.quantize_at_load && weights.dtype == DType::kF16) {
    // Upload would have to dequantize them to f16, which it does not (device_model.h).
    return absl::InvalidArgumentError(
        "weights: --quantization fp8 quantizes bf16 or f32 checkpoints at load, and this one is "
        "f16 (FP8 projections run beside bf16 or f32 tables); run it without --quantization");
  }
  return weights;
}

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::filesystem::path& model_dir,
                                                 const LoadOptions& options) {
  auto model = std::make_unique<Model>();
  model->dir = model_dir;
  TANDEM_ASSIGN_OR_RETURN(model->config, LoadModelConfig(model_dir));
  TANDEM_RETURN_IF_ERROR(ApplyQuantizationOption(options.quantization, &model->config));
  TANDEM_ASSIGN_OR_RETURN(model->archive, SafetensorsArchive::Open(model_dir));
  absl::StatusOr<ModelWeights> weights = BindModelWeights(model->config, *model->archive);
  if (!weights.ok()) {
    return absl::Status(weights.status().code(),
                        absl::StrCat(model_dir.string(), ": ", weights.status().message()));
  }
  model->weights = *std::move(weights);
  return model;
}

}  // namespace tandem::gpu_worker
