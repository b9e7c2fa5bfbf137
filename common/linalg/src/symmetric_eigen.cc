// Symmetric eigendecomposition (tandem/linalg/symmetric_eigen.h) in three steps, all in f64:
//   1. Householder reflections H_0 … H_{n-3} reduce A to tridiagonal T = Z A Zᵀ, Z = H_{n-3}⋯H_0.
//   2. Implicit QL sweeps with Wilkinson shifts diagonalise T by plane rotations P, each applied
//      as T ← P T Pᵀ and Z ← P Z, so A = Zᵀ T Z holds throughout and ends with T diagonal: row r
//      of Z is then the unit eigenvector of d[r].
//   3. Sort descending, fix signs, write the top k as f32 columns.
// Z is kept with eigenvectors as rows so that every rotation and reflection runs over contiguous
// memory (the inner loops vectorise).
#include "tandem/linalg/symmetric_eigen.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem::linalg {
namespace {

// The O(n³) loops (reflections, rotations of Z's rows) compiled for AVX-512, AVX2 and baseline
// x86-64, chosen at load time: ~1.4× faster at n = 128 on an AVX-512 host. The results may
// differ in the last bits between CPUs (FMA contraction), within the method's accuracy.
#if defined(__x86_64__) && defined(__GNUC__)
#define TANDEM_EIGEN_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TANDEM_EIGEN_CLONES
#endif

// Larger n is refused: the method is O(n³) time and 2n² doubles of scratch, meant for
// head_dim-sized matrices; the cap also keeps n·n far from int64 overflow.
constexpr int64_t kMaxN = 8192;

// QL sweeps allowed per eigenvalue. Wilkinson shifts converge cubically (1-3 sweeps on almost
// every matrix), so reaching this means the input was pathological, not merely ill-conditioned.
constexpr int kMaxSweeps = 60;

// Checks finiteness and symmetry, and writes w = (a + aᵀ)/2 · 2^-exponent, scaled by a power of
// two (exact) so that max|w| lies in [0.5, 1): the squares summed by the reflections can neither
// overflow nor underflow. exponent = 0 for the zero matrix.
absl::Status ScaledSymmetricCopy(const double* a, int64_t n, std::vector<double>& w,
                                 int& exponent) {
  double max_abs = 0;
  for (int64_t i = 0; i < n * n; ++i) {
    if (!std::isfinite(a[i])) {
      return absl::InvalidArgumentError(absl::StrCat("TopEigenvectors: entry (", i / n, ", ", i % n,
                                                     ") of the ", n, "x", n, " matrix is ", a[i],
                                                     "; every entry must be finite"));
    }
    max_abs = std::max(max_abs, std::abs(a[i]));
  }
  const double tolerance = 1e-6 * max_abs;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i + 1; j < n; ++j) {
      const double upper = a[i * n + j];
      const double lower = a[j * n + i];
      if (std::abs(upper - lower) > tolerance) {
        return absl::InvalidArgumentError(
            absl::StrCat("TopEigenvectors: the ", n, "x", n, " matrix is not symmetric: entry (", i,
                         ", ", j, ") is ", upper, " but (", j, ", ", i, ") is ", lower,
                         ", more than 1e-6·max|a| = ", tolerance, " apart"));
      }
    }
  }
  exponent = 0;
  if (max_abs > 0) std::frexp(max_abs, &exponent);  // max_abs = f·2^exponent, f in [0.5, 1)
  w.resize(n * n);
  // A product by 2^-exponent is exact like ldexp and far cheaper per entry (n² of them); ldexp
  // only where that factor itself is not a finite double (max|a| near the subnormal range).
  const double factor = std::ldexp(1.0, -exponent);
  const bool multiply = std::isfinite(factor) && factor > 0;
  auto scaled = [&](double x) { return multiply ? x * factor : std::ldexp(x, -exponent); };
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) {
      // Scale before averaging: a + aᵀ may overflow near DBL_MAX.
      const double v = 0.5 * (scaled(a[i * n + j]) + scaled(a[j * n + i]));
      w[i * n + j] = v;
      w[j * n + i] = v;
    }
  }
  return absl::OkStatus();
}

