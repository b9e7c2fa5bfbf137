// Host-side eigendecomposition of a small dense symmetric matrix: the top-k eigenvectors that
// give each kv head's low-rank key basis (the Gram matrix KᵀK of its keys, n = head_dim).
//
// Method: Householder reduction to tridiagonal form accumulating the orthogonal transform, then
// implicit QL sweeps with Wilkinson shifts on the tridiagonal, all in f64; O(n³), a few ms at
// n = 128 on one core. Thread-safe (no shared state); allocates O(n²) scratch per call.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace tandem::linalg {

// The k eigenvectors of the k largest eigenvalues of the symmetric n×n matrix `a` (row-major,
// f64; a[i*n+j] == a[j*n+i] within rounding). values[r] (optional, may be null) gets the r-th
// largest eigenvalue (descending); vectors[i*k + r] gets component i of its unit eigenvector
// (f32, [n, k] row-major: column r is eigenvector r). Each vector's sign is fixed so that its
// component of largest magnitude is positive (deterministic output).
// INVALID_ARGUMENT: n < 1, k outside [1, n], null a/vectors, a non-finite entry, or an entry
// pair differing by more than 1e-6·max|a| (not symmetric). INTERNAL if the iteration fails to
// converge (with n and the eigenvalue index in the message). Also INVALID_ARGUMENT: n > 8192
// (the O(n³) method with 2n² doubles of scratch is meant for head_dim-sized matrices).
//
// Equal eigenvalues keep the order of their tridiagonal index (stable sort), and any orthonormal
// basis of a repeated eigenvalue's eigenspace is a valid answer. Nothing is written on failure.
//   a:       [n, n]
//   values:  [k] or null
//   vectors: [n, k]
absl::Status TopEigenvectors(const double* a, int64_t n, int64_t k, double* values, float* vectors);

}  // namespace tandem::linalg
