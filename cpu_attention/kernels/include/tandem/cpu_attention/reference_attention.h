// Naive double-precision attention: the reference every attention kernel and service test
// compares against, and the CLI's self-check (FlashInfer cpu_reference.h). Numerics contract:
// scores = scale * q·k, natural-log LSE; an empty key set gives O = 0 and LSE = -inf.
// O(T * G * n * D) time: for checks, never for serving.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace tandem::cpu_attention {

// q: [T, G, D] contiguous f32 (row r = t * G + j); k, v: [n, D] f32 holding exactly the values
// the kernel sees (already rounded to the KV dtype). Outputs o: [T*G, D], lse: [T*G], in double.
inline void ReferenceAttention(const float* q, const float* k, const float* v, size_t n, size_t T,
                               size_t G, size_t D, double scale, std::vector<double>* o,
                               std::vector<double>* lse) {
  const size_t rows = T * G;
  o->assign(rows * D, 0.0);
  lse->assign(rows, -std::numeric_limits<double>::infinity());
  if (n == 0) return;
  std::vector<double> s(n);
  for (size_t r = 0; r < rows; ++r) {
    const float* qr = q + r * D;
    double m = -std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < n; ++i) {
      double dot = 0.0;
      for (size_t d = 0; d < D; ++d) dot += static_cast<double>(qr[d]) * k[i * D + d];
      s[i] = scale * dot;
      m = std::max(m, s[i]);
    }
    double sum = 0.0;
    double* out = o->data() + r * D;
    for (size_t i = 0; i < n; ++i) {
      const double p = std::exp(s[i] - m);
      sum += p;
      for (size_t d = 0; d < D; ++d) out[d] += p * v[i * D + d];
    }
    for (size_t d = 0; d < D; ++d) out[d] /= sum;
    (*lse)[r] = m + std::log(sum);
  }
}

// max |x - ref| / max(max |ref|, tiny): the error relative to the reference's scale. x and ref
// have `count` elements (x may be float or double). A NaN anywhere gives +inf.
template <typename X>
double RelativeError(const X* x, const double* ref, size_t count, double tiny = 1e-30) {
  double max_err = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < count; ++i) {
    const double err = std::abs(static_cast<double>(x[i]) - ref[i]);
    if (std::isnan(err)) return std::numeric_limits<double>::infinity();
    max_err = std::max(max_err, err);
    max_ref = std::max(max_ref, std::abs(ref[i]));
  }
  return max_err / std::max(max_ref, tiny);
}

// As above over ref.size() elements of x; mismatched sizes give +inf.
template <typename X>
double RelativeError(const std::vector<X>& x, const std::vector<double>& ref,
                     double tiny = 1e-30) {
  if (x.size() != ref.size()) return std::numeric_limits<double>::infinity();
  return RelativeError(x.data(), ref.data(), ref.size(), tiny);
}

}  // namespace tandem::cpu_attention