// Reduces the symmetric w [n, n] (destroyed: row j ends holding reflector j) to the tridiagonal
// T = Z W Zᵀ: d [n] its diagonal, e [n] its off-diagonal (e[i] couples i and i+1, e[n-1] = 0),
// z [n, n] the orthogonal Z, row-major.
//
// Step j maps x = w[j+1:, j] to alpha·e_1 with H_j = I − beta v vᵀ, v = x − alpha·e_1 and
// alpha = −sign(x_0)·‖x‖ (no cancellation in v_0), then applies H_j on both sides of the
// trailing block B = w[j+1:, j+1:] as the symmetric rank-2 update B − v qᵀ − q vᵀ with
// p = beta·B v, q = p − (beta/2)(pᵀv)·v. Column j is read as row j (w is symmetric).
TANDEM_EIGEN_CLONES void Tridiagonalize(int64_t n, double* w, double* d, double* e, double* z) {
  std::vector<double> beta(n, 0.0);
  std::vector<double> q(n);
  for (int64_t j = 0; j + 2 < n; ++j) {
    double* v = w + j * n;  // v[j+1 .. n-1]: first x, then the reflector
    d[j] = v[j];
    double tail = 0;  // ‖x[1:]‖²
    for (int64_t i = j + 2; i < n; ++i) tail += v[i] * v[i];
    const double x0 = v[j + 1];
    if (tail == 0) {  // already tridiagonal in this column: H_j = I
      e[j] = x0;
      continue;
    }
    const double norm = std::sqrt(x0 * x0 + tail);
    const double alpha = x0 >= 0 ? -norm : norm;
    v[j + 1] = x0 - alpha;
    const double b = 1.0 / (norm * (norm + std::abs(x0)));  // 2 / vᵀv
    beta[j] = b;
    e[j] = alpha;
    double pv = 0;
    for (int64_t i = j + 1; i < n; ++i) {
      const double* row = w + i * n;
      double s = 0;
      for (int64_t l = j + 1; l < n; ++l) s += row[l] * v[l];
      q[i] = b * s;
      pv += q[i] * v[i];
    }
    const double half = 0.5 * b * pv;
    for (int64_t i = j + 1; i < n; ++i) q[i] -= half * v[i];
    // Both products per entry, added in the same order for (i, l) and (l, i): B stays exactly
    // symmetric, so reading column j+1 as row j+1 next step is exact.
    for (int64_t i = j + 1; i < n; ++i) {
      double* row = w + i * n;
      const double vi = v[i];
      const double qi = q[i];
      for (int64_t l = j + 1; l < n; ++l) row[l] -= vi * q[l] + qi * v[l];
    }
  }
  if (n >= 2) {
    d[n - 2] = w[(n - 2) * n + (n - 2)];
    e[n - 2] = w[(n - 2) * n + (n - 1)];
  }
  d[n - 1] = w[(n - 1) * n + (n - 1)];
  e[n - 1] = 0;

  // Z = H_{n-3}⋯H_0, built right to left from I: Z ← Z H_j for j descending. Before step j, Z is
  // I outside its trailing block [j+2:, j+2:], so H_j (acting on columns j+1:) changes only
  // rows j+1: — half the work of a dense product.
  std::fill(z, z + n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) z[i * n + i] = 1;
  for (int64_t j = n - 3; j >= 0; --j) {
    if (beta[j] == 0) continue;
    const double* v = w + j * n;
    for (int64_t i = j + 1; i < n; ++i) {
      double* row = z + i * n;
      double s = 0;
      for (int64_t l = j + 1; l < n; ++l) s += row[l] * v[l];
      s *= beta[j];
      for (int64_t l = j + 1; l < n; ++l) row[l] -= s * v[l];
    }
  }
}

