// Hand-written AVX-512 and AVX2 kernels of the int8 KV scan (PagedAttention over int8 rows, and
// through it SparseAttention's few-row int8 case); private to cpu_attention.
//
// An int8 row is D codes then an f32 scale (kv_store/int8_rows.h). The per-row scale factors
// out of both products, so the codes are widened to f32 in registers (exact: |code| <= 127)
// and never written back:
//   s_rc = k_scale_c * (q_r · codes(k_c)),   acc_r += Σ_c (p_rc * v_scale_c) · codes(v_c)
// (the caller folds v_scale into p). The portable path of paged_attention.cc widens each chunk
// into f32 tiles first (a store and a reload per code, and one horizontal sum per score). Node
// Attend, one thread of the 2-core EPYC, 8 kv heads x 4096 entries in cache, G 4: 0.50 ms with
// the AVX-512 kernels, 0.78 ms AVX2, 0.99 ms portable; 0.83 ms for bf16 KV (oneDNN matmuls).
//
// The library is built without -march: the kernels carry their own target attribute and run
// only where GetInt8ScanKernels() picks them.
#pragma once

#include <cstddef>

namespace tandem::cpu_attention::internal {

// One instruction set's kernels.
struct Int8ScanKernels {
  // s[r * ld + c] = k_scale[c] * (q[r] · codes(k[c])) for r < rows, c < n. q: [rows, d] f32;
  // k[c]: the start of an int8 row of d codes (d a multiple of 8, <= 256).
  void (*scores)(const float* q, size_t rows, size_t d, const std::byte* const* k, size_t n,
                 const float* k_scale, float* s, size_t ld);
  // acc[r * d + x] += Σ_c p[r * ld + c] * codes(v[c])[x] for r < rows, x < d, c < n.
  void (*accumulate)(const float* p, size_t ld, size_t rows, const std::byte* const* v, size_t n,
                     size_t d, float* acc);
  const char* name;  // "avx512" or "avx2"
};

// The kernels this CPU runs: AVX-512 (F/BW/DQ/VL), else AVX2 + FMA, else nullptr (the callers'
// portable path). The environment variable TANDEM_INT8_KERNELS=avx2 or =portable forces a
// lesser one (tests run every variant). Thread-safe; reads the variable at every call.
const Int8ScanKernels* GetInt8ScanKernels();

}  // namespace tandem::cpu_attention::internal
