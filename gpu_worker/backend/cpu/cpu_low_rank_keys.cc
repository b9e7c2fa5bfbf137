#include "cpu_low_rank_keys.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "tandem/common/bf16.h"

namespace tandem::gpu_worker::cpu {
namespace {

// Gram rows per parallel work item: each item streams the head's keys once for this many rows.
constexpr int64_t kGramRowsPerItem = 8;

inline float ToF32(float x) { return x; }
inline float ToF32(bf16_t x) { return Bf16ToFloat(x); }

absl::Status Invalid(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrFormat("%s: %s", op, what));
}

// The checks KeyGram and ProjectKeys share: the keys, their sizes and slot range, the dtype.
absl::Status ValidateKeys(const char* op, const void* k, int64_t capacity, int64_t first_slot,
                          int64_t count, DType dtype, int64_t num_kv_heads, int64_t head_dim) {
  if (k == nullptr) return Invalid(op, "null pointer k");
  if (capacity < 1 || count < 1 || num_kv_heads < 1 || head_dim < 1) {
    return Invalid(op, absl::StrFormat("capacity %d, count %d, num_kv_heads %d and head_dim %d "
                                       "must be >= 1",
                                       capacity, count, num_kv_heads, head_dim));
  }
  if (first_slot < 0 || count > capacity - first_slot) {
    return Invalid(op, absl::StrFormat("slots [first_slot %d, + count %d) exceed capacity %d",
                                       first_slot, count, capacity));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return Invalid(op, absl::StrFormat("dtype %s is not supported (f32, bf16)",
                                       std::string(DTypeName(dtype))));
  }
  return absl::OkStatus();
}

// gram[g, d, e] for the rows d of one item: acc[i, :] += k[s, d0 + i]·k[s, :] over the slots in
// order, so each element is an f32 sum in slot order.
template <typename T>
void KeyGramTyped(const KeyGramParams& p, int threads) {
  const T* keys = static_cast<const T*>(p.k);
  const int64_t d_count = p.head_dim;
  const int64_t blocks = (d_count + kGramRowsPerItem - 1) / kGramRowsPerItem;
  const int64_t items = p.num_kv_heads * blocks;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t g = item / blocks;
    const int64_t d0 = (item % blocks) * kGramRowsPerItem;
    const int64_t rows = std::min(kGramRowsPerItem, d_count - d0);
    std::vector<float> acc(rows * d_count, 0.0f), key(d_count);
    const T* head = keys + (g * p.capacity + p.first_slot) * d_count;
    for (int64_t s = 0; s < p.count; ++s) {
      for (int64_t e = 0; e < d_count; ++e) key[e] = ToF32(head[s * d_count + e]);
      for (int64_t i = 0; i < rows; ++i) {
        const float kd = key[d0 + i];
        float* dst = &acc[i * d_count];
        for (int64_t e = 0; e < d_count; ++e) dst[e] += kd * key[e];
      }
    }
    std::copy(acc.begin(), acc.end(), p.gram + (g * d_count + d0) * d_count);
  }
}

// Codes and scale of one key from its coordinates c [rank] (backend.h's LowRankKeys rule).
void QuantizeCoordinates(const float* c, int64_t rank, int8_t* codes, float* scale) {
  float amax = 0.0f;
  for (int64_t r = 0; r < rank; ++r) amax = std::max(amax, std::abs(c[r]));
  const float a = amax / 127.0f;
  *scale = a;
  if (!(a > 0.0f) || !std::isfinite(a)) {  // every c_r is 0 (or the key is not finite)
    std::fill(codes, codes + rank, int8_t{0});
    return;
  }
  for (int64_t r = 0; r < rank; ++r) {
    const float v = std::clamp(std::nearbyint(c[r] / a), -127.0f, 127.0f);
    codes[r] = static_cast<int8_t>(v);
  }
}

template <typename T>
void ProjectKeysTyped(const ProjectKeysParams& p, int threads) {
  const T* keys = static_cast<const T*>(p.k);
  const int64_t d_count = p.head_dim;
  const int64_t rank = p.rank;
  const int64_t items = p.num_kv_heads * p.count;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> c(rank);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t g = item / p.count;
      const int64_t i = item % p.count;
      const T* key = keys + (g * p.capacity + p.first_slot + i) * d_count;
      const float* basis = p.basis + g * d_count * rank;
      std::fill(c.begin(), c.end(), 0.0f);
      for (int64_t d = 0; d < d_count; ++d) {  // c_r = Σ_d k_d·basis[d, r], in d order
        const float kd = ToF32(key[d]);
        const float* row = basis + d * rank;
        for (int64_t r = 0; r < rank; ++r) c[r] += kd * row[r];
      }
      const int64_t dst = g * p.max_tokens + p.first_token + i;
      QuantizeCoordinates(c.data(), rank, p.coords + dst * rank, p.scales + dst);
    }
  }
}

}  // namespace

absl::Status ValidateKeyGram(const KeyGramParams& p) {
  constexpr const char* kOp = "KeyGram";
  if (p.gram == nullptr) return Invalid(kOp, "null pointer gram");
  return ValidateKeys(kOp, p.k, p.capacity, p.first_slot, p.count, p.dtype, p.num_kv_heads,
                      p.head_dim);
}

