#include "param_checks.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker::cuda_backend {

absl::Status Invalid(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

// A dimension that must be positive and fit a grid dimension or a cuBLAS int.
absl::Status CheckDim(absl::string_view op, absl::string_view name, int64_t value) {
  if (value <= 0 || value > INT_MAX) {
    return Invalid(op, absl::StrCat(name, " = ", value, " is not in [1, ", INT_MAX, "]"));
  }
  return absl::OkStatus();
}

// DTypeName as an absl::string_view (Debian's abseil does not take std::string_view).
absl::string_view DTypeStr(DType dtype) {
  const std::string_view name = DTypeName(dtype);
  return absl::string_view(name.data(), name.size());
}

// The parameter checks of WriteKv (backend.h's contract), without queuing anything.
absl::Status CheckWriteKv(const WriteKvParams& p) {
  if (p.k == nullptr || p.v == nullptr || p.slots == nullptr || p.k_cache == nullptr ||
      p.v_cache == nullptr) {
    return Invalid("WriteKv", "null pointer");
  }
  TANDEM_RETURN_IF_ERROR(CheckDim("WriteKv", "num_tokens", p.num_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim("WriteKv", "num_kv_heads", p.num_kv_heads));
  TANDEM_RETURN_IF_ERROR(CheckDim("WriteKv", "capacity", p.capacity));
  TANDEM_RETURN_IF_ERROR(CheckDim("WriteKv", "head_dim", p.head_dim));
  if (p.cache_dtype != DType::kF32 && p.cache_dtype != DType::kBF16) {
    return Invalid("WriteKv", absl::StrCat("cache dtype ", DTypeStr(p.cache_dtype),
                                           " is not supported (f32, bf16)"));
  }
  if (p.row_stride < p.num_kv_heads * p.head_dim) {
    return Invalid("WriteKv", absl::StrCat("row_stride ", p.row_stride, " < num_kv_heads·head_dim ",
                                           p.num_kv_heads * p.head_dim));
  }
  return absl::OkStatus();
}

WriteKvArgs WriteKvArgsOf(const WriteKvParams& p) {
  return {.k = p.k,
          .v = p.v,
          .row_stride = p.row_stride,
          .slots = p.slots,
          .k_cache = p.k_cache,
          .v_cache = p.v_cache,
          .cache_dtype = p.cache_dtype,
          .num_tokens = p.num_tokens,
          .num_kv_heads = p.num_kv_heads,
          .capacity = p.capacity,
          .head_dim = p.head_dim};
}

// The parameter checks of WindowAttention (backend.h's contract), without queuing anything.
absl::Status CheckWindowAttention(const WindowAttentionParams& p) {
  constexpr absl::string_view kOp = "WindowAttention";
  if (p.q == nullptr || p.q_pos == nullptr || p.k_cache == nullptr || p.v_cache == nullptr ||
      p.slot_pos == nullptr || p.o == nullptr || p.lse == nullptr) {
    return Invalid(kOp, "null pointer");
  }
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_tokens", p.num_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_q_heads", p.num_q_heads));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_kv_heads", p.num_kv_heads));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "capacity", p.capacity));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "head_dim", p.head_dim));
  if (p.num_kv_heads > 65535) return Invalid(kOp, "num_kv_heads must be <= 65535");
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return Invalid(kOp, absl::StrCat("num_q_heads ", p.num_q_heads,
                                     " is not a multiple of num_kv_heads ", p.num_kv_heads));
  }
  if (p.head_dim % kAttentionHeadDimMultiple != 0 ||
      p.head_dim > kAttentionMaxHeadDim) {
    return Invalid(kOp, absl::StrCat("head_dim ", p.head_dim, " must be a multiple of ",
                                     kAttentionHeadDimMultiple,
                                     " and <= ", kAttentionMaxHeadDim));
  }
  if (p.num_slots < 0 || p.num_slots > p.capacity) {
    return Invalid(
        kOp, absl::StrCat("num_slots ", p.num_slots, " not in [0, capacity ", p.capacity, "]"));
  }
  if (p.q_row_stride < p.num_q_heads * p.head_dim) {
    return Invalid(kOp, absl::StrCat("q_row_stride ", p.q_row_stride, " < num_q_heads·head_dim ",
                                     p.num_q_heads * p.head_dim));
  }
  if (p.num_tokens * (p.num_q_heads / p.num_kv_heads) > INT_MAX) {
    return Invalid(kOp, "num_tokens·(num_q_heads / num_kv_heads) exceeds INT_MAX");
  }
  if (p.cache_dtype != DType::kF32 && p.cache_dtype != DType::kBF16) {
    return Invalid(kOp, absl::StrCat("cache dtype ", DTypeStr(p.cache_dtype),
                                     " is not supported (f32, bf16)"));
  }
  if (!Aligned16(p.k_cache) || !Aligned16(p.v_cache)) {
    return Invalid(kOp, "k_cache and v_cache must be 16-byte aligned");
  }
  if (!std::isfinite(p.scale) || p.scale <= 0.0f) {
    return Invalid(kOp, absl::StrCat("scale ", p.scale, " must be finite and positive"));
  }
  if (p.maw != nullptr && !(p.alpha >= 0.0f && p.alpha <= 1.0f)) {
    return Invalid(kOp, absl::StrCat("alpha ", p.alpha, " not in [0, 1]"));
  }
  return absl::OkStatus();
}

