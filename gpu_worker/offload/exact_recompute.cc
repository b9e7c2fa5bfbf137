#include "tandem/gpu_worker/exact_recompute.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "tandem/common/bf16.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

DType ExactRecompute::ActivationDType(DType weight_dtype) {
  // FP8 projections take bf16 activations (MatMulParams).
  return weight_dtype == DType::kBF16 || weight_dtype == DType::kF8E4M3 ? DType::kBF16
                                                                        : DType::kF32;
}

absl::StatusOr<std::unique_ptr<ExactRecompute>> ExactRecompute::Create(Backend& backend,
                                                                       const DeviceModel& model,
                                                                       const WindowGeometry& window,
                                                                       int64_t page_tokens,
                                                                       int64_t max_rows) {
  const ModelConfig& c = model.config();
  if (RopeDependsOnLength(c)) {
    return absl::FailedPreconditionError(
        "exact recompute: the model's RoPE frequencies depend on the sequence length; a K "
        "recomputed later would not be the one the window held");
  }
  if (page_tokens < 1 || max_rows < 1 || window.num_layers != c.num_layers ||
      window.num_kv_heads != c.num_kv_heads || window.head_dim != c.head_dim) {
    return absl::InvalidArgumentError("exact recompute: bad sizes or a window of another model");
  }
  auto r = std::unique_ptr<ExactRecompute>(
      new ExactRecompute(backend, model, window, page_tokens, max_rows));
  const int64_t P = page_tokens, H = c.hidden_size, D = c.head_dim, Hkv = c.num_kv_heads;
  const size_t kv_half = Hkv * P * D * DTypeBytes(window.dtype);
  for (int b = 0; b < 2; ++b) {
    TANDEM_ASSIGN_OR_RETURN(r->rows_[b], backend.Allocate(P * r->row_bytes_));
    TANDEM_ASSIGN_OR_RETURN(r->positions_dev_[b], backend.Allocate(P * 4));
  }
  TANDEM_ASSIGN_OR_RETURN(r->x_, backend.Allocate(P * H * 4));
  TANDEM_ASSIGN_OR_RETURN(r->kv_, backend.Allocate(P * 2 * Hkv * D * 4));
  TANDEM_ASSIGN_OR_RETURN(r->k_, backend.Allocate(kv_half));
  TANDEM_ASSIGN_OR_RETURN(r->v_, backend.Allocate(kv_half));
  TANDEM_ASSIGN_OR_RETURN(r->iota_, backend.Allocate(P * 4));
  std::vector<int32_t> iota(P);
  std::iota(iota.begin(), iota.end(), 0);
  TANDEM_RETURN_IF_ERROR(backend.CopyToDevice(r->iota_.data(), iota.data(), P * 4));
  TANDEM_ASSIGN_OR_RETURN(r->attend_,
                          StagedAttention::Create(backend, P, c.num_q_heads, D, max_rows));
  return r;
}

ExactRecompute::ExactRecompute(Backend& backend, const DeviceModel& model,
                               const WindowGeometry& window, int64_t page_tokens, int64_t max_rows)
    : backend_(backend),
      model_(model),
      window_(window),
      page_tokens_(page_tokens),
      max_rows_(max_rows),
      hidden_(model.config().hidden_size),
      layers_count_(model.config().num_layers),
      act_dtype_(ActivationDType(model.layer(0).qkv.dtype)),
      row_bytes_(hidden_ * DTypeBytes(act_dtype_)),
      pages_(model.config().num_layers) {}

absl::Status ExactRecompute::Take(int64_t layer, const float* xn, int64_t rows, int64_t first_pos) {
  if (layer < 0 || layer >= layers_count_ || rows < 1 || xn == nullptr || first_pos < 0) {
    return absl::InvalidArgumentError("exact recompute: bad layer, rows or positions");
  }
  download_.resize(rows * hidden_);
  TANDEM_RETURN_IF_ERROR(backend_.CopyToHost(download_.data(), xn, download_.size() * 4));
  for (int64_t t = 0; t < rows; ++t) {
    std::vector<char>& entry = pending_[first_pos + t];
    entry.resize(layers_count_ * row_bytes_);
    char* dst = entry.data() + layer * row_bytes_;
    const float* src = download_.data() + t * hidden_;
    if (act_dtype_ == DType::kBF16) {
      bf16_t* out = reinterpret_cast<bf16_t*>(dst);
      for (int64_t i = 0; i < hidden_; ++i) out[i] = FloatToBf16(src[i]);
    } else {
      std::memcpy(dst, src, row_bytes_);
    }
  }
  return absl::OkStatus();
}

