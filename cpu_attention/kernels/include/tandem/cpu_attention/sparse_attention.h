// Attention of query rows over each kv head's selected entries, with oneDNN bf16 (or f32)
// matmuls and fp32 softmax/LSE (HGCA §3.3, CPU-local sparse attention).
//
// Work split: the selected entries of all heads, laid end to end, are cut into about
// `tasks_per_thread * pool threads` equal ranges (fewer on multi-token calls, whose partial
// states would otherwise outweigh the KV they cover: range_count.h). A range may cover the tail of one head and
// the head of the next (adjacent heads merged into one task, HGCA §3.3) or part of one long head
// (split along the keys). Each range yields partial (O, LSE) states that MergeStates combines,
// so no padding entries are needed and every task costs about the same.
//
// Inside a range, keys are processed in chunks of `chunk_keys` with an online softmax
// (flash-decoding): S = Q·Kᵀ (one matmul), fp32 max/exp/sum, O += P·V (one matmul).
// int8 KV (kv_store/int8_rows.h) with at most 12 query rows (T * G: decode) runs as
// PagedAttention's int8 scan over each head's rows (codes read in place, the per-row scales
// factored out of the dot products; paged_attention.h, its numerics); with more rows it is
// dequantised chunk by chunk into f32 tiles, then computed as f32.
// Precision: Q and P are split into bf16 hi + lo parts stacked as extra matmul rows, so with
// bf16 K/V the only rounding beyond K/V themselves is fp32 accumulation (the split costs
// compute, not memory traffic, and the scan is memory-bound).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <string>

#include "absl/status/status.h"
#include "tandem/cpu_attention/thread_pool.h"
#include "tandem/kv_store/block_format.h"

namespace tandem::cpu_attention {

// One kv head's problem. Query row r = t * group + j (token t, query head j of the GQA group).
struct HeadProblem {
  const std::byte* k = nullptr;  // [n, head_dim] of the KV dtype, contiguous
  const std::byte* v = nullptr;  // [n, head_dim]
  uint64_t n = 0;                // selected entries (0 = empty: O = 0, LSE = -inf)
  const float* q = nullptr;      // row (t, j) at q + t * q_token_stride + j * head_dim
  float* o = nullptr;            // row (t, j) at o + t * o_token_stride + j * head_dim
  float* lse = nullptr;          // row (t, j) at lse + t * lse_token_stride + j
};

struct AttentionParams {
  kv_store::KvDType dtype = kv_store::KvDType::kBf16;
  uint32_t head_dim = 128;
  uint32_t group = 1;        // G: query heads per kv head
  uint32_t num_tokens = 1;   // T
  size_t q_token_stride = 0;    // floats between token t and t+1 in q
  size_t o_token_stride = 0;    // floats between token t and t+1 in o
  size_t lse_token_stride = 0;  // floats between token t and t+1 in lse
  float scale = 0.0f;           // 0 = 1/sqrt(head_dim)
  uint32_t chunk_keys = 2048;   // keys per matmul chunk
  uint32_t tasks_per_thread = 8;   // ranges per pool thread at most (see the work split above)
};

// Computes O and LSE for every head of `heads`. INVALID_ARGUMENT on bad params; INTERNAL
// (naming the oneDNN call) if oneDNN fails. Thread-safe; uses `pool` for the tasks.
absl::Status SparseAttention(const AttentionParams& params, std::span<const HeadProblem> heads,
                             ThreadPool& pool);

// What bf16 KV runs on under the active instruction set: "oneDNN bf16 matmuls" (AVX-512 where
// oneDNN 2.6 has them) or "register-widening scan (<set>)" (AVX2-only CPUs, TANDEM_CPU_ISA below
// avx512). For start-up logs.
std::string Bf16AttentionPath();

}  // namespace tandem::cpu_attention
