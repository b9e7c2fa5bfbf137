#include "tandem/cpu_attention/merge_state.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tandem::cpu_attention {
namespace {

// out <- merge((o_a, lse_a), (o_b, lse_b)) for one row. o_out may equal o_a or o_b.
inline void MergeRow(const float* o_a, float lse_a, const float* o_b, float lse_b, float* o_out,
                     float* lse_out, size_t head_dim) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (lse_b == kNegInf) {
    if (lse_a == kNegInf) {
      std::fill_n(o_out, head_dim, 0.0f);  // two empty states: o = 0, never NaN
    } else if (o_out != o_a) {
      std::copy_n(o_a, head_dim, o_out);
    }
    *lse_out = lse_a;
    return;
  }
  if (lse_a == kNegInf) {
    if (o_out != o_b) std::copy_n(o_b, head_dim, o_out);
    *lse_out = lse_b;
    return;
  }
  // Max trick: the larger side gets weight 1, the other exp(-|lse_a - lse_b|) <= 1.
  const float m = std::max(lse_a, lse_b);
  const float w_a = std::exp(lse_a - m);
  const float w_b = std::exp(lse_b - m);
  const float inv = 1.0f / (w_a + w_b);
  const float c_a = w_a * inv;
  const float c_b = w_b * inv;
  for (size_t d = 0; d < head_dim; ++d) o_out[d] = c_a * o_a[d] + c_b * o_b[d];
  *lse_out = m + std::log(w_a + w_b);
}

}  // namespace

void MergeStateInPlace(float* o_dst, float* lse_dst, const float* o_src, float lse_src,
                       size_t head_dim) {
  MergeRow(o_dst, *lse_dst, o_src, lse_src, o_dst, lse_dst, head_dim);
}

void MergeStates(const float* o_a, const float* lse_a, const float* o_b, const float* lse_b,
                 float* o_out, float* lse_out, size_t rows, size_t head_dim) {
  for (size_t r = 0; r < rows; ++r) {
    MergeRow(o_a + r * head_dim, lse_a[r], o_b + r * head_dim, lse_b[r], o_out + r * head_dim,
             &lse_out[r], head_dim);
  }
}

}  // namespace tandem::cpu_attention