absl::Status ValidateProjectKeys(const ProjectKeysParams& p) {
  constexpr const char* kOp = "ProjectKeys";
  if (p.basis == nullptr || p.coords == nullptr || p.scales == nullptr) {
    return Invalid(kOp, "null pointer (basis, coords or scales)");
  }
  const absl::Status keys = ValidateKeys(kOp, p.k, p.capacity, p.first_slot, p.count, p.dtype,
                                         p.num_kv_heads, p.head_dim);
  if (!keys.ok()) return keys;
  if (p.rank < 1 || p.rank > p.head_dim) {
    return Invalid(kOp, absl::StrFormat("rank %d not in [1, head_dim %d]", p.rank, p.head_dim));
  }
  if (p.max_tokens < 1 || p.first_token < 0 || p.count > p.max_tokens - p.first_token) {
    return Invalid(kOp, absl::StrFormat("rows [first_token %d, + count %d) exceed max_tokens %d",
                                        p.first_token, p.count, p.max_tokens));
  }
  return absl::OkStatus();
}

absl::Status ValidateLowRankKeys(const SelectPagesParams& p) {
  constexpr const char* kOp = "SelectPages (low rank)";
  const LowRankKeys& lr = p.low_rank;
  if (lr.basis == nullptr || lr.coords == nullptr || lr.scales == nullptr) {
    return Invalid(kOp, "null pointer (low_rank.basis, coords or scales)");
  }
  if (lr.rank < 1 || lr.rank > p.head_dim) {
    return Invalid(
        kOp, absl::StrFormat("low_rank.rank %d not in [1, head_dim %d]", lr.rank, p.head_dim));
  }
  if (lr.page_tokens < 1) {
    return Invalid(kOp, absl::StrFormat("low_rank.page_tokens %d must be >= 1", lr.page_tokens));
  }
  if (lr.max_tokens < 1 || p.num_pages > lr.max_tokens / lr.page_tokens) {
    return Invalid(kOp, absl::StrFormat("low_rank.max_tokens %d < num_pages %d · page_tokens %d",
                                        lr.max_tokens, p.num_pages, lr.page_tokens));
  }
  if (!std::isfinite(lr.softmax_scale) || lr.softmax_scale <= 0.0f) {
    return Invalid(
        kOp, absl::StrFormat("low_rank.softmax_scale %g must be finite and > 0", lr.softmax_scale));
  }
  return absl::OkStatus();
}

void RunKeyGram(const KeyGramParams& p, int threads) {
  if (p.dtype == DType::kF32) {
    KeyGramTyped<float>(p, threads);
  } else {
    KeyGramTyped<bf16_t>(p, threads);
  }
}

void RunProjectKeys(const ProjectKeysParams& p, int threads) {
  if (p.dtype == DType::kF32) {
    ProjectKeysTyped<float>(p, threads);
  } else {
    ProjectKeysTyped<bf16_t>(p, threads);
  }
}

void LowRankScoreRange(const SelectPagesParams& p, int64_t t, int64_t g, int64_t begin, int64_t end,
                       float* scores) {
  const LowRankKeys& lr = p.low_rank;
  const int64_t d_count = p.head_dim;
  const int64_t rank = lr.rank;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t page_tokens = lr.page_tokens;
  const float sigma = lr.softmax_scale;
  const float inv_sigma = 1.0f / sigma;  // the contract's 1/σ

  // q̃[j, r] = Σ_d q[t, g·G + j, d]·basis[g, d, r], in d order.
  std::vector<float> q_tilde(group * rank, 0.0f);
  const float* basis = lr.basis + g * d_count * rank;
  for (int64_t j = 0; j < group; ++j) {
    const float* q = p.q + t * p.q_row_stride + (g * group + j) * d_count;
    float* dst = &q_tilde[j * rank];
    for (int64_t d = 0; d < d_count; ++d) {
      const float qd = q[d];
      for (int64_t r = 0; r < rank; ++r) dst[r] += qd * basis[d * rank + r];
    }
  }

  // x[j, s] = σ·a_s·(q̃_j · code_s) for the keys s of one page; the page's score for head j is
  // (1/σ)·(max_s x + log Σ_s exp(x - max)).
  std::vector<float> codes(rank), x(group * page_tokens);
  const int8_t* head_codes = lr.coords + g * lr.max_tokens * rank;
  const float* head_scales = lr.scales + g * lr.max_tokens;
  for (int64_t page = begin; page < end; ++page) {
    for (int64_t s = 0; s < page_tokens; ++s) {
      const int64_t row = page * page_tokens + s;
      for (int64_t r = 0; r < rank; ++r) codes[r] = head_codes[row * rank + r];
      const float key_scale = sigma * head_scales[row];
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = &q_tilde[j * rank];
        float dot = 0.0f;
        for (int64_t r = 0; r < rank; ++r) dot += qj[r] * codes[r];
        x[j * page_tokens + s] = dot * key_scale;
      }
    }
    float best = 0.0f;
    for (int64_t j = 0; j < group; ++j) {
      const float* xj = &x[j * page_tokens];
      const float m = *std::max_element(xj, xj + page_tokens);
      float sum = 0.0f;
      for (int64_t s = 0; s < page_tokens; ++s) sum += std::exp(xj[s] - m);
      const float lse = m + std::log(sum);
      best = j == 0 ? lse : std::max(best, lse);
    }
    const float score = best * inv_sigma;
    scores[page] = score == 0.0f ? 0.0f : score;
  }
}

}  // namespace tandem::gpu_worker::cpu
