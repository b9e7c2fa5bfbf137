// The cuda backend's host-side parameter checks (backend.h's contract: null pointers, sizes,
// dtypes, alignment), made before anything is queued, and the conversion of checked parameters
// to the kernels' argument structs. Shared by the single and the batched entry points.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kv_write.cuh"
#include "key_projection.cuh"
#include "low_rank_score.cuh"
#include "page_select.cuh"
#include "tandem/gpu_worker/backend.h"
#include "window_attention.cuh"

namespace tandem::gpu_worker::cuda_backend {

// INVALID_ARGUMENT "op: what".
absl::Status Invalid(absl::string_view op, absl::string_view what);

// A dimension that must be positive and fit a grid dimension or a cuBLAS int.
absl::Status CheckDim(absl::string_view op, absl::string_view name, int64_t value);

// DTypeName as an absl::string_view (Debian's abseil does not take std::string_view).
absl::string_view DTypeStr(DType dtype);

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The parameter checks of WriteKv (backend.h's contract), without queuing anything.
absl::Status CheckWriteKv(const WriteKvParams& p);

// The kernels' arguments of checked parameters.
WriteKvArgs WriteKvArgsOf(const WriteKvParams& p);

// The parameter checks of WindowAttention (backend.h's contract), without queuing anything.
absl::Status CheckWindowAttention(const WindowAttentionParams& p);

WindowAttentionArgs WindowAttentionArgsOf(const WindowAttentionParams& p);

// The parameter checks of SelectPages (backend.h's contract), without queuing anything; for
// PageScore::kLowRank (summaries may be null) CheckLowRankKeys too.
absl::Status CheckSelectPages(const SelectPagesParams& p);
// The checks of p.low_rank: null pointers, rank outside [1, head_dim] (or over kLowRankMaxRank),
// page_tokens < 1, max_tokens < num_pages·page_tokens, softmax_scale not finite or <= 0.
absl::Status CheckLowRankKeys(const SelectPagesParams& p);

SelectPagesArgs SelectPagesArgsOf(const SelectPagesParams& p, int num_sms);
// The scoring kernel's arguments of a checked kLowRank selection (scores into p.scratch).
LowRankScoreArgs LowRankScoreArgsOf(const SelectPagesParams& p, int num_sms);

// The parameter checks of KeyGram and ProjectKeys (backend.h's contract): null pointers, sizes,
// slot and row ranges, rank, dtype.
absl::Status CheckKeyGram(const KeyGramParams& p);
KeyGramArgs KeyGramArgsOf(const KeyGramParams& p);
absl::Status CheckProjectKeys(const ProjectKeysParams& p);
ProjectKeysArgs ProjectKeysArgsOf(const ProjectKeysParams& p);

}  // namespace tandem::gpu_worker::cuda_backend
