// tandem::linalg::TopEigenvectors against matrices whose eigensystems are known: diagonal ones,
// hand-checked 2×2 and 3×3, A = QΛQᵀ from a random orthogonal Q with chosen Λ (distinct and
// repeated), and the Gram matrix of keys drawn from a rank-5 subspace.
//
// Tolerances: eigenvalues within 1e-9·‖A‖ (f64 throughout), eigenvectors are f32 so residuals
// ‖Av − λv‖ and orthonormality within ~1e-6.
#include "tandem/linalg/symmetric_eigen.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::linalg {
namespace {

using Matrix = std::vector<double>;  // [n, n] row-major

struct Eigen {
  std::vector<double> values;  // [k]
  std::vector<float> vectors;  // [n, k]
};

Eigen Solve(const Matrix& a, int64_t n, int64_t k) {
  Eigen out{std::vector<double>(k), std::vector<float>(n * k)};
  const absl::Status status =
      TopEigenvectors(a.data(), n, k, out.values.data(), out.vectors.data());
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

// Column r of the [n, k] result, widened.
std::vector<double> Column(const Eigen& e, int64_t n, int64_t k, int64_t r) {
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = e.vectors[i * k + r];
  return v;
}

double Dot(const std::vector<double>& x, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Columns [n, n] (column c is q_c) of a random orthogonal matrix: Gram–Schmidt, applied twice
// per vector so that QᵀQ = I to rounding, of standard normal vectors.
std::vector<std::vector<double>> RandomOrthonormal(int64_t n, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<std::vector<double>> q;
  while (static_cast<int64_t>(q.size()) < count) {
    std::vector<double> v(n);
    for (double& x : v) x = normal(rng);
    for (int pass = 0; pass < 2; ++pass) {
      for (const auto& u : q) {
        const double p = Dot(u, v);
        for (int64_t i = 0; i < n; ++i) v[i] -= p * u[i];
      }
    }
    const double norm = std::sqrt(Dot(v, v));
    for (double& x : v) x /= norm;
    q.push_back(std::move(v));
  }
  return q;
}

// A = Σ_c λ_c q_c q_cᵀ, exactly symmetric.
Matrix Compose(const std::vector<std::vector<double>>& q, const std::vector<double>& lambda) {
  const int64_t n = static_cast<int64_t>(q.size());
  Matrix a(n * n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) {
      double s = 0;
      for (int64_t c = 0; c < n; ++c) s += lambda[c] * q[c][i] * q[c][j];
      a[i * n + j] = s;
      a[j * n + i] = s;
    }
  }
  return a;
}

// The contract's properties of any result: values descending and within 1e-9·‖A‖ of
// `expected` (all n eigenvalues, any order), ‖Av − λv‖ ≤ 1e-6·‖A‖, orthonormal columns, and the
// sign rule (a component of largest magnitude is positive; checked as max v ≥ max −v, which f32
// rounding cannot break).
void ExpectValidDecomposition(const Matrix& a, int64_t n, int64_t k, const Eigen& e,
                              std::vector<double> expected) {
  std::sort(expected.begin(), expected.end(), std::greater<double>());
  const double norm = std::max(std::abs(expected.front()), std::abs(expected.back()));
  for (int64_t r = 0; r < k; ++r) {
    EXPECT_NEAR(e.values[r], expected[r], 1e-9 * norm) << "eigenvalue " << r << " of n = " << n;
    if (r > 0) {
      EXPECT_GE(e.values[r - 1], e.values[r]) << r;
    }
  }
  std::vector<std::vector<double>> columns;
  for (int64_t r = 0; r < k; ++r) columns.push_back(Column(e, n, k, r));
  for (int64_t r = 0; r < k; ++r) {
    const std::vector<double>& v = columns[r];
    double residual = 0;  // ‖Av − λv‖² / ‖A‖², scaled first so 1e300-sized entries do not overflow
    for (int64_t i = 0; i < n; ++i) {
      double av = 0;
      for (int64_t j = 0; j < n; ++j) av += a[i * n + j] * v[j];
      const double scaled = norm > 0 ? (av - e.values[r] * v[i]) / norm : av;
      residual += scaled * scaled;
    }
    EXPECT_LE(std::sqrt(residual), 1e-6) << "vector " << r;
    const double largest = *std::max_element(v.begin(), v.end());
    const double most_negative = *std::min_element(v.begin(), v.end());
    EXPECT_GE(largest, -most_negative) << "sign rule, vector " << r;
    for (int64_t s = 0; s <= r; ++s) {
      EXPECT_NEAR(Dot(columns[s], v), s == r ? 1.0 : 0.0, 1e-6) << "columns " << s << ", " << r;
    }
  }
}

TEST(TopEigenvectors, DiagonalWithNegativeAndRepeatedValues) {
  const std::vector<double> diagonal = {3, -5, 7, 0, -1, 7};
  const int64_t n = 6;
  Matrix a(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) a[i * n + i] = diagonal[i];
  const Eigen e = Solve(a, n, n);
  ExpectValidDecomposition(a, n, n, e, diagonal);
  EXPECT_EQ(e.values, (std::vector<double>{7, 7, 3, 0, -1, -5}));
  // Distinct eigenvalues: exactly the unit vectors, positive. The repeated 7 spans {e_2, e_5}.
  const int64_t unit_of[] = {-1, -1, 0, 3, 4, 1};
  for (int64_t r = 2; r < n; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(e.vectors[i * n + r], i == unit_of[r] ? 1.0f : 0.0f) << r << " " << i;
    }
  }
  for (int64_t r = 0; r < 2; ++r) {
    const std::vector<double> v = Column(e, n, n, r);
    EXPECT_NEAR(v[2] * v[2] + v[5] * v[5], 1.0, 1e-6) << r;
  }
}

TEST(TopEigenvectors, AllNegativeDiagonalTopOne) {
  const Matrix a = {-2, 0, 0, 0, -1, 0, 0, 0, -3};
  const Eigen e = Solve(a, 3, 1);
  EXPECT_EQ(e.values[0], -1);
  EXPECT_EQ(e.vectors, (std::vector<float>{0, 1, 0}));
}

// [[5, 2], [2, 2]]: trace 7, determinant 6, so λ = 6 with (2, 1)/√5 and λ = 1 with (1, −2)/√5,
// whose sign rule flips it to (−1, 2)/√5.
TEST(TopEigenvectors, HandChecked2x2) {
  const Matrix a = {5, 2, 2, 2};
  const Eigen e = Solve(a, 2, 2);
  EXPECT_NEAR(e.values[0], 6, 1e-14);
  EXPECT_NEAR(e.values[1], 1, 1e-14);
  const double s = 1 / std::sqrt(5.0);
  const std::vector<double> expected = {2 * s, -1 * s, 1 * s, 2 * s};  // [n, k]
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(e.vectors[i], expected[i], 1e-7) << i;
}

// A = Σ λ_c u_c u_cᵀ / 49 with the orthogonal columns u = (2,3,6), (3,−6,2), (6,2,−3) (each of
// norm 7) and λ = 3, 1, −2: the integer matrix below is 3·u₁u₁ᵀ + u₂u₂ᵀ − 2·u₃u₃ᵀ. Expected
// vectors u/7 with signs by the rule: (2,3,6)/7, (−3,6,−2)/7, (6,2,−3)/7.
TEST(TopEigenvectors, HandChecked3x3) {
  Matrix a = {-51, -24, 78, -24, 55, 54, 78, 54, 94};
  for (double& x : a) x /= 49;
  const Eigen e = Solve(a, 3, 3);
  EXPECT_NEAR(e.values[0], 3, 1e-14);
  EXPECT_NEAR(e.values[1], 1, 1e-14);
  EXPECT_NEAR(e.values[2], -2, 1e-14);
  const double expected[3][3] = {{2, 3, 6}, {-3, 6, -2}, {6, 2, -3}};  // [r][i]
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(e.vectors[i * 3 + r], expected[r][i] / 7, 1e-7) << r << " " << i;
    }
  }
}

