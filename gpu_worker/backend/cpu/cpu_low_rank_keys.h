// Low-rank keys on the cpu backend (private to backend/cpu), as specified in backend.h: KeyGram
// (Σ k·kᵀ per kv head), ProjectKeys (each key's int8 coordinates in a head's basis, with one
// scale) and the PageScore::kLowRank scores that SelectPages ranks pages by.
//
// Numerics: f32 products and sums, every sum in index order (slots for the Gram matrix, d for
// the coordinates and q̃, r for a key's estimate); exp and log are std::exp / std::log of floats.
// The cuda backend sums in other orders (and its scores through integer tensor-core products),
// so the two agree to rounding, and codes to ±1 where c_r / scale falls within rounding of a half.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cpu {

// INVALID_ARGUMENT when p breaks the KeyGramParams contract: null pointers, sizes < 1, slots
// outside [0, capacity), a dtype other than f32/bf16.
absl::Status ValidateKeyGram(const KeyGramParams& p);
// INVALID_ARGUMENT when p breaks the ProjectKeysParams contract: null pointers, sizes < 1, rank
// outside [1, head_dim], slots outside the cache or rows outside [0, max_tokens), a dtype other
// than f32/bf16.
absl::Status ValidateProjectKeys(const ProjectKeysParams& p);
// INVALID_ARGUMENT when p.low_rank breaks the LowRankKeys contract for p's pages and head_dim:
// null pointers, rank outside [1, head_dim], page_tokens < 1, max_tokens < num_pages·page_tokens,
// softmax_scale not finite or <= 0. ValidateSelectPages calls it for PageScore::kLowRank.
absl::Status ValidateLowRankKeys(const SelectPagesParams& p);

// Run validated calls on up to `threads` OpenMP threads; synchronous.
void RunKeyGram(const KeyGramParams& p, int threads);
void RunProjectKeys(const ProjectKeysParams& p, int threads);

// scores[page] for pages [begin, end) of the (token t, kv head g) row of a validated kLowRank
// selection (scores points at the row's first page). Called from inside an OpenMP loop: it uses
// only the calling thread. -0 is stored as +0.
void LowRankScoreRange(const SelectPagesParams& p, int64_t t, int64_t g, int64_t begin, int64_t end,
                       float* scores);

}  // namespace tandem::gpu_worker::cpu