// One implicit QL sweep on the unreduced block [lo, hi] of the tridiagonal (d, e), hi > lo.
// The shift mu is the eigenvalue of the leading 2×2 nearer d[lo] (Wilkinson). The first rotation,
// in plane (hi-1, hi), is the one that a QL factorisation of T − mu·I would start with; it leaves
// a bulge at (k-1, k+1) that each following rotation in plane (k, k+1) chases up to the top.
// Rotation convention: rows k, k+1 become (c·r_k − s·r_{k+1}, s·r_k + c·r_{k+1}), with
// c = x/r, s = y/r, chosen to zero the entry y above x in one column.
//   z: [n, n], rows k and k+1 rotated with T
TANDEM_EIGEN_CLONES void QlSweep(int64_t lo, int64_t hi, int64_t n, double* d, double* e, double* z) {
  const double delta = 0.5 * (d[lo + 1] - d[lo]);
  const double h = std::hypot(delta, e[lo]);  // > 0: e[lo] is not negligible
  const double mu = d[lo] - e[lo] * (e[lo] / (delta + std::copysign(h, delta)));

  double y = e[hi - 1];  // the entry to zero: first of T − mu·I, then the bulge
  double x = d[hi] - mu;
  for (int64_t k = hi - 1; k >= lo; --k) {
    const double r = std::hypot(x, y);
    const double c = r == 0 ? 1.0 : x / r;
    const double s = r == 0 ? 0.0 : y / r;
    if (k + 1 < hi) e[k + 1] = r;  // the bulge is gone, its column's entry below is r

    // T ← P T Pᵀ on the 2×2 block of rows/columns k, k+1.
    const double a = d[k];
    const double b = e[k];
    const double f = d[k + 1];
    const double cs = c * s;
    d[k] = c * c * a - 2 * cs * b + s * s * f;
    d[k + 1] = s * s * a + 2 * cs * b + c * c * f;
    e[k] = cs * (a - f) + (c * c - s * s) * b;
    if (k > lo) {  // the column above: T[k-1][k] scales by c, the new bulge is T[k-1][k+1]
      y = s * e[k - 1];
      e[k - 1] *= c;
      x = e[k];
    }

    double* row_k = z + k * n;
    double* row_k1 = row_k + n;
    for (int64_t l = 0; l < n; ++l) {
      const double zk = row_k[l];
      const double zk1 = row_k1[l];
      row_k[l] = c * zk - s * zk1;
      row_k1[l] = s * zk + c * zk1;
    }
  }
}

// Diagonalises the tridiagonal (d, e) in place, rotating the rows of z [n, n] along. Eigenvalue
// lo is final once e[lo] is negligible against its neighbours (relative test: small eigenvalues
// keep their relative accuracy; DBL_MIN guards the all-tiny case); until then the block from lo
// to the first negligible coupling below it is swept.
absl::Status DiagonalizeTridiagonal(int64_t n, double* d, double* e, double* z) {
  constexpr double kEps = std::numeric_limits<double>::epsilon();
  constexpr double kTiny = std::numeric_limits<double>::min();
  for (int64_t lo = 0; lo < n; ++lo) {
    for (int sweep = 0;; ++sweep) {
      int64_t hi = lo;
      while (hi + 1 < n) {
        const double off = std::abs(e[hi]);
        if (off <= kEps * (std::abs(d[hi]) + std::abs(d[hi + 1])) || off <= kTiny) break;
        ++hi;
      }
      if (hi == lo) break;
      if (sweep == kMaxSweeps) {
        return absl::InternalError(absl::StrCat(
            "TopEigenvectors: the QL iteration did not converge for eigenvalue ", lo, " of the ", n,
            "x", n, " matrix after ", kMaxSweeps,
            " sweeps; the matrix is pathological (check it for extreme dynamic range)"));
      }
      QlSweep(lo, hi, n, d, e, z);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TopEigenvectors(const double* a, int64_t n, int64_t k, double* values,
                             float* vectors) {
  if (a == nullptr || vectors == nullptr) {
    return absl::InvalidArgumentError(
        "TopEigenvectors: the matrix and the output vectors must not be null");
  }
  if (n < 1 || n > kMaxN) {
    return absl::InvalidArgumentError(
        absl::StrCat("TopEigenvectors: n = ", n, " is outside [1, ", kMaxN, "]"));
  }
  if (k < 1 || k > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("TopEigenvectors: k = ", k, " is outside [1, n = ", n, "]"));
  }
  std::vector<double> w;
  int exponent = 0;
  if (absl::Status s = ScaledSymmetricCopy(a, n, w, exponent); !s.ok()) return s;

  std::vector<double> d(n);
  std::vector<double> e(n);
  std::vector<double> z(n * n);
  Tridiagonalize(n, w.data(), d.data(), e.data(), z.data());
  if (absl::Status s = DiagonalizeTridiagonal(n, d.data(), e.data(), z.data()); !s.ok()) return s;

  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&d](int64_t p, int64_t q) { return d[p] > d[q]; });
  for (int64_t r = 0; r < k; ++r) {
    const double* row = z.data() + order[r] * n;
    int64_t largest = 0;  // the first component of largest magnitude
    for (int64_t i = 1; i < n; ++i) {
      if (std::abs(row[i]) > std::abs(row[largest])) largest = i;
    }
    const double sign = row[largest] < 0 ? -1.0 : 1.0;
    for (int64_t i = 0; i < n; ++i) vectors[i * k + r] = static_cast<float>(sign * row[i]);
    if (values != nullptr) values[r] = std::ldexp(d[order[r]], exponent);
  }
  return absl::OkStatus();
}

}  // namespace tandem::linalg