TEST(TopEigenvectors, OneByOne) {
  const Matrix a = {-3.5};
  const Eigen e = Solve(a, 1, 1);
  EXPECT_EQ(e.values[0], -3.5);
  EXPECT_EQ(e.vectors[0], 1.0f);
}

TEST(TopEigenvectors, ZeroMatrixGivesUnitVectors) {
  const int64_t n = 4;
  const Matrix a(n * n, 0.0);
  const Eigen e = Solve(a, n, n);
  for (int64_t r = 0; r < n; ++r) {
    EXPECT_EQ(e.values[r], 0);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(e.vectors[i * n + r], i == r ? 1.0f : 0.0f);
  }
}

class RandomSpectrum : public ::testing::TestWithParam<int64_t> {};

// Distinct eigenvalues 10 … −10 (gaps 20/n): each vector is ±q_c of its eigenvalue, and with
// k = n the columns reconstruct A.
TEST_P(RandomSpectrum, DistinctEigenvalues) {
  const int64_t n = GetParam();
  const auto q = RandomOrthonormal(n, n, 1234 + n);
  std::vector<double> lambda(n);
  for (int64_t c = 0; c < n; ++c) lambda[c] = 10.0 - 20.0 * c / n;
  std::shuffle(lambda.begin(), lambda.end(), std::mt19937_64(99));
  const Matrix a = Compose(q, lambda);
  for (const int64_t k : {std::max<int64_t>(n / 2, 1), n}) {
    SCOPED_TRACE(k);
    const Eigen e = Solve(a, n, k);
    ExpectValidDecomposition(a, n, k, e, lambda);
    for (int64_t r = 0; r < k; ++r) {
      int64_t nearest = 0;  // the eigenvalue's index in lambda (values need not be bit-equal)
      for (int64_t t = 1; t < n; ++t) {
        if (std::abs(lambda[t] - e.values[r]) < std::abs(lambda[nearest] - e.values[r])) {
          nearest = t;
        }
      }
      EXPECT_NEAR(std::abs(Dot(Column(e, n, k, r), q[nearest])), 1.0, 1e-6) << r;
    }
    if (k == n) {
      double worst = 0;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t r = 0; r < n; ++r) {
            s += e.values[r] * e.vectors[i * n + r] * static_cast<double>(e.vectors[j * n + r]);
          }
          worst = std::max(worst, std::abs(s - a[i * n + j]));
        }
      }
      EXPECT_LE(worst, 1e-5 * 10) << "‖VΛVᵀ − A‖_max";
    }
  }
}

