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
  const bool low_rank = p.score == PageScore::kLowRank;  // reads no summaries (may be null)
  if (p.q == nullptr || (p.summaries == nullptr && !low_rank) || p.pages == nullptr ||
      p.scratch == nullptr) {
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
  if (p.score != PageScore::kBound && p.score != PageScore::kCentroid && !low_rank) {
    return Invalid(kOp, "unknown page score");
  }
  if (low_rank) TANDEM_RETURN_IF_ERROR(CheckLowRankKeys(p));
  if (p.keep != nullptr && (p.keep_per_head < 1 || p.keep_per_head >= p.select)) {
    return Invalid(kOp, absl::StrCat("keep_per_head ", p.keep_per_head, " must be in [1, select ",
                                     p.select, ")"));
  }
  return absl::OkStatus();
}

// The checks of SelectPagesParams::low_rank for PageScore::kLowRank.
absl::Status CheckLowRankKeys(const SelectPagesParams& p) {
  constexpr absl::string_view kOp = "SelectPages (low rank)";
  const LowRankKeys& lr = p.low_rank;
  if (lr.basis == nullptr || lr.coords == nullptr || lr.scales == nullptr) {
    return Invalid(kOp, "null pointer (low_rank.basis, coords or scales)");
  }
  if (lr.rank < 1 || lr.rank > p.head_dim || lr.rank > kLowRankMaxRank) {
    return Invalid(kOp, absl::StrCat("low_rank.rank ", lr.rank, " not in [1, head_dim ", p.head_dim,
                                     "] (at most ", kLowRankMaxRank, ")"));
  }
  if (lr.page_tokens < 1) {
    return Invalid(kOp, absl::StrCat("low_rank.page_tokens ", lr.page_tokens, " must be >= 1"));
  }
  if (lr.max_tokens < 1 || p.num_pages > lr.max_tokens / lr.page_tokens) {
    return Invalid(kOp, absl::StrCat("low_rank.max_tokens ", lr.max_tokens, " < num_pages ",
                                     p.num_pages, " · page_tokens ", lr.page_tokens));
  }
  if (!std::isfinite(lr.softmax_scale) || lr.softmax_scale <= 0.0f) {
    return Invalid(
        kOp, absl::StrCat("low_rank.softmax_scale ", lr.softmax_scale, " must be finite and > 0"));
  }
  return absl::OkStatus();
}

LowRankScoreArgs LowRankScoreArgsOf(const SelectPagesParams& p, int num_sms) {
  return {.q = p.q,
          .q_row_stride = p.q_row_stride,
          .basis = p.low_rank.basis,
          .coords = p.low_rank.coords,
          .scales = p.low_rank.scales,
          .rank = p.low_rank.rank,
          .max_tokens = p.low_rank.max_tokens,
          .page_tokens = p.low_rank.page_tokens,
          .softmax_scale = p.low_rank.softmax_scale,
          .num_pages = p.num_pages,
          .num_tokens = p.num_tokens,
          .num_q_heads = p.num_q_heads,
          .num_kv_heads = p.num_kv_heads,
          .head_dim = p.head_dim,
          .scores = static_cast<float*>(p.scratch),
          .num_sms = num_sms};
}

namespace {

// The checks KeyGram and ProjectKeys share: the keys, their sizes and slot range, the dtype.
absl::Status CheckKeys(absl::string_view op, const void* k, int64_t capacity, int64_t first_slot,
                       int64_t count, DType dtype, int64_t num_kv_heads, int64_t head_dim) {
  if (k == nullptr) return Invalid(op, "null pointer k");
  TANDEM_RETURN_IF_ERROR(CheckDim(op, "capacity", capacity));
  TANDEM_RETURN_IF_ERROR(CheckDim(op, "count", count));
  TANDEM_RETURN_IF_ERROR(CheckDim(op, "head_dim", head_dim));
  TANDEM_RETURN_IF_ERROR(CheckDim(op, "num_kv_heads", num_kv_heads));
  if (num_kv_heads > 65535) {  // a grid dimension
    return Invalid(op, absl::StrCat("num_kv_heads ", num_kv_heads, " must be <= 65535"));
  }
  if (first_slot < 0 || count > capacity - first_slot) {
    return Invalid(op, absl::StrCat("slots [first_slot ", first_slot, ", + count ", count,
                                    ") exceed capacity ", capacity));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return Invalid(op, absl::StrCat("dtype ", DTypeStr(dtype), " is not supported (f32, bf16)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckKeyGram(const KeyGramParams& p) {
  constexpr absl::string_view kOp = "KeyGram";
  if (p.gram == nullptr) return Invalid(kOp, "null pointer gram");
  TANDEM_RETURN_IF_ERROR(
      CheckKeys(kOp, p.k, p.capacity, p.first_slot, p.count, p.dtype, p.num_kv_heads, p.head_dim));
  if (p.head_dim > 65535 * int64_t{32}) {  // 32-wide tiles in grid x and y
    return Invalid(kOp, absl::StrCat("head_dim ", p.head_dim, " is too large"));
  }
  return absl::OkStatus();
}

KeyGramArgs KeyGramArgsOf(const KeyGramParams& p) {
  return {.k = p.k,
          .capacity = p.capacity,
          .first_slot = p.first_slot,
          .count = p.count,
          .dtype = p.dtype,
          .num_kv_heads = p.num_kv_heads,
          .head_dim = p.head_dim,
          .gram = p.gram};
}

absl::Status CheckProjectKeys(const ProjectKeysParams& p) {
  constexpr absl::string_view kOp = "ProjectKeys";
  if (p.basis == nullptr || p.coords == nullptr || p.scales == nullptr) {
    return Invalid(kOp, "null pointer (basis, coords or scales)");
  }
  TANDEM_RETURN_IF_ERROR(
      CheckKeys(kOp, p.k, p.capacity, p.first_slot, p.count, p.dtype, p.num_kv_heads, p.head_dim));
  if (p.rank < 1 || p.rank > p.head_dim) {
    return Invalid(kOp, absl::StrCat("rank ", p.rank, " not in [1, head_dim ", p.head_dim, "]"));
  }
  if (p.max_tokens < 1 || p.first_token < 0 || p.count > p.max_tokens - p.first_token) {
    return Invalid(kOp, absl::StrCat("rows [first_token ", p.first_token, ", + count ", p.count,
                                     ") exceed max_tokens ", p.max_tokens));
  }
  return absl::OkStatus();
}

ProjectKeysArgs ProjectKeysArgsOf(const ProjectKeysParams& p) {
  return {.k = p.k,
          .capacity = p.capacity,
          .first_slot = p.first_slot,
          .count = p.count,
          .dtype = p.dtype,
          .num_kv_heads = p.num_kv_heads,
          .head_dim = p.head_dim,
          .basis = p.basis,
          .rank = p.rank,
          .coords = p.coords,
          .scales = p.scales,
          .max_tokens = p.max_tokens,
          .first_token = p.first_token};
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
