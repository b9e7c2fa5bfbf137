#include "tandem/cpu_attention/salience.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <new>
#include <vector>

#include "absl/strings/str_format.h"
#include "row_scan_kernels.h"
#include "tandem/common/bf16.h"
#include "tandem/kv_store/int8_rows.h"

namespace tandem::cpu_attention {
namespace {

using kv_store::KvDType;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TANDEM_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TANDEM_VECTOR_CLONES
#endif

// scores[r * e + t] = q[r] · k[t] for r < rows, t < e; q: [rows, d] (pre-scaled), k: [e, d].
TANDEM_VECTOR_CLONES
void BlockScores(const float* q, size_t rows, const float* k, size_t e, size_t d, float* scores) {
  for (size_t r = 0; r < rows; ++r) {
    const float* qr = q + r * d;
    for (size_t t = 0; t < e; ++t) {
      const float* kt = k + t * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (size_t x = 0; x < d; ++x) acc += qr[x] * kt[x];
      scores[r * e + t] = acc;
    }
  }
}

// K rows of block `b` of the shard as f32: [entries, head_dim].
void BlockKeys(const kv_store::Shard& shard, size_t b, uint32_t entries, float* out) {
  const size_t n = size_t{entries} * shard.format().head_dim;
  if (shard.format().dtype == KvDType::kF32) {
    const float* k = reinterpret_cast<const float*>(shard.block_k(b));
    std::copy_n(k, n, out);
  } else if (shard.format().dtype == KvDType::kInt8) {
    kv_store::DequantizeRowsInt8(shard.block_k(b), entries, shard.format().head_dim, KvDType::kF32,
                                 reinterpret_cast<std::byte*>(out));
  } else {
    const bf16_t* k = reinterpret_cast<const bf16_t*>(shard.block_k(b));
    for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(k[i]);
  }
}

// scores [rows, e] of block b: q · k (q pre-scaled) over its keys. int8 rows with `int8` kernels
// (AVX-512 or AVX2) are scored from their codes in place (k_scale * (q · codes),
// row_scan_kernels.h); else the keys are widened into `keys` first. rows_k, scales_k:
// [block_tokens] scratch.
void ScoreBlock(const kv_store::Shard& shard, size_t b, uint32_t e, const float* q, size_t rows,
                const internal::RowScanKernels* int8, float* keys, const std::byte** rows_k,
                float* scales_k, float* scores) {
  const uint32_t D = shard.format().head_dim;
  if (int8 != nullptr) {
    const size_t row_bytes = shard.format().row_bytes();
    for (uint32_t t = 0; t < e; ++t) {
      rows_k[t] = shard.block_k(b) + t * row_bytes;
      scales_k[t] = kv_store::Int8RowScale(rows_k[t], D);
    }
    int8->scores(q, rows, D, rows_k, e, scales_k, scores, e, internal::RowPrefetch{});
    return;
  }
  BlockKeys(shard, b, e, keys);
  BlockScores(q, rows, keys, e, D, scores);
}

}  // namespace

absl::Status ComputeSalience(const AttentionParams& params, const kv_store::Shard& shard,
                             const float* q, std::span<float> a) {
  const kv_store::BlockFormat& fmt = shard.format();
  if (params.head_dim != fmt.head_dim || params.dtype != fmt.dtype) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "salience: params (head_dim %d, dtype %d) do not match the shard (%d, %d)", params.head_dim,
        static_cast<int>(params.dtype), fmt.head_dim, static_cast<int>(fmt.dtype)));
  }
  if (params.group < 1 || params.num_tokens < 1) {
    return absl::InvalidArgumentError("salience: group and num_tokens must be >= 1");
  }
  const size_t D = params.head_dim, G = params.group, T = params.num_tokens, M = G * T;
  if (T > 1 && params.q_token_stride < G * D) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "salience: q_token_stride %d < group * head_dim %d", params.q_token_stride, G * D));
  }
  const uint64_t held = shard.held();
  if (a.size() != held) {
    return absl::InvalidArgumentError(
        absl::StrFormat("salience: output has %d entries, shard holds %d", a.size(), held));
  }
  if (held == 0) return absl::OkStatus();
  if (q == nullptr) return absl::InvalidArgumentError("salience: null q");
  const float scale = params.scale > 0.0f ? params.scale : 1.0f / std::sqrt(static_cast<float>(D));

  try {
    // Scratch O(rows * block_tokens + block_tokens * head_dim), independent of held().
    const size_t bt = fmt.block_tokens;
    std::vector<float> qs(M * D), keys(bt * D), scores(M * bt), scales_k(bt);
    std::vector<const std::byte*> rows_k(bt);
    const internal::RowScanKernels* int8 =
        fmt.dtype == KvDType::kInt8 ? internal::GetInt8ScanKernels() : nullptr;
    auto score = [&](size_t b, uint32_t e) {
      ScoreBlock(shard, b, e, qs.data(), M, int8, keys.data(), rows_k.data(), scales_k.data(),
                 scores.data());
    };
    for (size_t r = 0; r < M; ++r) {
      const float* src = q + (r / G) * params.q_token_stride + (r % G) * D;
      for (size_t x = 0; x < D; ++x) qs[r * D + x] = src[x] * scale;
    }

    // Pass 1: per row, running max and sum of exp over every held entry -> LSE.
    std::vector<float> row_max(M, -std::numeric_limits<float>::infinity());
    std::vector<double> row_sum(M, 0.0);
    const size_t num_blocks = shard.blocks().size();
    for (size_t b = 0; b < num_blocks; ++b) {
      const uint32_t e = shard.block_entries(b);
      if (e == 0) continue;
      score(b, e);
      for (size_t r = 0; r < M; ++r) {
        const float* s = scores.data() + r * e;
        const float bm = *std::max_element(s, s + e);
        if (bm > row_max[r]) {
          row_sum[r] *= std::exp(static_cast<double>(row_max[r]) - bm);
          row_max[r] = bm;
        }
        double sum = 0.0;
        for (uint32_t t = 0; t < e; ++t) sum += std::exp(s[t] - row_max[r]);
        row_sum[r] += sum;
      }
    }
    std::vector<float> lse(M);
    for (size_t r = 0; r < M; ++r) lse[r] = row_max[r] + static_cast<float>(std::log(row_sum[r]));

    // Pass 2: a[i] = mean over rows of exp(s - lse).
    const float inv_rows = 1.0f / static_cast<float>(M);
    for (size_t b = 0; b < num_blocks; ++b) {
      const uint32_t e = shard.block_entries(b);
      if (e == 0) continue;
      score(b, e);
      float* out = a.data() + b * bt;
      for (uint32_t t = 0; t < e; ++t) {
        double sum = 0.0;
        for (size_t r = 0; r < M; ++r) sum += std::exp(scores[r * e + t] - lse[r]);
        out[t] = static_cast<float>(sum) * inv_rows;
      }
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("salience: scratch allocation failed");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrFormat("salience: %s", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace tandem::cpu_attention
