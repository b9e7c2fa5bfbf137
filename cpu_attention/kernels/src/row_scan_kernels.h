// Hand-written AVX-512 and AVX2 kernels of the KV row scan (PagedAttention over bf16 or int8
// rows, and through it SparseAttention's scan cases: int8 with few query rows, bf16 where oneDNN
// has no bf16 matmul); private to cpu_attention.
//
// The stored rows are widened to f32 in registers and never written back:
//   bf16: the bits shifted into the high half of an f32 (exact);
//   int8: a row is D codes then an f32 scale (kv_store/int8_rows.h); the per-row scale factors
//         out of both products (exact: |code| <= 127):
//         s_rc = k_scale_c * (q_r · codes(k_c)),   acc_r += Σ_c (p_rc * v_scale_c) · codes(v_c)
//         (the caller folds v_scale into p).
// The portable path of paged_attention.cc instead widens each chunk into f32 tiles (int8) or
// uses GCC vector types (bf16). Node Attend, one thread of the 2-core EPYC, 8 kv heads x 4096
// entries in cache, G 4, int8: 0.50 ms with the AVX-512 kernels, 0.78 ms AVX2, 0.99 ms portable.
//
// The library is built without -march: the kernels carry their own target attribute and run
// only where the getters pick them.
#pragma once

#include <cstddef>

namespace tandem::cpu_attention::internal {

// Rows a scan will read later, prefetched by a kernel spread over its keys: rows[0..n), each
// `bytes` long. (The scan used to issue a 64-key chunk's K and V prefetches in one burst before
// the kernels, 512 at d 128; BENCHMARKS "Dispatch and prefetch of the paged scan" measures both.)
struct RowPrefetch {
  const std::byte* const* rows = nullptr;
  size_t n = 0;
  size_t bytes = 0;
};

// One instruction set's kernels for one row type.
struct RowScanKernels {
  // s[r * ld + c] = k_scale[c] * (q[r] · row(k[c])) for r < rows, c < n (k_scale null: 1).
  // q: [rows, d] f32; k[c]: the start of a stored row of d elements (d a multiple of 8, <= 256).
  // Prefetches the rows of `ahead` along the way (share i of n keys: rows [i·a/n, (i+1)·a/n)).
  void (*scores)(const float* q, size_t rows, size_t d, const std::byte* const* k, size_t n,
                 const float* k_scale, float* s, size_t ld, const RowPrefetch& ahead);
  // acc[r * d + x] += Σ_c p[r * ld + c] * row(v[c])[x] for r < rows, x < d, c < n.
  void (*accumulate)(const float* p, size_t ld, size_t rows, const std::byte* const* v, size_t n,
                     size_t d, float* acc);
  // The order of the d floats of a q row (scores) and an acc row (accumulate) when it is not the
  // natural one: to_kernel_order rearranges `rows` rows in place before a scan's first call,
  // from_kernel_order puts acc rows back after its last. Null: the natural order. (AVX2 bf16:
  // the split order, each 16-float block as its 8 even then its 8 odd elements.)
  void (*to_kernel_order)(float* x, size_t rows, size_t d);
  void (*from_kernel_order)(float* x, size_t rows, size_t d);
  const char* name;  // "avx512" or "avx2"
};

// The kernels of ActiveCpuIsa() (tandem/cpu_isa: TANDEM_CPU_ISA=avx2 or =portable forces a
// lesser set; tests run every variant) for int8 rows and for bf16 rows: AVX-512 (F/BW/DQ/VL),
// AVX2 + FMA, or nullptr (the callers' portable path). Thread-safe; read the variable at every
// call.
const RowScanKernels* GetInt8ScanKernels();
const RowScanKernels* GetBf16ScanKernels();

}  // namespace tandem::cpu_attention::internal