WindowAttentionArgs WindowAttentionArgsOf(const WindowAttentionParams& p) {
  return {.q = p.q,
          .q_row_stride = p.q_row_stride,
          .q_pos = p.q_pos,
          .k_cache = p.k_cache,
          .v_cache = p.v_cache,
          .cache_dtype = p.cache_dtype,
          .slot_pos = p.slot_pos,
          .num_slots = p.num_slots,
          .capacity = p.capacity,
          .num_tokens = p.num_tokens,
          .num_q_heads = p.num_q_heads,
          .num_kv_heads = p.num_kv_heads,
          .head_dim = p.head_dim,
          .scale = p.scale,
          .o = p.o,
          .lse = p.lse,
          .maw = p.maw,
          .alpha = p.alpha};
}

// The parameter checks of SelectPages (backend.h's contract), without queuing anything.
absl::Status CheckSelectPages(const SelectPagesParams& p) {
  constexpr absl::string_view kOp = "SelectPages";
  if (p.q == nullptr || p.summaries == nullptr || p.pages == nullptr || p.scratch == nullptr) {
    return Invalid(kOp, "null pointer");
  }
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_tokens", p.num_tokens));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_q_heads", p.num_q_heads));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_kv_heads", p.num_kv_heads));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "head_dim", p.head_dim));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "select", p.select));
  TANDEM_RETURN_IF_ERROR(CheckDim(kOp, "num_pages", p.num_pages));
  if (p.num_pages > p.max_pages) {
    return Invalid(kOp, absl::StrCat("num_pages ", p.num_pages, " > max_pages ", p.max_pages));
  }
  // Grid limits: kv heads are a grid y dimension, token tiles a z dimension, rows an x one.
  if (p.num_kv_heads > 65535 || p.num_tokens > 65535 || p.num_tokens * p.num_kv_heads > INT_MAX) {
    return Invalid(kOp, absl::StrCat("num_kv_heads ", p.num_kv_heads, " and num_tokens ",
                                     p.num_tokens, " must be <= 65535 (and their product <= ",
                                     INT_MAX, ")"));
  }
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return Invalid(kOp, absl::StrCat("num_q_heads ", p.num_q_heads,
                                     " is not a multiple of num_kv_heads ", p.num_kv_heads));
  }
  if (p.q_row_stride < p.num_q_heads * p.head_dim) {
    return Invalid(kOp, absl::StrCat("q_row_stride ", p.q_row_stride, " < num_q_heads·head_dim ",
                                     p.num_q_heads * p.head_dim));
  }
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) {
    return Invalid(kOp, absl::StrCat("dtype ", DTypeStr(p.dtype), " is not supported (f32, bf16)"));
  }
  if (reinterpret_cast<uintptr_t>(p.scratch) % 4 != 0) {
    return Invalid(kOp, "scratch must be 4-byte aligned");
  }
  if (p.score != PageScore::kBound && p.score != PageScore::kCentroid) {
    return Invalid(kOp, "unknown page score");
  }
  if (p.keep != nullptr && (p.keep_per_head < 1 || p.keep_per_head >= p.select)) {
    return Invalid(kOp, absl::StrCat("keep_per_head ", p.keep_per_head, " must be in [1, select ",
                                     p.select, ")"));
  }
  return absl::OkStatus();
}

SelectPagesArgs SelectPagesArgsOf(const SelectPagesParams& p, int num_sms) {
  // backend.h's layout [Hkv, max_pages, kPageSummaryRows, D]: the bound reads the min (0) and
  // max (1) rows, the centroid the mean row (2) as both.
  const bool centroid = p.score == PageScore::kCentroid;
  const char* summaries = static_cast<const char*>(p.summaries);
  if (centroid) summaries += 2 * p.head_dim * DTypeBytes(p.dtype);
  return {.q = p.q,
          .q_row_stride = p.q_row_stride,
          .summaries = summaries,
          .page_stride = kPageSummaryRows * p.head_dim,
          .hi_offset = centroid ? 0 : p.head_dim,
          .dtype = p.dtype,
          .max_pages = p.max_pages,
          .num_pages = p.num_pages,
          .num_tokens = p.num_tokens,
          .num_q_heads = p.num_q_heads,
          .num_kv_heads = p.num_kv_heads,
          .head_dim = p.head_dim,
          .select = p.select,
          .pages = p.pages,
          .keep = p.keep,
          .keep_per_head = p.keep_per_head,
          .scratch = p.scratch,
          .num_sms = num_sms};
}

}  // namespace tandem::gpu_worker::cuda_backend