// Eigenvalues in groups of 4 equal ones (8, …, −8): any orthonormal basis of each eigenspace is
// right, so each vector must lie in the span of its group's q_c.
TEST_P(RandomSpectrum, RepeatedEigenvalues) {
  const int64_t n = GetParam();
  const auto q = RandomOrthonormal(n, n, 777 + n);
  const int64_t groups = (n + 3) / 4;
  std::vector<double> lambda(n);
  for (int64_t c = 0; c < n; ++c)
    lambda[c] = groups == 1 ? 8.0 : 8.0 - 16.0 * (c / 4) / (groups - 1);
  const Matrix a = Compose(q, lambda);
  const int64_t k = std::max<int64_t>(n / 2, 1);
  const Eigen e = Solve(a, n, k);
  ExpectValidDecomposition(a, n, k, e, lambda);
  for (int64_t r = 0; r < k; ++r) {
    const std::vector<double> v = Column(e, n, k, r);
    double in_eigenspace = 0;  // ‖P v‖², P the projector on the group of the nearest λ
    int64_t nearest = 0;
    for (int64_t t = 1; t < n; ++t) {
      if (std::abs(lambda[t] - e.values[r]) < std::abs(lambda[nearest] - e.values[r])) nearest = t;
    }
    for (int64_t c = 0; c < n; ++c) {
      if (lambda[c] == lambda[nearest]) in_eigenspace += Dot(q[c], v) * Dot(q[c], v);
    }
    EXPECT_NEAR(in_eigenspace, 1.0, 1e-6) << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, RandomSpectrum, ::testing::Values(2, 3, 5, 17, 64, 128, 256));

// Eigenvalues scale with the matrix and vectors do not, far from 1 in both directions (the
// implementation scales by a power of two internally).
TEST(TopEigenvectors, ExtremeScales) {
  const int64_t n = 16;
  const auto q = RandomOrthonormal(n, n, 5);
  std::vector<double> lambda(n);
  for (int64_t c = 0; c < n; ++c) lambda[c] = 1.0 + c;
  const Eigen reference = Solve(Compose(q, lambda), n, n / 2);
  for (const double scale : {1e-300, 1e-150, 1e150, 1e300}) {
    std::vector<double> scaled = lambda;
    for (double& x : scaled) x *= scale;
    const Matrix a = Compose(q, scaled);
    const Eigen e = Solve(a, n, n / 2);
    ExpectValidDecomposition(a, n, n / 2, e, scaled);
    for (int64_t i = 0; i < n * n / 2; ++i) {
      EXPECT_NEAR(e.vectors[i], reference.vectors[i], 1e-6) << scale << " " << i;
    }
  }
}

// The use case: G = KᵀK for 4096 keys of dimension 128 lying in a rank-5 subspace (coordinate
// scales 8, 6, 4, 3, 2) plus noise of 1e-4. The top 5 vectors must span that subspace: each
// basis vector b keeps ‖b − V₅V₅ᵀb‖ ≤ 1e-5 (the noise tilts it by ~1e-6). The other 59 vectors
// sit in a nearly degenerate noise cluster (~4e-5) and must still be orthonormal.
TEST(TopEigenvectors, GramOfLowRankKeysFindsTheSubspace) {
  const int64_t n = 128;
  const int64_t tokens = 4096;
  const int64_t rank = 5;
  const double scales[rank] = {8, 6, 4, 3, 2};
  const auto basis = RandomOrthonormal(n, rank, 42);
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal;
  std::vector<double> keys(tokens * n);  // [tokens, n]
  for (int64_t t = 0; t < tokens; ++t) {
    double* key = keys.data() + t * n;
    for (int64_t i = 0; i < n; ++i) key[i] = 1e-4 * normal(rng);
    for (int64_t c = 0; c < rank; ++c) {
      const double coefficient = scales[c] * normal(rng);
      for (int64_t i = 0; i < n; ++i) key[i] += coefficient * basis[c][i];
    }
  }
  Matrix g(n * n, 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    const double* key = keys.data() + t * n;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = i; j < n; ++j) g[i * n + j] += key[i] * key[j];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) g[i * n + j] = g[j * n + i];
  }

  // All n eigenvalues: their sum is the trace and their squares sum to ‖G‖_F².
  const Eigen all = Solve(g, n, n);
  double trace = 0;
  double frobenius2 = 0;
  for (int64_t i = 0; i < n; ++i) trace += g[i * n + i];
  for (const double x : g) frobenius2 += x * x;
  double sum = 0;
  double sum2 = 0;
  for (const double v : all.values) {
    sum += v;
    sum2 += v * v;
  }
  EXPECT_NEAR(sum, trace, 1e-9 * trace);
  EXPECT_NEAR(sum2, frobenius2, 1e-9 * frobenius2);

  const int64_t k = n / 2;
  const Eigen e = Solve(g, n, k);
  ExpectValidDecomposition(g, n, k, e, all.values);  // lower n − k entries of the reference unused
  EXPECT_GT(e.values[rank - 1], 1e6 * e.values[rank]) << "the noise eigenvalues stand apart";
  for (int64_t c = 0; c < rank; ++c) {
    std::vector<double> residual = basis[c];
    for (int64_t r = 0; r < rank; ++r) {
      const std::vector<double> v = Column(e, n, k, r);
      const double p = Dot(v, basis[c]);
      for (int64_t i = 0; i < n; ++i) residual[i] -= p * v[i];
    }
    EXPECT_LE(std::sqrt(Dot(residual, residual)), 1e-5) << "basis vector " << c;
  }
}

