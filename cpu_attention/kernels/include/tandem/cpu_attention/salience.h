// Fresh salience of every held entry of a shard, for Reselect (HGCA Alg. 1 lines 20-22).
#pragma once

#include <span>

#include "absl/status/status.h"
#include "tandem/cpu_attention/sparse_attention.h"
#include "tandem/kv_store/shard.h"

namespace tandem::cpu_attention {

// a[i] = mean over the T*G query rows (t, j) of softmax_i(scale * q_(t,j) · k_i), the softmax
// taken over ALL held entries of `shard` (selected or not). `q` addresses rows as in
// HeadProblem (params.q_token_stride, head_dim). a.size() must equal shard.held(); the result
// sums to 1 (0 entries: nothing to do). Single-threaded; callers parallelise over shards.
absl::Status ComputeSalience(const AttentionParams& params, const kv_store::Shard& shard,
                             const float* q, std::span<float> a);

}  // namespace tandem::cpu_attention
