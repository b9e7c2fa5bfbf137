// WindowAttention of the cpu backend (private to backend/cpu): attention of T query tokens over
// the slots of a window KV cache, with GQA, causal visibility by position, and the optional MAW
// update (semantics in backend.h).
//
// Method: the query rows of one kv head (token-major, the G heads of a token adjacent) are cut
// into work units of ~192 rows; each unit walks the slots in tiles: S = Q·Kᵀ (oneDNN sgemm, f32;
// bf16 caches are widened to f32 tile by tile so scores keep f32 accuracy), causal mask where the
// tile is not fully visible, online softmax in base 2 (flash-attention rescaling), O += P·V
// (sgemm). Tiles with no visible slot are skipped. Units run on an OpenMP team; when there are
// fewer units than threads (decode over a long window) the slots are split across units too and
// the partial states merged. The MAW update needs the final LSE, so it is a second pass: S again,
// w = 2^(S - lse) summed over the rows of each unit, then reduced over units.
#pragma once

#include "absl/status/status.h"
#include "cpu_scratch.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cpu {

// INVALID_ARGUMENT when p breaks the WindowAttentionParams contract (null pointers, non-positive
// sizes, num_slots outside [0, capacity], num_q_heads not a multiple of num_kv_heads, q_row_stride
// too small, a cache dtype other than f32/bf16, scale not finite and positive, alpha outside
// [0, 1] with maw). num_slots = 0 is valid: every state is empty.
absl::Status ValidateWindowAttention(const WindowAttentionParams& p);

// Runs validated attention calls on up to `threads` threads. Not thread-safe (one owner).
class WindowAttentionRunner {
 public:
  explicit WindowAttentionRunner(int threads) : threads_(threads < 1 ? 1 : threads) {}

  // RESOURCE_EXHAUSTED when scratch memory cannot be had, INTERNAL when a oneDNN call fails.
  absl::Status Run(const WindowAttentionParams& p);

 private:
  int threads_;
  ScratchBuffer tiles_;    // per slot tile: visibility summary
  ScratchBuffer partial_;  // states of slot splits 1.. : [splits - 1] x ([T, Hq, D] + [T, Hq])
  ScratchBuffer colsum_;   // MAW: [query units, Hkv, num_slots] summed weights
};

}  // namespace tandem::gpu_worker::cpu