TEST(TopEigenvectors, ValuesMayBeNull) {
  const int64_t n = 9;
  const auto q = RandomOrthonormal(n, n, 3);
  std::vector<double> lambda(n);
  for (int64_t c = 0; c < n; ++c) lambda[c] = c * c - 20.0;
  const Matrix a = Compose(q, lambda);
  const Eigen with_values = Solve(a, n, 4);
  std::vector<float> vectors(n * 4);
  ASSERT_TRUE(TopEigenvectors(a.data(), n, 4, nullptr, vectors.data()).ok());
  EXPECT_EQ(vectors, with_values.vectors);
}

// Asymmetry up to 1e-6·max|a| is rounding and accepted; just past it is refused.
TEST(TopEigenvectors, SymmetryTolerance) {
  Matrix a = {4, 1, 0, 1, 3, 2, 0, 2, -4};
  std::vector<double> values(3);
  std::vector<float> vectors(9);
  a[1 * 3 + 2] = 2 + 0.9e-6 * 4;
  EXPECT_TRUE(TopEigenvectors(a.data(), 3, 3, values.data(), vectors.data()).ok());
  a[1 * 3 + 2] = 2 + 1.1e-6 * 4;
  EXPECT_EQ(TopEigenvectors(a.data(), 3, 3, values.data(), vectors.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TopEigenvectors, InvalidArguments) {
  const Matrix a = {2, 1, 1, 2};
  std::vector<double> values(4, -7);
  std::vector<float> vectors(8, -7);
  auto code = [&](const double* m, int64_t n, int64_t k, float* out) {
    const absl::Status s = TopEigenvectors(m, n, k, values.data(), out);
    EXPECT_FALSE(s.message().empty());
    return s.code();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(a.data(), 0, 1, vectors.data()), kInvalid) << "n = 0";
  EXPECT_EQ(code(a.data(), -2, 1, vectors.data()), kInvalid) << "n < 0";
  EXPECT_EQ(code(a.data(), 8193, 1, vectors.data()), kInvalid) << "n above the cap";
  EXPECT_EQ(code(a.data(), 2, 0, vectors.data()), kInvalid) << "k = 0";
  EXPECT_EQ(code(a.data(), 2, -1, vectors.data()), kInvalid) << "k < 0";
  EXPECT_EQ(code(a.data(), 2, 3, vectors.data()), kInvalid) << "k > n";
  EXPECT_EQ(code(nullptr, 2, 1, vectors.data()), kInvalid) << "null a";
  EXPECT_EQ(code(a.data(), 2, 1, nullptr), kInvalid) << "null vectors";
  for (const double bad :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity()}) {
    Matrix m = a;
    m[3] = bad;
    EXPECT_EQ(code(m.data(), 2, 1, vectors.data()), kInvalid) << bad << " on the diagonal";
    m = a;
    m[1] = m[2] = bad;  // symmetric but not finite
    EXPECT_EQ(code(m.data(), 2, 1, vectors.data()), kInvalid) << bad << " off the diagonal";
  }
  Matrix asymmetric = a;
  asymmetric[1] = 1.5;
  EXPECT_EQ(code(asymmetric.data(), 2, 2, vectors.data()), kInvalid) << "not symmetric";
  const absl::Status s = TopEigenvectors(asymmetric.data(), 2, 2, values.data(), vectors.data());
  EXPECT_NE(s.message().find("not symmetric"), std::string::npos) << s;
  // Nothing was written by any refused call.
  EXPECT_EQ(values, std::vector<double>(4, -7));
  EXPECT_EQ(vectors, std::vector<float>(8, -7));
}

// Not a pass/fail criterion: prints the time of one call at the production shape.
TEST(TopEigenvectors, TimeAtHeadDim128) {
  for (const int64_t n : {64, 128, 256}) {
    const auto q = RandomOrthonormal(n, n, 11);
    std::vector<double> lambda(n);
    for (int64_t c = 0; c < n; ++c) lambda[c] = std::exp(-0.1 * c);  // a key-like decaying spectrum
    const Matrix a = Compose(q, lambda);
    const int64_t k = n / 2;
    std::vector<double> values(k);
    std::vector<float> vectors(n * k);
    const int reps = n <= 128 ? 50 : 10;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) {
      ASSERT_TRUE(TopEigenvectors(a.data(), n, k, values.data(), vectors.data()).ok());
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count() /
        reps;
    std::printf("TopEigenvectors n = %lld, k = %lld: %.3f ms per call (mean of %d)\n",
                static_cast<long long>(n), static_cast<long long>(k), ms, reps);
    RecordProperty("ms_n" + std::to_string(n), std::to_string(ms));
  }
}

}  // namespace
}  // namespace tandem::linalg
