// The one merge of partial attention states (numerics contract in proto/tandem/v1/common.proto).
//
// A state over key set I is (o[D], lse): o = softmax-weighted mean of V over I, lse =
// log(sum_{j in I} exp(s_j)). Two states over disjoint sets merge into the state over their
// union. lse == -inf marks an empty state: merging with it leaves the other side unchanged;
// two empty states give o = 0, lse = -inf (never NaN).
#pragma once

#include <cstddef>

namespace tandem::cpu_attention {

// dst <- merge(dst, src) for one state. o_dst, o_src: [head_dim].
void MergeStateInPlace(float* o_dst, float* lse_dst, const float* o_src, float lse_src,
                       size_t head_dim);

// out <- merge(a, b) for `rows` states: o_*: [rows, head_dim] contiguous, lse_*: [rows].
// out may alias a.
void MergeStates(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b,
                 float* o_out, float* lse_out, size_t rows, size_t head_dim);

}  // namespace tandem::cpu_attention