bool ExactRecompute::HasPending(int64_t first_pos, int64_t count) const {
  for (int64_t p = first_pos; p < first_pos + count; ++p) {
    if (!pending_.contains(p)) return false;
  }
  return true;
}

absl::Status ExactRecompute::Keep(int64_t first_pos, int64_t count) {
  if (!HasPending(first_pos, count)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "exact recompute: no layer inputs for positions ", first_pos, "..", first_pos + count));
  }
  for (int64_t p = first_pos; p < first_pos + count; ++p) {
    auto it = pending_.find(p);
    TANDEM_RETURN_IF_ERROR(AppendEntry(it->second.data(), row_bytes_, p));
    pending_.erase(it);
  }
  return absl::OkStatus();
}

absl::Status ExactRecompute::AppendRows(const void* rows, int64_t n, int64_t first_pos) {
  if (rows == nullptr || n < 0 || first_pos < 0) {
    return absl::InvalidArgumentError("exact recompute: bad rows");
  }
  for (int64_t t = 0; t < n; ++t) {
    TANDEM_RETURN_IF_ERROR(
        AppendEntry(static_cast<const char*>(rows) + t * row_bytes_, 0, first_pos + t));
  }
  return absl::OkStatus();
}

absl::Status ExactRecompute::AppendEntry(const char* rows, size_t layer_stride, int64_t position) {
  const int64_t at = tokens() % page_tokens_;
  const int32_t pos = static_cast<int32_t>(position);
  for (int64_t l = 0; l < layers_count_; ++l) {
    std::vector<DeviceBuffer>& pages = pages_[l];
    if (at == 0) {
      TANDEM_ASSIGN_OR_RETURN(DeviceBuffer page,
                              backend_.AllocateHost(page_tokens_ * (row_bytes_ + 4)));
      host_bytes_ += page.bytes();
      pages.push_back(std::move(page));
    }
    char* page = pages.back().as<char>();
    std::memcpy(page + at * row_bytes_, rows + l * layer_stride, row_bytes_);
    std::memcpy(page + page_tokens_ * row_bytes_ + at * 4, &pos, 4);
  }
  positions_.push_back(static_cast<int32_t>(position));
  return absl::OkStatus();
}

void ExactRecompute::Drop(int64_t first_pos, int64_t count) {
  pending_.erase(pending_.lower_bound(first_pos), pending_.lower_bound(first_pos + count));
}

absl::Status ExactRecompute::BeginPass() { return Plan(0); }

absl::Status ExactRecompute::Plan(int64_t layer) {
  items_.clear();
  next_ = 0;
  for (int64_t l = layer; l < layers_count_; ++l) {
    for (size_t p = 0; p < pages_[l].size(); ++p) items_.push_back({l, p});
  }
  for (size_t i = 0; i < items_.size() && i < 2; ++i) TANDEM_RETURN_IF_ERROR(Issue(i));
  return absl::OkStatus();
}

absl::Status ExactRecompute::Issue(size_t index) {
  static_assert(kFirstSlot + 2 <= Backend::kUploadSlots, "two upload slots past the streamer's");
  const Item& item = items_[index];
  const int b = static_cast<int>(index % 2);
  const int64_t n = PageEntries(item.page);
  const char* page = pages_[item.layer][item.page].as<char>();
  UploadParams u;
  u.rows = 1;
  u.dst = rows_[b].data();
  u.src_host = page;
  u.row_bytes = u.dst_pitch = u.src_pitch = n * row_bytes_;
  TANDEM_RETURN_IF_ERROR(backend_.UploadAsync(u, kFirstSlot + b));
  u.dst = positions_dev_[b].data();
  u.src_host = page + page_tokens_ * row_bytes_;
  u.row_bytes = u.dst_pitch = u.src_pitch = n * 4;
  return backend_.UploadAsync(u, kFirstSlot + b);
}

