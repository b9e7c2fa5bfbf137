// Hand-written AVX-512 kernels of the int8 KV scan (PagedAttention over int8 rows, and through
// it SparseAttention's few-row int8 case); private to cpu_attention.
//
// An int8 row is D codes then an f32 scale (kv_store/int8_rows.h). The per-row scale factors
// out of both products, so the codes are widened to f32 in registers (exact: |code| <= 127)
// and never written back:
//   s_rc = k_scale_c * (q_r · codes(k_c)),   acc_r += Σ_c (p_rc * v_scale_c) · codes(v_c)
// (the caller folds v_scale into p). The portable path of paged_attention.cc widens each chunk
// into f32 tiles first (a store and a reload per code, and one horizontal sum per score). Node
// Attend, one thread of the 2-core EPYC, 8 kv heads x 4096 entries in cache, G 4: 0.49 ms with
// these kernels, 0.97 ms portable, 0.84 ms for bf16 KV (oneDNN matmuls).
//
// The library is built without -march: these functions carry their own target attribute and
// run only where Int8ScanAvx512() says so.
#pragma once

#include <cstddef>

namespace tandem::cpu_attention::internal {

// True when this CPU has AVX-512 F/BW/DQ/VL and the environment variable TANDEM_INT8_KERNELS is
// not "portable" (tests force the portable path with it). Read at every call (one getenv).
bool Int8ScanAvx512();

// s[r * ld + c] = k_scale[c] * (q[r] · codes(k[c])) for r < rows, c < n. q: [rows, d] f32;
// k[c]: the start of an int8 row of d codes (d a multiple of 8, <= 256).
void Int8ScoresAvx512(const float* q, size_t rows, size_t d, const std::byte* const* k, size_t n,
                      const float* k_scale, float* s, size_t ld);

// acc[r * d + x] += Σ_c p[r * ld + c] * codes(v[c])[x] for r < rows, x < d, c < n.
void Int8AccumulateAvx512(const float* p, size_t ld, size_t rows, const std::byte* const* v,
                          size_t n, size_t d, float* acc);

}  // namespace tandem::cpu_attention::internal