absl::Status ExactRecompute::Attend(int64_t layer, const WindowAttentionParams& base) {
  const ModelConfig& c = model_.config();
  if (base.num_tokens > max_rows_ || base.num_q_heads != c.num_q_heads) {
    return absl::InvalidArgumentError("exact recompute: more query rows or heads than planned");
  }
  if (layer < 0 || layer >= layers_count_) {
    return absl::InvalidArgumentError("exact recompute: bad layer");
  }
  if (next_ >= items_.size() || items_[next_].layer != layer || items_[next_].page != 0) {
    TANDEM_RETURN_IF_ERROR(Plan(layer));
  }
  const int64_t H = hidden_, D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const DeviceLayer& w = model_.layer(layer);
  const size_t w_row = H * DTypeBytes(w.qkv.dtype);
  while (next_ < items_.size() && items_[next_].layer == layer) {
    const int b = static_cast<int>(next_ % 2);
    const int64_t n = PageEntries(items_[next_].page);
    TANDEM_RETURN_IF_ERROR(backend_.WaitUpload(kFirstSlot + b));
    // The stored rows as f32: a gather of the page's own rows 0..n-1.
    TANDEM_RETURN_IF_ERROR(backend_.Embed(
        {iota_.as<int32_t>(), rows_[b].data(), act_dtype_, x_.as<float>(), n, H, page_tokens_}));
    // [n, 2·Hkv·D] = x · [Wk; Wv]ᵀ (+ their biases): the rows after the Hq·D query rows.
    MatMulParams mm;
    mm.x = x_.as<float>();
    mm.w = static_cast<const char*>(w.qkv.data()) + Hq * D * w_row;
    mm.w_dtype = w.qkv.dtype;
    mm.w_scale = w.qkv.scale_data() != nullptr ? w.qkv.scale_data() + Hq * D : nullptr;
    mm.bias = w.qkv_bias.buffer ? w.qkv_bias.buffer.as<float>() + Hq * D : nullptr;
    mm.y = kv_.as<float>();
    mm.m = n;
    mm.n = 2 * Hkv * D;
    mm.k = H;
    TANDEM_RETURN_IF_ERROR(backend_.MatMul(mm));
    TANDEM_RETURN_IF_ERROR(
        NormHeads(backend_, w.k_norm, kv_.as<float>(), n, Hkv, D, 2 * Hkv * D, c.rms_norm_eps));
    RopeParams rope;
    rope.x = kv_.as<float>();
    rope.row_stride = 2 * Hkv * D;
    rope.positions = positions_dev_[b].as<int32_t>();
    rope.inv_freq = model_.inv_freq();
    rope.attention_scaling = model_.rope_attention_scaling();
    rope.num_tokens = n;
    rope.num_heads = Hkv;
    rope.head_dim = D;
    TANDEM_RETURN_IF_ERROR(backend_.Rope(rope));
    // The staged rows and positions are read: the slot takes the page two ahead.
    TANDEM_RETURN_IF_ERROR(backend_.ReleaseUpload(kFirstSlot + b));
    const size_t refill = next_ + 2;
    ++next_;
    if (refill < items_.size()) TANDEM_RETURN_IF_ERROR(Issue(refill));
    WriteKvParams wk;
    wk.k = kv_.as<float>();
    wk.v = kv_.as<float>() + Hkv * D;
    wk.row_stride = 2 * Hkv * D;
    wk.slots = iota_.as<int32_t>();
    wk.k_cache = k_.data();
    wk.v_cache = v_.data();
    wk.cache_dtype = window_.dtype;
    wk.num_tokens = n;
    wk.num_kv_heads = Hkv;
    wk.capacity = page_tokens_;
    wk.head_dim = D;
    TANDEM_RETURN_IF_ERROR(backend_.WriteKv(wk));
    TANDEM_RETURN_IF_ERROR(attend_->AttendAndMerge(base, k_.data(), v_.data(), window_.dtype, n));
  }
  return absl::OkStatus();
}

}  // namespace tandem::gpu_worker
